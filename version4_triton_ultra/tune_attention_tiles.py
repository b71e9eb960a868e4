"""Time version 4's flash-attention kernels under other tiles at one shape, and check each against float64.

    python tune_attention_tiles.py                                     (the large preset's: 8 x 16 x 1024, Dh 128)
    python tune_attention_tiles.py --shape 16x16x512 --head-dim 64     (the medium preset's)
    python tune_attention_tiles.py --kernels dq,dkdv --dtype float16
    python tune_attention_tiles.py --others portable                   (the other kernels on version 3's tiles)
    python tune_attention_tiles.py --in-step medium --kernels dq,dkdv --step-rounds 7
    python tune_attention_tiles.py --shape 16x16x512 --head-dim 64 --kernels dkdv --candidates 32,128,4,3 32,128,4,5

kernels/flash_attention.py launches its three kernels with FIXED tiles, warps and pipeline stages
(`_launch_config`). This script replaces one kernel's choice at a time (the other two keep theirs) and times the
pass that kernel belongs to (the forward: one kernel; the backward: dq then dk/dv, RoPE rotated back as the
model's backward does). A configuration is worth adopting only if it is faster AND right: each is run on a
one-sequence, two-head problem of the same length against attention computed in float64, and the "error" column
is the largest relative error of out (forward) or of dq, dk, dv (backward); "WRONG" marks one above the tolerance
the kernel tests use. The first row of each kernel is the tiles it runs with now, the others a built-in list per
kernel or --candidates (tried for every kernel of --kernels). --others says what the kernels not being tuned run
with: `current` (the module's rule on this GPU) or `portable` (version 3's rule, as they ran when the Hopper tiles
were chosen: benchmarks/results/kernel_time/h100_attention_tiles_by_shape.json).

How it times (tinytransformer/kernel_bench/graph_timing.py): each candidate's pass as a CUDA/HIP graph of 10
passes, the candidates of a kernel replayed in turns, 7 rounds, median. Not triton.testing.do_bench one candidate
after another: on one H100 the same tiles timed that way twice, a minute apart, gave 151 and 201 us. A pass of the
kernel alone is not the step, where the kernels before and after it share the L2 cache and the clocks:
`--in-step PRESET` settles it, as tune_norm_backward.py's does. Version 4's graph-captured step at that preset
(profile_graphed_step.build_step, bfloat16) is built once under the current tiles and once under each of the two
fastest right candidates of every kernel of --kernels, and the steps are timed in turns (--step-rounds rounds,
each the median of 30 replays), with how many rounds each was faster than the current tiles. The preset sets the
shape (--shape and --head-dim may be left out); a preset whose step takes cuDNN's attention on this GPU
(fused_layers.vendor_attention_pays) is refused, since these tiles do not run there. --output-json writes every
row, the machine and the command. Needs a GPU (version 3's tune_flash_attention.py is the same idea for its
kernels).
"""
import contextlib
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line, positive_int, run_command  # noqa: E402
from tinytransformer.config import (ModelConfig, TrainConfig, available_presets,  # noqa: E402
                                   preset_settings)
from tinytransformer.device import software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.correctness import dots_tolerance, relative_error  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms, rounds_in_turns  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import (candidates_from_flags, prove_output_json,  # noqa: E402
                                                  refuse_without_gpu, why_unavailable)
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from version4_triton_ultra.attention_check_problem import Problem  # noqa: E402
from version4_triton_ultra.fused_layers import vendor_attention_pays  # noqa: E402
from version4_triton_ultra.kernels import flash_attention as fa  # noqa: E402

