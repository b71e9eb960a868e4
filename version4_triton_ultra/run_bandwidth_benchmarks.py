"""Do version 4's memory-bound kernels stream at the widths real models use? Each one's achieved bandwidth, and its
share of the GPU's data-sheet bandwidth, at hidden sizes 1,024 to 4,096.

    python run_bandwidth_benchmarks.py                                  (hidden 1,024, 2,048, 4,096; 8,192 rows)
    python run_bandwidth_benchmarks.py --hidden-sizes 2048 --kernel norm_backward,adamw
    python run_bandwidth_benchmarks.py --output-json bandwidth.json

These kernels do little arithmetic per byte, so their speed limit is the memory: a kernel that moves B bytes cannot
take less than B / bandwidth. The goal is 70% of the data sheet (3.35 TB/s on an H100 SXM, 4.8 on an H200, 5.3 on
an MI300X). The kernels (the norm's add + RMSNorm both ways, SwiGLU's separate kernels both ways, RoPE's rotation,
AdamW over one decoder layer) run in the forms and dtypes of version 4's training step under bfloat16 autocast, at
N rows (8,192 by default: the medium and large presets' batch x sequence); bandwidth_kernels.py describes each
one, its shapes at a width and its byte model.

How: first every kernel's output is checked against the PyTorch formula in float64 on the same inputs (a wrong
kernel is not timed: exit 1). Then each kernel's launches are captured in a CUDA/HIP graph, taking turns on
enough copies of its inputs to hold three times the L2 cache, so that every launch reads from memory
(tinytransformer/kernel_bench/graph_timing.py); the kernels of one width replay in turns, in several rounds, and
the median of the rounds is kept. GB/s counts the bytes of the byte models, not what the caches saw. Without a GPU
the checks run in Triton's CPU interpreter at small sizes, and nothing is timed.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line, fail, positive_int, run_command  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu, interpreter_active  # noqa: E402

enable_interpreter_if_no_gpu()  # without a GPU: Triton's interpreter, chosen before the kernels import triton

from tinytransformer.device import peak_bandwidth_tbs, software_and_gpu  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.kernel_bench.cli import select_ops  # noqa: E402
from tinytransformer.kernel_bench.correctness import TOLERANCE, relative_error  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import (buffer_count, captured_launches, graph_ms,  # noqa: E402
                                                       time_interleaved)
from tinytransformer.kernel_bench.tuner_cli import prove_output_json  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from version4_triton_ultra.bandwidth_kernels import (KERNEL_NAMES, KERNELS, StreamingKernel, Width,  # noqa: E402
                                                     sequence_length, width_problem)

PROG = "run_bandwidth_benchmarks.py"
GOAL = 0.70                     # share of the data-sheet bandwidth a streaming kernel should reach
GPU_WIDTHS, GPU_ROWS = (1024, 2048, 4096), 8192
# Triton's interpreter runs every program in NumPy: small sizes keep the check to seconds, and widths that are not
# powers of two exercise the masks.
INTERPRETER_WIDTHS, INTERPRETER_ROWS, INTERPRETER_LIMIT = (64, 96), 48, 256
LAUNCHES_PER_GRAPH = 20
ROUNDS = 5


# ----------------------------------------------------------------------------------------------------------
# Check, then time
# ----------------------------------------------------------------------------------------------------------
def worst_error(kernel: StreamingKernel, width: Width, device) -> tuple[float, float]:
    """The relative error, against float64, of the kernel's output that is furthest from its dtype's tolerance
    (the project's per-dtype table), and that tolerance."""
    torch.manual_seed(0)
    inputs = kernel.make_inputs(width, device)
    want = kernel.reference(inputs)   # before run(): an in-place kernel or an optimizer changes its inputs
    got = kernel.run(inputs)
    if kernel.outputs is not None:
        got = kernel.outputs(inputs)
    tolerance = {**TOLERANCE, torch.float32: kernel.float32_tolerance}
    errors = [(relative_error(g, r), tolerance[g.dtype]) for g, r in zip(got, want, strict=True)]
    return max(errors, key=lambda pair: pair[0] / pair[1])


def timed_graph(kernel: StreamingKernel, width: Width, device) -> tuple[torch.cuda.CUDAGraph, list]:
    """A graph of LAUNCHES_PER_GRAPH launches taking turns on enough input sets to outgrow the L2 cache, and the
    input sets (to be kept as long as the graph that reads them)."""
    sets = [kernel.make_inputs(width, device) for _ in range(buffer_count(kernel.bytes_moved(width)))]
    turn = itertools.count()
    graph = captured_launches(lambda: kernel.run(sets[next(turn) % len(sets)]), LAUNCHES_PER_GRAPH)
    if kernel.after_capture is not None:
        for inputs in sets:
            kernel.after_capture(inputs)
    return graph, sets


def measure_width(kernels, width: Width, device, rounds: int, peak: float | None) -> list[dict]:
    graphs = {k.name: timed_graph(k, width, device) for k in kernels}
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, (g, _) in graphs.items()}, rounds)
    rows = []
    for kernel in kernels:
        us = 1000.0 * times[kernel.name] / LAUNCHES_PER_GRAPH
        gbps = kernel.bytes_moved(width) / us / 1e3
        rows.append(dict(hidden=width.hidden, rows=width.rows, ffn=width.ffn, head_dim=width.head_dim,
                         kernel=kernel.name, us=us, bytes=kernel.bytes_moved(width), gb_per_s=gbps,
                         share_of_peak=gbps / (1000 * peak) if peak else None,
                         input_sets=len(graphs[kernel.name][1])))
    del graphs
    torch.cuda.empty_cache()
    return rows


