"""Time version 4's loss kernel (kernels/linear_cross_entropy.py) under other launches at one preset's shape.

    python tune_cross_entropy.py --preset medium
    python tune_cross_entropy.py --preset small --candidates 4096,4 4096,8 --output-json runs/loss_small.json

The fused head computes its logits a chunk of rows at a time; for each chunk one kernel computes every row's loss
and overwrites the logits with the loss's gradient, softmax - onehot(target), divided by the number of rows that
count in bfloat16 and float32 (as the step's kernel does: DIVIDED_IN_FORWARD). A row longer than a block is read
twice (its log-sum-exp first, then the gradient) and written once, so the kernel streams: its goal is the memory
bandwidth. Its launch is the block of vocabulary entries a program takes at a time and the warps of the one
program a row (kernels/linear_cross_entropy.py: cross_entropy_launch). Each candidate is BLOCK_V,WARPS (powers
of two); a block that holds the whole row reads it once. The first row of the table is the rule's own launch.

What it times: a chunk of the preset's rows (as many as the head's default chunk holds, at most the batch's
tokens) of random logits in --dtype, a CUDA/HIP graph of 12 launches per candidate taking turns on copies that
hold three times the L2 cache, replayed in interleaved rounds (median of 5, microseconds per launch), as
tune_qk_rotation.py times (tinytransformer/kernel_bench/graph_timing.py). Every launch after a copy's first
works on the gradient the one before left there: the same work on other numbers. GB/s counts the logits read
twice and written once (read once with a one-block launch).

The check: each candidate's losses and gradients on fresh logits against float64, within the kernel tests'
tolerances (the sums run in another order under another launch), else the row says WRONG. Needs a GPU.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line  # noqa: E402
from tinytransformer.config import ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

import triton  # noqa: E402

from tinytransformer.device import peak_bandwidth_tbs, software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import (buffer_count, captured_launches, graph_ms,  # noqa: E402
                                                     time_interleaved)
from tinytransformer.kernel_bench.tuner_cli import (candidates_from_flags, powers_of_two,  # noqa: E402
                                                  prove_output_json, refuse_without_gpu)
from version4_triton_ultra.kernels import linear_cross_entropy as lce  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Largest gradient error against float64 (softmax - onehot lies in [-1, 1]): the dtype's rounding, with room.
GRADIENT_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LOSS_TOLERANCE = 1e-4   # relative, per row: the loss is summed in float32 under every launch
LAUNCHES_PER_GRAPH = 12
ROUNDS = 5


def default_candidates(vocab_size: int) -> list:
    """Blocks of 2,048 to 8,192 entries (at most the row rounded up to a power of two), 4, 8 or 16 warps."""
    largest = triton.next_power_of_2(vocab_size)
    return [(block, warps) for block in (2048, 4096, 8192) if block <= largest for warps in (4, 8, 16)]


def candidate(text: str) -> tuple:
    block, warps = powers_of_two(text, "BLOCK_V,WARPS", "4096,8")
    if warps > 32 or block > 65536:
        raise ValueError(f"{text}: at most 32 warps and 65,536 entries a block")
    return block, warps


def parse_args(argv):
    parser = OneLineParser(prog="tune_cross_entropy.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=available_presets(), default="medium",
                        help="the vocabulary, batch and sequence of configs/PRESET.yaml [medium]")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the logits' dtype [bfloat16]")
    parser.add_argument("--candidates", nargs="+", metavar="B,W",
                        help="launches to try: vocabulary entries a block, warps a row [a built-in list]")
    parser.add_argument("--output-json", help="also write the table, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    model, train = preset_settings(args.preset)
    args.vocab_size = ModelConfig(**model).vocab_size
    args.rows = min(lce.default_chunk_rows(args.vocab_size, DTYPES[args.dtype]), train["batch_size"] * train["seq_len"])
    args.candidates = candidates_from_flags(parser, args.candidates, candidate, default_candidates(args.vocab_size))
    args.candidates = [c for c in args.candidates if c != lce.cross_entropy_launch(args.vocab_size)]
    refuse_without_gpu(parser)
    return args


def reference(logits: torch.Tensor, targets: torch.Tensor):
    """(per-row loss, softmax - onehot) in float64."""
    wide = logits.double()
    loss = torch.logsumexp(wide, dim=1) - wide.gather(1, targets[:, None])[:, 0]
    grad = torch.softmax(wide, dim=1)
    grad[torch.arange(len(targets), device=logits.device), targets] -= 1.0
    return loss, grad


def grad_scale_of(logits: torch.Tensor):
    """What the step's loss kernel multiplies the gradient by for logits of this dtype: 1 / rows (every target
    counts here) where the forward pass divides (DIVIDED_IN_FORWARD), else None (unscaled)."""
    if logits.dtype not in lce.DIVIDED_IN_FORWARD:
        return None
    return torch.tensor([1.0 / logits.shape[0]], dtype=torch.float32, device=logits.device)


def check(logits, targets, want, launch) -> str:
    got_grad, got_loss = logits.clone(), torch.empty(len(targets), dtype=torch.float32, device=logits.device)
    grad_scale = grad_scale_of(logits)
    lce.cross_entropy_rows_(got_grad, targets, got_loss, launch=launch, grad_scale=grad_scale)
    want_loss, want_grad = want
    loss_ok = torch.allclose(got_loss.double(), want_loss, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE)
    # Multiplied back by the rows before the comparison: the tolerance is for values up to 1, and rounding a
    # divided value errs by as much relative to it, which the multiplication restores to that scale.
    got_undivided = got_grad.double() / (grad_scale.item() if grad_scale is not None else 1.0)
    grad_ok = (got_undivided - want_grad).abs().max().item() <= GRADIENT_TOLERANCE[logits.dtype]
    return "ok" if loss_ok and grad_ok else "WRONG"


def label(launch) -> str:
    return "{} a block, {} warps".format(*launch)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab_size, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, args.vocab_size, (args.rows,), device="cuda")
    want = reference(logits, targets)
    logit_bytes = logits.numel() * logits.element_size()
    copies = [logits.clone() for _ in range(buffer_count(logit_bytes))]
    row_loss = torch.empty(args.rows, dtype=torch.float32, device="cuda")
    grad_scale = grad_scale_of(logits)
    graphs, verdicts, bytes_moved = {}, {}, {}
    rule = lce.cross_entropy_launch(args.vocab_size)
    launches = {"the rule ({}, {} warps)".format(*rule): rule, **{label(c): c for c in args.candidates}}
    for name, launch in launches.items():
        try:
            verdicts[name] = check(logits, targets, want, launch)
            turns = itertools.cycle(copies)
            graphs[name] = captured_launches(
                lambda launch=launch: lce.cross_entropy_rows_(next(turns), targets, row_loss, launch=launch,
                                                              grad_scale=grad_scale),
                LAUNCHES_PER_GRAPH)
            bytes_moved[name] = logit_bytes * (2 if args.vocab_size <= launch[0] else 3)
        except Exception as why:   # noqa: BLE001 - a launch this GPU cannot compile or run is not a candidate
            print(f"{name:<34} fails: {str(why).splitlines()[0][:80]}")
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)
    peak = peak_bandwidth_tbs(torch.cuda.get_device_name())
    print(f"{torch.cuda.get_device_name()}: loss and gradient of {args.rows} rows x {args.vocab_size} logits "
          f"({args.preset}), {args.dtype}; us per launch (graph of {LAUNCHES_PER_GRAPH}, median of {ROUNDS} rounds)")
    rows = []
    for name, ms in times.items():
        us = 1000.0 * ms / LAUNCHES_PER_GRAPH
        share = f"{bytes_moved[name] / us / 1e6 / peak:6.1%}" if peak else "     -"
        print(f"{name:<34} {us:8.1f} us  {bytes_moved[name] / us / 1e3:7.0f} GB/s {share}  {verdicts[name]}")
        rows.append({"launch": name, "us_per_launch": us, "gb_per_s": bytes_moved[name] / us / 1e3,
                     "check": verdicts[name]})
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "version 4's loss kernel (cross_entropy_rows_) under candidate launches, graph of "
                         f"{LAUNCHES_PER_GRAPH} launches, median of {ROUNDS} interleaved rounds",
            "command": "python version4_triton_ultra/" + command_line("tune_cross_entropy.py", argv),
            "environment": software_and_gpu(), "preset": args.preset, "dtype": args.dtype, "rows": args.rows,
            "vocab_size": args.vocab_size, "peak_bandwidth_tbs": peak, "results": rows})
        print(f"results: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