PASSES_PER_GRAPH = 10
ROUNDS = 7
STEP_CANDIDATES_PER_KERNEL = 2   # the fastest right candidates of each kernel that --in-step times in the step
# The float64 check computes a [S, S] score matrix per head (two heads) with autograd: a few such tensors of 8-byte
# values, about 8 GB at this length.
MAX_CHECKED_SEQ_LEN = 16384
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (BLOCK_M, BLOCK_N, num_warps, num_stages); for dk/dv BLOCK_N is the keys a program owns, BLOCK_M the query step.
CANDIDATES = {
    "forward": [(64, 32, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (128, 128, 8, 1), (64, 64, 4, 2), (64, 64, 4, 3),
                (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 4), (128, 64, 8, 4)],
    "dq": [(32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 4, 1), (64, 64, 8, 1), (128, 64, 8, 1), (128, 32, 8, 1),
           (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)],
    "dkdv": [(32, 32, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (64, 64, 8, 1), (64, 128, 8, 1), (32, 128, 8, 1),
             (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
}


def tiles_of(text: str) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from "M,N,W,S"; ValueError saying what was expected otherwise.
    Blocks are powers of two from 16 (the smallest tile tl.dot takes) to 256, warps a power of two up to 16 (the
    most wavefronts of 64 an AMD workgroup holds), stages 1 to 8."""
    parts = text.split(",")
    if len(parts) == 4 and all(p.isdecimal() for p in parts):
        block_m, block_n, warps, stages = (int(p) for p in parts)
        blocks_ok = all(16 <= b <= 256 and b & (b - 1) == 0 for b in (block_m, block_n))
        if blocks_ok and 1 <= warps <= 16 and warps & (warps - 1) == 0 and 1 <= stages <= 8:
            return block_m, block_n, warps, stages
    raise ValueError(f"expected BLOCK_M,BLOCK_N,WARPS,STAGES (blocks powers of two from 16 to 256, warps a power of "
                     f"two up to 16, stages 1 to 8; e.g. 64,64,4,2), got {text!r}")


def parse_args(argv):
    parser = OneLineParser(prog="tune_attention_tiles.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="batch x heads x sequence [8x16x1024, or --in-step's preset's]")
    parser.add_argument("--head-dim", type=int, choices=fa.SUPPORTED_HEAD_DIMS,
                        help="[128, or --in-step's preset's]")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--kernels", default="forward,dq,dkdv", help="comma-separated, from forward,dq,dkdv [all]")
    parser.add_argument("--others", choices=["current", "portable"], default="current",
                        help="tiles of the kernels not being tuned: this GPU's rule, or version 3's [current]")
    parser.add_argument("--candidates", nargs="+", metavar="M,N,W,S",
                        help="tiles to try for every kernel of --kernels: BLOCK_M,BLOCK_N,WARPS,STAGES (for dk/dv "
                             "BLOCK_N is the keys a program owns, BLOCK_M the query step) [a built-in list per kernel]")
    parser.add_argument("--in-step", choices=available_presets(), metavar="PRESET",
                        help="also time version 4's step at this preset (bfloat16) under the current tiles and the "
                             f"{STEP_CANDIDATES_PER_KERNEL} fastest right candidates of each kernel")
    parser.add_argument("--step-rounds", type=positive_int, default=5,
                        help="interleaved rounds of the steps timed by --in-step [5]")
    parser.add_argument("--output-json", help="also write every row, the machine and the command here")
    args = parser.parse_args(argv)
    # Each kernel and each candidate once: a repeat would be timed twice under one name.
    args.candidates = list(dict.fromkeys(candidates_from_flags(parser, args.candidates, tiles_of, [])))
    args.kernels = list(dict.fromkeys(k.strip() for k in args.kernels.split(",") if k.strip()))
    unknown = [k for k in args.kernels if k not in CANDIDATES]
    if unknown or not args.kernels:
        parser.error(f"--kernels: choose from forward,dq,dkdv (got {args.kernels!r})")
    if args.in_step and args.others == "portable":
        parser.error("--in-step: version 4's step runs the kernels not being tuned on this GPU's tiles, so its "
                     "candidates are chosen that way too; drop --others portable")
    problem = choose_shape(args)
    if problem:
        parser.error(problem)
    prove_output_json(parser, args.output_json)
    refuse_without_gpu(parser)
    if args.in_step:
        if vendor_attention_pays(torch.device("cuda"), DTYPES[args.dtype], args.head_dim):
            parser.error(f"--in-step {args.in_step}: version 4's step takes cuDNN's attention at head dim "
                         f"{args.head_dim} on this GPU (fused_layers.vendor_attention_pays), so these tiles do not "
                         "run in it")
        # The step's own flags, checked now rather than after minutes of timing the kernels.
        from version4_triton_ultra import profile_graphed_step
        args.step_args = profile_graphed_step.parse_args(["--preset", args.in_step, "--use-amp"], prog=parser.prog)
    return args


def preset_attention_shape(preset: str) -> tuple:
    """(batch, heads, sequence, head dim) of the attention in a preset's training step."""
    model_fields, train_fields = preset_settings(preset)
    model, train = ModelConfig(**model_fields), TrainConfig(**train_fields)   # a field left out takes its default
    return train.batch_size, model.num_heads, train.seq_len, model.head_dim


def choose_shape(args) -> str | None:
    """Sets args.batch, heads, seq_len and head_dim from --shape and --head-dim, or from --in-step's preset where they
    are left out; the one-line problem with the flags, or None. With --in-step the timed step is the preset's, so
    the flags may only repeat its shape, and its dtype is bfloat16."""
    if args.in_step:
        batch, heads, seq_len, head_dim = preset_attention_shape(args.in_step)
        preset_shape = f"{batch}x{heads}x{seq_len}"
        if (args.shape or preset_shape).lower() != preset_shape or args.head_dim not in (None, head_dim):
            return (f"--in-step {args.in_step}: its attention is {preset_shape} (batch x heads x sequence) at head dim "
                    f"{head_dim}; drop --shape and --head-dim, or give those")
        if head_dim not in fa.SUPPORTED_HEAD_DIMS:
            return f"--in-step {args.in_step}: head dim {head_dim} is not one the attention kernels take"
        if args.dtype != "bfloat16":
            return f"--in-step: version 4's step runs under bfloat16 autocast; drop --dtype {args.dtype}"
        args.shape, args.head_dim = preset_shape, head_dim
    args.shape = args.shape or "8x16x1024"
    args.head_dim = args.head_dim or 128
    parts = args.shape.lower().split("x")
    if len(parts) != 3 or not all(p.isdecimal() and int(p) > 0 for p in parts):
        return f"--shape: expected BATCHxHEADSxSEQ (e.g. 8x16x1024), got {args.shape!r}"
    args.batch, args.heads, args.seq_len = (int(p) for p in parts)
    if args.seq_len > MAX_CHECKED_SEQ_LEN:
        return (f"--shape: sequences of at most {MAX_CHECKED_SEQ_LEN} (the float64 check builds the S x S scores), "
                f"got {args.seq_len}")
    problem = fa.shape_problem(args.batch * args.heads, args.seq_len, args.head_dim, 3 * args.heads * args.head_dim)
    return f"--shape {args.shape} at head dim {args.head_dim}: {problem}" if problem else None


def portable_launch_config(head_dim, dtype, seq_len, name, *rest, **options):
    """fa._launch_config's signature, version 3's choice on every GPU."""
    return fa._portable_launch_config(head_dim, dtype, name)


def with_tiles(kernel, tiles, others):
    """A stand-in for fa._launch_config: `tiles` for `kernel`, the launch rule `others` for the other kernels."""
    block_m, block_n, warps, stages = tiles

    def launch_config(head_dim, dtype, seq_len, name, *rest, **options):
        if name == kernel:
            return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return others(head_dim, dtype, seq_len, name, *rest, **options)
    return launch_config


class Problems(NamedTuple):
    """What every candidate of a kernel is run on: the timed problem and the forward output its backward reads,
    the small checked problem with its float64 reference, and the dtype's tolerance."""
    timed: Problem
    forward_output: tuple
    checked: Problem
    reference: tuple
    tolerance: float


def pass_error(kernel, checked, reference) -> float:
    """The largest relative error against float64 of the pass `kernel` belongs to, under the current _launch_config:
    of out for the forward, of dq, dk and dv for the backward."""
    out, lse = checked.forward()
    if kernel == "forward":
        return relative_error(out, reference[0])
    grads = checked.backward(out, lse).split(checked.dim, dim=-1)
    return max(relative_error(g, r) for g, r in zip(grads, reference[1]))


def pass_graph(kernel, timed, forward_output):
    """A graph of PASSES_PER_GRAPH passes of the one `kernel` belongs to, captured under the current _launch_config
    (a graph keeps the launches it records). The backward reads `forward_output`, (out, lse) of one forward pass."""
    if kernel == "forward":
        return captured_launches(timed.forward, PASSES_PER_GRAPH)
    return captured_launches(lambda: timed.backward(*forward_output), PASSES_PER_GRAPH)


def label(tiles) -> str:
    return "{}x{} w{} s{}".format(*tiles)


def row_tiles(row: dict) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a row of tile_rows, or of a launch _launch_config gives."""
    return row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]


@contextlib.contextmanager
def launch_rule(launch_config):
    """fa._launch_config is `launch_config` inside the block, and the module's own again however the block ends."""
    original = fa._launch_config
    fa._launch_config = launch_config
    try:
        yield
    finally:
        fa._launch_config = original


def tile_rows(kernel, args, problems: Problems, others) -> list[dict]:
    """One row per tiles tried for `kernel` (its current tiles first): microseconds per pass, error, verdict."""
    current_tiles = row_tiles(fa._launch_config(args.head_dim, DTYPES[args.dtype], args.seq_len, kernel))
    candidates = args.candidates or CANDIDATES[kernel]
    rows, graphs = [], {}
    for tiles in [current_tiles] + [t for t in candidates if t != current_tiles]:
        row = {"kernel": kernel, "tiles": label(tiles), "BLOCK_M": tiles[0], "BLOCK_N": tiles[1],
               "num_warps": tiles[2], "num_stages": tiles[3], "current": tiles == current_tiles}
        try:
            with launch_rule(with_tiles(kernel, tiles, others)):   # the graph keeps the launches it captures
                row["relative_error"] = pass_error(kernel, problems.checked, problems.reference)
                row["check"] = "ok" if row["relative_error"] < problems.tolerance else "WRONG"
                graphs[row["tiles"]] = pass_graph(kernel, problems.timed, problems.forward_output)
        except Exception as why:   # noqa: BLE001 - a config this GPU cannot compile or run is not a candidate
            row["fails"] = why_unavailable(why)
        rows.append(row)
    times = rounds_in_turns({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)
    for row in rows:
        if row["tiles"] in times:
            row["pass_us"] = 1000.0 * statistics.median(times[row["tiles"]]) / PASSES_PER_GRAPH
    return rows


def fastest_right_candidates(rows: list[dict], count: int = STEP_CANDIDATES_PER_KERNEL) -> list[dict]:
    """The `count` fastest rows that are not the current tiles, ran, and passed the float64 check."""
    right = [row for row in rows if not row["current"] and row.get("check") == "ok" and "pass_us" in row]
    return sorted(right, key=lambda row: row["pass_us"])[:count]


def time_in_step(step_args, chosen: list[dict], rounds: int) -> dict:
    """{name: [ms of each round]}: version 4's step (profile_graphed_step's `step_args`) under the current tiles
    ("current") and under each chosen row's tiles for its kernel, each captured under its tiles, then timed in
    turns, 30 replays a round (step_forms.py)."""
    from version4_triton_ultra import step_forms
    forms = {"current": (step_args, None)}
    forms.update({f"{row['kernel']} {row['tiles']}":
                  (step_args, launch_rule(with_tiles(row["kernel"], row_tiles(row), fa._launch_config)))
                  for row in chosen})
    captured = step_forms.capture_forms(forms, fewer="pass fewer --kernels (the tile rows are written already "
                                                     "where --output-json is given)")
    return step_forms.time_in_turns(captured, rounds, replays=30)


def print_tile_rows(rows: list[dict]) -> None:
    for row in rows:
        name = row["tiles"] + ("  (current)" if row["current"] else "")
        if "fails" in row:
            shown = f"fails: {row['fails'][:80]}"
        else:
            shown = f"{row['pass_us']:9.1f} us  error {row['relative_error']:.1e}  {row['check']}"
        print(f"{row['kernel']:<8} {name:<24} {shown}", flush=True)


def print_step_rows(rows: list[dict], preset: str, rounds: int) -> None:
    print(f"version 4's step at the {preset} preset (bfloat16): median of {rounds} interleaved rounds, each the "
          "median of 30 replays")
    for row in rows:   # the first form is always the current tiles (time_in_step)
        print(f"{row['form']:<24} {row['median_step_ms']:8.3f} ms {row['relative_to_first']:7.4f}x  faster than "
              f"current in {row['rounds_faster_than_first']} of {rounds} rounds")


def write_results(args, argv, rows: list[dict], steps: list[dict] | None) -> None:
    """--output-json: every tile row, and with --in-step the step's rows (None until they are timed)."""
    benchmark = (f"version 4's flash-attention passes under candidate tiles, one kernel's tiles changed at a time, "
                 f"graphs of {PASSES_PER_GRAPH} passes, median of {ROUNDS} interleaved rounds")
    if args.in_step:
        benchmark += (f"; then version 4's {args.in_step} step under the current tiles and the "
                      f"{STEP_CANDIDATES_PER_KERNEL} fastest right candidates of each kernel, in turns")
    in_step = {"preset": args.in_step, "rounds": args.step_rounds, "rows": steps} if args.in_step else None
    write_json(args.output_json, {
        "benchmark": benchmark,
        "command": "python version4_triton_ultra/" + command_line("tune_attention_tiles.py", argv),
        "environment": software_and_gpu(), "dtype": args.dtype, "others": args.others,
        "shape": {"batch": args.batch, "heads": args.heads, "seq_len": args.seq_len, "head_dim": args.head_dim},
        "results": rows, "in_step": in_step})


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command("tune_attention_tiles.py", lambda: tune(args, argv))


def tune(args, argv) -> int:
    dtype = DTYPES[args.dtype]
    tolerance = dots_tolerance(dtype, torch.device("cuda"))   # float32 through TF32 on NVIDIA, as the kernels run
    torch.manual_seed(0)
    timed = Problem(args.batch, args.heads, args.seq_len, args.head_dim, dtype)
    checked = Problem(1, 2, args.seq_len, args.head_dim, dtype)
    problems = Problems(timed, timed.forward(), checked, checked.reference(), tolerance)
    print(f"{torch.cuda.get_device_name()}: {args.shape}, head dim {args.head_dim}, {args.dtype}, causal; us per "
          f"pass (graph of {PASSES_PER_GRAPH}, median of {ROUNDS} interleaved rounds); error against float64 "
          f"(tolerance {tolerance:.0e}); the kernels not being tuned run with the {args.others} tiles")
    others = portable_launch_config if args.others == "portable" else fa._launch_config
    rows = []
    for kernel in args.kernels:
        rows += tile_rows(kernel, args, problems, others)
        print_tile_rows([row for row in rows if row["kernel"] == kernel])
    if args.output_json:   # now, so that the tile rows survive a step that does not fit
        write_results(args, argv, rows, None)
    if args.in_step:
        del problems, timed   # their memory, before whole steps are built
        torch.cuda.empty_cache()
        chosen = [row for kernel in args.kernels
                  for row in fastest_right_candidates([r for r in rows if r["kernel"] == kernel])]
        from version4_triton_ultra import step_forms
        steps = step_forms.step_table(time_in_step(args.step_args, chosen, args.step_rounds))
        print_step_rows(steps, args.in_step, args.step_rounds)
        if args.output_json:
            write_results(args, argv, rows, steps)
    if args.output_json:
        print(f"results: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
