"""Time version 4's add + RMSNorm backward kernel under other launches at one width, and check each.

    python tune_norm_backward.py                                  (512 features, the small preset's width)
    python tune_norm_backward.py --features 2048 --rows 8192      (the large preset's rows)
    python tune_norm_backward.py --features 512 --rows 4096 --in-step small
    python tune_norm_backward.py --features 1024 --candidates 4,8,2,1 2,4,2,1
    python tune_norm_backward.py --features 1024 --candidates 4,8,2,1,0 --in-step medium

kernels/add_rmsnorm.py launches its backward kernel by rules of the row width (`_backward_tile`,
`_programs_per_sm`, `_prefetches`, `_shared_vector`): rows per tile, warps, programs per SM, whether the next tile
is loaded before the current one is computed, and how many columns a thread moves together in every tensor. Each
candidate here is ROWS,WARPS,PROGRAMS_PER_SM,PREFETCH (0 or 1), optionally followed by ,VECTOR (0: each tensor
laid out by its own dtype, as the kernel was before `_shared_vector`; else a power of two), and replaces those rules
at this width only (without VECTOR, the rule's). The first row of the table is the rules' own launch.

How it times (tinytransformer/kernel_bench/graph_timing.py): one CUDA/HIP graph of 20 back-to-back launches per
candidate, replayed in interleaved rounds (median of 5, microseconds per launch). Not do_bench per call: this
kernel takes 15-120 us, and a Python launch of it (allocations, argument packing) can take longer, so a per-call
timer measures the host; that is why an earlier do_bench figure of ~135 us at 8,192 x 512 was far from the
kernel's ~30 us. The 20 launches read the same inputs, so at small row counts part of them stays in the L2 cache,
as in the training step, where each norm reads what the kernel before it has just written. `--in-step PRESET`
settles it: version 4's graph-captured step at that preset (profile_graphed_step.build_step), once under the rules
and once under each of the 2 fastest candidates, timed in interleaved rounds.

Every candidate is checked against float64: grad_h and the weight gradient (its float32 sum of the rows'
contributions) to a relative error below 1e-5, the bfloat16 copy of grad_h below 2e-2, else the row says WRONG.
Candidate tiles above 16,384 elements are skipped. Needs a GPU.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, positive_int  # noqa: E402
from tinytransformer.config import ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms, time_interleaved  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import candidates_from_flags, refuse_without_gpu  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

import triton  # noqa: E402

from version4_triton_ultra.kernels import add_rmsnorm as norm  # noqa: E402

TOLERANCE = 1e-5        # float32 results against float64 (DESIGN.md's tolerance for float32)
COPY_TOLERANCE = 2e-2   # the bfloat16 copy of grad_h (DESIGN.md's tolerance for bfloat16)
MAX_TILE_ELEMENTS = 16384   # larger candidate tiles (e.g. 8 rows of 8,192 features) would spill: skipped
LAUNCHES_PER_GRAPH = 20
ROUNDS = 5
# (rows per tile, warps, programs per SM, prefetch, vector: None for the rule's), tried at every width; the rules'
# own launch comes first.
CANDIDATES = [(8, 4, 4, False, None), (8, 4, 2, False, None), (4, 4, 2, True, None), (4, 8, 2, True, None),
              (4, 4, 1, True, None), (2, 4, 2, True, None), (2, 8, 2, True, None), (1, 4, 2, True, None),
              (4, 2, 4, True, None), (2, 2, 8, False, None)]


def candidate(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts) or parts[3] not in ("0", "1"):
        raise ValueError(f"expected ROWS,WARPS,PROGRAMS_PER_SM,PREFETCH[,VECTOR] (e.g. 4,4,2,1), got {text!r}")
    rows, warps, per_sm, prefetch = (int(p) for p in parts[:4])
    vector = int(parts[4]) if len(parts) == 5 else None   # None: the rule's
    if rows not in (1, 2, 4, 8, 16, 32) or per_sm < 1 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{text!r}: rows and warps powers of two (up to 32 and 16), programs per SM >= 1")
    if vector not in (None, 0, 1, 2, 4, 8, 16):
        raise ValueError(f"{text!r}: VECTOR is 0 (each tensor its own layout) or a power of two up to 16")
    return rows, warps, per_sm, bool(prefetch), vector


def parse_args(argv):
    parser = OneLineParser(prog="tune_norm_backward.py", description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=positive_int, default=512, help="row width D [512]")
    parser.add_argument("--rows", type=positive_int, default=8192, help="rows N (batch x sequence) [8192]")
    parser.add_argument("--candidates", nargs="+", metavar="R,W,P,F[,V]",
                        help="launches to try: rows per tile, warps, programs per SM, prefetch 0/1, and optionally "
                             "the vector (0: each tensor its own layout) [a built-in list]")
    parser.add_argument("--step-rounds", type=positive_int, default=3,
                        help="interleaved rounds of the steps timed by --in-step [3]")
    parser.add_argument("--in-step", choices=available_presets(), metavar="PRESET",
                        help="also time version 4's step at this preset under the rules and the 2 fastest candidates")
    args = parser.parse_args(argv)
    problem = norm.shape_problem(args.features)
    if problem:
        parser.error(problem)
    args.candidates = candidates_from_flags(parser, args.candidates, candidate, CANDIDATES)
    block_d = triton.next_power_of_2(args.features)
    args.candidates = [c for c in args.candidates if c[0] * block_d <= MAX_TILE_ELEMENTS]
    if args.in_step:
        width = ModelConfig(**preset_settings(args.in_step)[0]).hidden_dim
        if triton.next_power_of_2(width) != block_d:
            parser.error(f"--in-step {args.in_step}: its rows are {width} features wide, not {args.features}; "
                         f"pass --features {width}")
    refuse_without_gpu(parser)
    return args


class Override:
    """Replaces the backward kernel's launch rules (_backward_tile, _programs_per_sm, _prefetches, and
    _shared_vector when the launch names a VECTOR) for rows of block_d features (None: the rules as they are),
    inside a `with` block. The vector rule is asked by dtypes, not width, so it is replaced at every width."""

    def __init__(self, block_d: int, launch):
        self.block_d, self.launch = block_d, launch
        self.saved = (norm._backward_tile, norm._programs_per_sm, norm._prefetches, norm._shared_vector)

    def __enter__(self):
        if self.launch is None:
            return self
        tile, per_sm_rule, prefetches, _ = self.saved
        rows, warps, per_sm, prefetch, vector = self.launch
        ours = lambda block_d: block_d == self.block_d  # noqa: E731
        norm._backward_tile = lambda block_d, *rest: (rows, warps) if ours(block_d) else tile(block_d, *rest)
        norm._programs_per_sm = lambda block_d: per_sm if ours(block_d) else per_sm_rule(block_d)
        norm._prefetches = lambda block_d: prefetch if ours(block_d) else prefetches(block_d)
        if vector is not None:
            norm._shared_vector = lambda *dtypes: vector
        return self

    def __exit__(self, *exc):
        norm._backward_tile, norm._programs_per_sm, norm._prefetches, norm._shared_vector = self.saved


def make_inputs(n_rows, n_features, device="cuda"):
    """The backward's inputs as version 4's step hands them over under bfloat16 autocast: the float32 stream h,
    the weight, rstd, grad_normed in bfloat16 and grad_new_residual in float32."""
    torch.manual_seed(0)
    h = torch.randn(n_rows, n_features, device=device)
    weight = 1.0 + 0.1 * torch.randn(n_features, device=device)
    rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)
    grad_normed = torch.randn(n_rows, n_features, device=device).to(torch.bfloat16)
    grad_residual = torch.randn(n_rows, n_features, device=device)
    return h, weight, rstd, grad_normed, grad_residual


def run_backward(inputs):
    h, weight, rstd, grad_normed, grad_residual = inputs
    return norm._rms_norm_backward(h, weight, rstd, grad_normed, grad_residual, copy_dtype=torch.bfloat16)


def reference(inputs):
    """(grad_h, grad_weight) in float64, from the formula in add_rmsnorm.py's docstring."""
    h, weight, rstd, grad_normed, grad_residual = (t.double() for t in inputs)
    x_hat = h * rstd[:, None]
    g = grad_normed * weight
    grad_h = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) + grad_residual
    return grad_h, (grad_normed * x_hat).sum(0)