def format_row(row: dict) -> str:
    share = row["share_of_peak"]
    verdict = "" if share is None else ("ok" if share >= GOAL else f"below {GOAL:.0%}")
    share_text = "-" if share is None else f"{share:.1%}"
    return (f"  {row['kernel']:<16}{row['us']:>10.1f}{row['bytes'] / 1e6:>11.1f}{row['gb_per_s']:>10.0f}"
            f"{share_text:>9}  {verdict}")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def width_list(text: str) -> list[int]:
    values = [part.strip() for part in text.split(",")]
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise ValueError(f"expected positive integers separated by commas, got {text!r}")
    return [int(v) for v in values]


def parse_args(argv):
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-sizes", metavar="D[,D]",
                        help=f"widths to measure [{','.join(map(str, GPU_WIDTHS))}; interpreter: "
                             f"{','.join(map(str, INTERPRETER_WIDTHS))}]")
    parser.add_argument("--rows", type=positive_int, help=f"rows N (batch x sequence) [{GPU_ROWS}; interpreter: "
                                                          f"{INTERPRETER_ROWS}]")
    parser.add_argument("--kernel", metavar="NAME[,NAME]", help=f"only these, among {','.join(KERNEL_NAMES)} [all]")
    parser.add_argument("--rounds", type=positive_int, default=ROUNDS, help=f"interleaved rounds [{ROUNDS}]")
    parser.add_argument("--output-json", help="also write every number, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    interpreter = interpreter_active()
    try:
        args.widths = width_list(args.hidden_sizes) if args.hidden_sizes else list(
            INTERPRETER_WIDTHS if interpreter else GPU_WIDTHS)
    except ValueError as why:
        parser.error(f"--hidden-sizes: {why}")
    args.rows = args.rows or (INTERPRETER_ROWS if interpreter else GPU_ROWS)
    try:
        chosen = {k.name for k in select_ops(KERNELS, args.kernel)}   # the kernel benchmark's --kernel rule
    except ConfigError as why:
        parser.error(str(why))
    args.kernels = [k for k in KERNELS if k.name in chosen]   # in this file's order, whatever the flag's
    if interpreter and (args.rows > INTERPRETER_LIMIT or max(args.widths) > INTERPRETER_LIMIT):
        parser.error(f"without a GPU the kernels run in Triton's CPU interpreter: keep --rows and --hidden-sizes "
                     f"at most {INTERPRETER_LIMIT} (it would take hours otherwise)")
    args.widths = [Width(args.rows, hidden, sequence_length(args.rows, 1024)) for hidden in args.widths]
    for width in args.widths:
        problem = width_problem(width)
        if problem:
            parser.error(f"--hidden-sizes {width.hidden}: {problem}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_checks_and_timings(args, argv)
    except torch.cuda.OutOfMemoryError:
        return fail(PROG, "out of GPU memory: each width holds its kernels' inputs twice over (the timing's copies) "
                          "and a float64 layer for the AdamW check; use fewer --rows or smaller --hidden-sizes")


def run_checks_and_timings(args, argv) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = "Triton's CPU interpreter" if interpreter_active() else torch.cuda.get_device_name()
    print(f"Check on {where}: each kernel's outputs against float64, the relative error of the one nearest its "
          "dtype's tolerance")
    checks, all_ok = [], True
    for width in args.widths:
        for kernel in args.kernels:
            error, tolerance = worst_error(kernel, width, device)
            ok = error <= tolerance   # NaN or inf never passes (relative_error makes them infinite)
            all_ok &= ok
            checks.append(dict(hidden=width.hidden, kernel=kernel.name, error=error, tolerance=tolerance, ok=ok))
            print(f"  hidden {width.hidden:<6} {kernel.name:<16} {error:9.2e} (tolerance {tolerance:.0e})  "
                  f"{'ok' if ok else 'WRONG'}")
    if not all_ok:
        print("A kernel is wrong: nothing is timed.")
        return 1
    if interpreter_active():
        print("Timing needs a GPU with compiled Triton kernels: the checks above ran in the interpreter.")
        write_report(args, argv, checks, [], None)
        return 0

    peak = peak_bandwidth_tbs(torch.cuda.get_device_name())
    peak_text = f"{peak * 1000:,.0f} GB/s" if peak else "not in tinytransformer/device.py"
    rows = []
    for width in args.widths:
        print(f"\n{torch.cuda.get_device_name()}, {width.describe()}; us per launch (graph of "
              f"{LAUNCHES_PER_GRAPH}, median of {args.rounds} interleaved rounds); data sheet {peak_text}")
        print(f"  {'kernel':<16}{'us':>10}{'MB':>11}{'GB/s':>10}{'of peak':>9}")
        width_rows = measure_width(args.kernels, width, device, args.rounds, peak)
        for row in width_rows:
            print(format_row(row))
        rows += width_rows
    below = [f"{r['kernel']} at {r['hidden']}" for r in rows
             if r["share_of_peak"] is not None and r["share_of_peak"] < GOAL]
    print(f"\nBelow {GOAL:.0%} of the data sheet: {', '.join(below) if below else 'none'}")
    write_report(args, argv, checks, rows, peak)
    return 0


def write_report(args, argv, checks: list, rows: list, peak: float | None) -> None:
    """--output-json: every check and timing, the machine and the command (the timings empty without a GPU)."""
    if not args.output_json:
        return
    write_json(args.output_json, {
        "benchmark": "version 4's memory-bound kernels alone, in the training step's forms and dtypes (bfloat16 "
                     "autocast): achieved bandwidth at each width",
        "command": "python version4_triton_ultra/" + command_line(PROG, argv),
        "environment": software_and_gpu(), "triton_interpreter": interpreter_active(),
        "peak_bandwidth_tbs": peak, "goal_share_of_peak": GOAL,
        "method": f"graph of {LAUNCHES_PER_GRAPH} launches over enough input sets to hold 3x the L2 cache, the "
                  f"kernels of a width in {args.rounds} interleaved rounds, median; bytes from each kernel's byte "
                  "model (bandwidth_kernels.py's docstring)",
        "checks": checks, "results": rows})
    print(f"results: {args.output_json}")


if __name__ == "__main__":
    sys.exit(run_command(PROG, main))   # Ctrl-C and a closed pipe end it quietly