def relative_error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def largest_error(outputs, want) -> float:
    """The largest relative error of grad_h, its bfloat16 copy and the weight gradient against float64, each as a
    fraction of its own tolerance times TOLERANCE (so one number compares with TOLERANCE)."""
    grad_h, copy, grad_weight = outputs
    return max(relative_error(grad_h, want[0]), relative_error(grad_weight, want[1]),
               relative_error(copy, want[0]) / COPY_TOLERANCE * TOLERANCE)


def label(launch) -> str:
    if launch is None:
        return "the rules"
    rows, warps, per_sm, prefetch, vector = launch
    vector_text = "" if vector is None else (", own layouts" if vector == 0 else f", vector {vector}")
    return f"{rows} rows, {warps} warps, {per_sm}/SM" + ", prefetch" * prefetch + vector_text


def time_in_step(preset: str, launches: list, block_d: int, rounds: int = 3) -> list[dict]:
    """step_forms.step_table's rows, one per launch (its label the form): version 4's bfloat16 step at `preset`
    captured under each launch, the first the reference, timed in turns, 30 replays a round (step_forms.py)."""
    from version4_triton_ultra import profile_graphed_step, step_forms
    args = profile_graphed_step.parse_args(["--preset", preset, "--use-amp"])
    captured = step_forms.capture_forms({label(launch): (args, Override(block_d, launch)) for launch in launches},
                                        fewer="time the launches alone (without --in-step) on this GPU")
    return step_forms.step_table(step_forms.time_in_turns(captured, rounds, replays=30))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    block_d = triton.next_power_of_2(args.features)
    inputs = make_inputs(args.rows, args.features)
    want = reference(inputs)
    bytes_moved = args.rows * args.features * 16   # h 4, grad_normed 2, grad_residual 4 read; grad_h 4 + 2 written
    graphs, errors = {}, {}
    for launch in [None] + args.candidates:
        name = label(launch)
        with Override(block_d, launch):
            try:
                errors[name] = largest_error(run_backward(inputs), want)
                graphs[name] = captured_launches(lambda: run_backward(inputs), LAUNCHES_PER_GRAPH)
            except Exception as why:   # noqa: BLE001 - a launch this GPU cannot compile or run is not a candidate
                print(f"{name:<46} fails: {str(why).splitlines()[0][:80]}")
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)
    print(f"{torch.cuda.get_device_name()}: backward of {args.rows} x {args.features}, bfloat16 gradients; "
          f"us per launch (graph of {LAUNCHES_PER_GRAPH}, median of {ROUNDS} rounds); error against float64")
    for name, ms in times.items():
        us = 1000.0 * ms / LAUNCHES_PER_GRAPH
        verdict = "ok" if errors[name] < TOLERANCE else "WRONG"
        print(f"{name:<46} {us:8.1f} us  {bytes_moved / us / 1e3:7.0f} GB/s  error {errors[name]:.1e}  {verdict}")
    if args.in_step:
        del graphs   # their memory, before whole steps are built (three at the large preset: ~23 GB each)
        torch.cuda.empty_cache()
        fastest = sorted((ms, name) for name, ms in times.items()
                         if name != label(None) and errors[name] < TOLERANCE)[:2]
        chosen = [None] + [launch for launch in args.candidates if label(launch) in {n for _, n in fastest}]
        print(f"version 4's step at the {args.in_step} preset (bfloat16), ms, median of {args.step_rounds} "
              "interleaved rounds of 30 replays, against the rules:")
        for row in time_in_step(args.in_step, chosen, block_d, args.step_rounds):
            print(f"{row['form']:<46} {row['median_step_ms']:8.3f} ms {row['relative_to_first']:7.4f}x  faster in "
                  f"{row['rounds_faster_than_first']} of {args.step_rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
