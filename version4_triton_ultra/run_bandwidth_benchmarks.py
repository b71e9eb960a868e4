"""Do version 4's memory-bound kernels stream at the widths real models use? Each one's achieved bandwidth, and its
share of the GPU's data-sheet bandwidth, at hidden sizes 1,024 to 4,096.

    python run_bandwidth_benchmarks.py                                  (hidden 1,024, 2,048, 4,096; 8,192 rows)
    python run_bandwidth_benchmarks.py --hidden-sizes 2048 --kernel norm_backward,adamw
    python run_bandwidth_benchmarks.py --output-json bandwidth.json

These kernels do little arithmetic per byte, so their speed limit is the memory: a kernel that moves B bytes cannot
take less than B / bandwidth. The goal is 70% of the data sheet (3.35 TB/s on an H100 SXM, 4.8 on an H200, 5.3 on
an MI300X). Each kernel runs in the form and the dtypes of version 4's training step under bfloat16 autocast:

    norm_forward     residual add + RMSNorm: float32 stream + bfloat16 sub-layer output -> float32 stream,
                     bfloat16 normed rows, float32 rstd                             12 bytes an element of [N, D]
    norm_backward    its backward: reads the float32 stream, the bfloat16 gradient of the normed rows and the
                     float32 gradient of the stream; writes the stream's gradient in float32 and in bfloat16
                     (the sub-layer's), and the weight's gradient                   16 bytes an element of [N, D]
    swiglu_forward   h = silu(gate) * up from the bfloat16 [N, 2F] gate/up product   6 bytes an element of [N, F]
    swiglu_backward  d(gate), d(up) from the bfloat16 gradient of h and gate/up     10 bytes an element of [N, F]
    rope             q and k of a bfloat16 qkv [N, 3D] rotated in place            8 bytes an element of [N, D]
    adamw            one decoder layer's weights updated (float32 weight, gradient and moments read; weight and
                     moments written; the bfloat16 copy of every matrix written)   28 bytes a parameter + 2 a copy

Shapes at width D: N rows (8,192 by default: the medium and large presets' batch x sequence), the feed-forward
width F = 2.75 D rounded up to a multiple of 256 (the presets' ratio: 2,816 at 1,024, 5,632 at 2,048), the
largest supported head dim that cuts D into 16 heads or more (the presets' 64 at 1,024 and 128 at 2,048; 128 at
4,096), sequences of 1,024 rows for RoPE's tables. The loss kernel is left out: its width is the vocabulary, not D
(tune_cross_entropy.py times it).

How: first every kernel's output is checked against the PyTorch formula in float64 on the same inputs (a wrong
kernel is not timed: exit 1). Then each kernel's launches are captured in a CUDA/HIP graph, taking turns on
enough copies of its inputs to hold three times the L2 cache, so that every launch reads from memory
(tinytransformer/kernel_bench/graph_timing.py); the kernels of one width replay in turns, in several rounds, and
the median of the rounds is kept. GB/s counts the bytes above (small tables and sums included), not what the
caches saw. Without a GPU the checks run in Triton's CPU interpreter at small sizes, and nothing is timed.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line, fail, positive_int, run_command  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu, interpreter_active  # noqa: E402

enable_interpreter_if_no_gpu()  # without a GPU: Triton's interpreter, chosen before the kernels import triton

from tinytransformer.device import peak_bandwidth_tbs, software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.correctness import TOLERANCE, relative_error  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import (buffer_count, captured_launches, graph_ms,  # noqa: E402
                                                       time_interleaved)
from tinytransformer.kernel_bench.tuner_cli import prove_output_json  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from version4_triton_ultra.kernels import add_rmsnorm as norm  # noqa: E402
from version4_triton_ultra.kernels.adamw import TritonAdamW  # noqa: E402
from version4_triton_ultra.kernels.flash_attention import SUPPORTED_HEAD_DIMS  # noqa: E402
from version4_triton_ultra.kernels.qk_rotation import rotate_qk_  # noqa: E402
from version4_triton_ultra.kernels.qk_rotation import shape_problem as rope_shape_problem  # noqa: E402
from version4_triton_ultra.kernels.swiglu_elementwise import swiglu, swiglu_backward  # noqa: E402

PROG = "run_bandwidth_benchmarks.py"
EPS = 1e-6                      # the model's RMSNorm epsilon
GOAL = 0.70                     # share of the data-sheet bandwidth a streaming kernel should reach
GPU_WIDTHS, GPU_ROWS = (1024, 2048, 4096), 8192
# Triton's interpreter runs every program in NumPy: small sizes keep the check to seconds, and widths that are not
# powers of two exercise the masks.
INTERPRETER_WIDTHS, INTERPRETER_ROWS, INTERPRETER_LIMIT = (64, 96), 48, 256
LAUNCHES_PER_GRAPH = 20
ROUNDS = 5
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------------------------------------
# The shapes at one width
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Width:
    rows: int           # N: tokens, one row of every [N, D] activation
    hidden: int         # D
    seq_len: int        # positions of RoPE's tables; rows are whole sequences of it

    @property
    def ffn(self) -> int:
        """F: the presets' 2.75 x D, rounded up to a multiple of 256 (of 16 below 256: the interpreter's widths)."""
        step = 256 if self.hidden >= 256 else 16
        return step * math.ceil(2.75 * self.hidden / step)

    @property
    def head_dim(self) -> int:
        """The largest head dim the attention kernels support that cuts D into 16 heads or more (the presets' 64 at
        1,024 and 128 at 2,048); 16 for widths under 256."""
        fitting = [d for d in SUPPORTED_HEAD_DIMS if self.hidden % d == 0 and d <= max(16, self.hidden // 16)]
        return max(fitting) if fitting else 0   # 0: width_problem says why

    def describe(self) -> str:
        return (f"hidden {self.hidden}: {self.rows} rows, feed-forward {self.ffn}, head dim {self.head_dim}, "
                f"sequences of {self.seq_len}")


def sequence_length(rows: int, wanted: int) -> int:
    """The longest sequence of at most `wanted` positions that cuts `rows` into whole sequences."""
    return max(s for s in range(1, min(rows, wanted) + 1) if rows % s == 0)


# ----------------------------------------------------------------------------------------------------------
# The kernels: inputs, the launch that is timed, the float64 reference, the byte model
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamingKernel:
    name: str
    make_inputs: Callable[[Width, torch.device], dict]
    run: Callable[[dict], tuple | None]     # launches the kernel on one input set (what the graph times)
    reference: Callable[[dict], tuple]      # its outputs from the formula, in float64
    bytes_moved: Callable[[Width], int]
    in_place: bool = False                  # run() changes its inputs: the check runs it on a copy
    outputs: Callable[[dict], tuple] | None = None   # the outputs after run(), when run() returns none
    float32_tolerance: float = TOLERANCE[torch.float32]   # for its float32 outputs (the others: TOLERANCE)


def randn(shape, dtype, device, scale=1.0):
    return (scale * torch.randn(shape, device=device)).to(dtype)


def norm_weight(width, device):
    return 1.0 + 0.1 * torch.randn(width.hidden, device=device)   # near 1, as trained, but never exactly 1


# --- add + RMSNorm, forward
def norm_forward_inputs(w, device):
    return dict(residual=randn((w.rows, w.hidden), torch.float32, device),
                delta=randn((w.rows, w.hidden), torch.bfloat16, device), weight=norm_weight(w, device))


def norm_forward_run(x):
    h, normed, rstd = norm._rms_norm_forward(x["residual"], x["delta"], x["weight"], EPS, torch.float32,
                                             torch.bfloat16)
    return h, normed


def norm_forward_reference(x):
    h = x["residual"].double() + x["delta"].double()
    return h, x["weight"].double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


# --- add + RMSNorm, backward
def norm_backward_inputs(w, device):
    h = randn((w.rows, w.hidden), torch.float32, device)
    return dict(h=h, weight=norm_weight(w, device), rstd=torch.rsqrt(h.pow(2).mean(-1) + EPS),
                grad_normed=randn((w.rows, w.hidden), torch.bfloat16, device),
                grad_stream=randn((w.rows, w.hidden), torch.float32, device))


def norm_backward_run(x):
    return norm._rms_norm_backward(x["h"], x["weight"], x["rstd"], x["grad_normed"], x["grad_stream"],
                                   copy_dtype=torch.bfloat16)


def norm_backward_reference(x):
    h, weight, rstd, grad_normed, grad_stream = (x[k].double() for k in ("h", "weight", "rstd", "grad_normed",
                                                                         "grad_stream"))
    x_hat = h * rstd[:, None]
    g = grad_normed * weight
    grad_h = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) + grad_stream
    return grad_h, grad_h, (grad_normed * x_hat).sum(0)


# --- SwiGLU, both ways
def swiglu_inputs(w, device):
    return dict(gate_up=randn((w.rows, 2 * w.ffn), torch.bfloat16, device),
                grad_h=randn((w.rows, w.ffn), torch.bfloat16, device))


def swiglu_reference_forward(x):
    gate, up = x["gate_up"].double().chunk(2, dim=-1)
    return (F.silu(gate) * up,)


def swiglu_reference_backward(x):
    gate_up = x["gate_up"].double().requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    (grad,) = torch.autograd.grad(F.silu(gate) * up, gate_up, x["grad_h"].double())
    return (grad,)


# --- RoPE on q and k, in place
def rope_inputs(w, device):
    positions = torch.arange(w.seq_len, device=device, dtype=torch.float32)[:, None]
    inverse_frequency = 10000.0 ** (-torch.arange(0, w.head_dim, 2, device=device, dtype=torch.float32) / w.head_dim)
    angles = (positions * inverse_frequency).repeat(1, 2)   # [S, Dh]: each angle for column j and j + Dh/2
    return dict(qkv=randn((w.rows, 3 * w.hidden), torch.bfloat16, device), cos=angles.cos(), sin=angles.sin(),
                seq_len=w.seq_len, head_dim=w.head_dim)


def rope_run(x):
    return (rotate_qk_(x["qkv"], x["cos"], x["sin"], x["seq_len"], x["head_dim"]),)


def rope_reference(x):
    qkv, head_dim, seq_len = x["qkv"].double(), x["head_dim"], x["seq_len"]
    rows, dim = qkv.shape[0], qkv.shape[1] // 3
    heads = qkv[:, :2 * dim].reshape(rows, 2 * dim // head_dim, head_dim)   # every q head, then every k head
    position = torch.arange(rows, device=qkv.device) % seq_len
    cos, sin = x["cos"].double()[position][:, None], x["sin"].double()[position][:, None]
    first, second = heads.chunk(2, dim=-1)
    rotated = heads * cos + torch.cat([-second, first], dim=-1) * sin
    return (torch.cat([rotated.reshape(rows, 2 * dim), qkv[:, 2 * dim:]], dim=1),)


# --- AdamW over one decoder layer
def layer_shapes(w):
    """One decoder layer's parameters at this width: fused QKV, output, fused gate/up, down, and two norms."""
    d, f = w.hidden, w.ffn
    return [(3 * d, d), (d, d), (2 * f, d), (d, f), (d,), (d,)]


def adamw_inputs(w, device):
    # Weights of the model's initial size (a standard deviation of 0.02): the check takes the update as the
    # difference of two float32 weights, which then adds about 1e-6 of the update's size, not more.
    params = [(0.02 * torch.randn(shape, device=device)).requires_grad_() for shape in layer_shapes(w)]
    for param in params:
        param.grad = 1e-3 * torch.randn_like(param)
    copies = {p: p.detach().to(torch.bfloat16) for p in params if p.dim() == 2}   # autocast's matrix copies
    return dict(optimizer=TritonAdamW(params, sixteen_bit_copies=copies, **ADAMW), params=params, copies=copies,
                before=[p.detach().clone() for p in params])


def adamw_run(x):
    x["optimizer"].step()


def adamw_outputs(x):
    """What one step changed: each weight's update, both moments, the 16-bit copies."""
    state = [x["optimizer"].state[p] for p in x["params"]]
    return (*[p.detach() - b for p, b in zip(x["params"], x["before"])], *[s["exp_avg"] for s in state],
            *[s["exp_avg_sq"] for s in state], *x["copies"].values())


def adamw_reference(x):
    """One step of torch.optim.AdamW from fresh state, in float64, on the weights as they were before run()."""
    params = [b.double().requires_grad_() for b in x["before"]]
    for param, original in zip(params, x["params"]):
        param.grad = original.grad.double()
    reference = torch.optim.AdamW(params, foreach=False, **ADAMW)
    reference.step()
    state = [reference.state[p] for p in params]
    copies = [p.detach() for p in params if p.dim() == 2]   # the copies' order: the matrices' (adamw_inputs)
    return (*[p.detach() - b.double() for p, b in zip(params, x["before"])], *[s["exp_avg"] for s in state],
            *[s["exp_avg_sq"] for s in state], *copies)


def adamw_bytes(w):
    shapes = layer_shapes(w)
    parameters = sum(math.prod(s) for s in shapes)
    return 28 * parameters + 2 * sum(math.prod(s) for s in shapes if len(s) == 2)


KERNELS = [
    StreamingKernel("norm_forward", norm_forward_inputs, norm_forward_run, norm_forward_reference,
                    lambda w: 12 * w.rows * w.hidden + 4 * w.rows + 4 * w.hidden),
    StreamingKernel("norm_backward", norm_backward_inputs, norm_backward_run, norm_backward_reference,
                    lambda w: 16 * w.rows * w.hidden + 4 * w.rows + 8 * w.hidden),
    StreamingKernel("swiglu_forward", swiglu_inputs, lambda x: (swiglu(x["gate_up"]),), swiglu_reference_forward,
                    lambda w: 6 * w.rows * w.ffn),
    StreamingKernel("swiglu_backward", swiglu_inputs, lambda x: (swiglu_backward(x["grad_h"], x["gate_up"]),),
                    swiglu_reference_backward, lambda w: 10 * w.rows * w.ffn),
    StreamingKernel("rope", rope_inputs, rope_run, rope_reference,
                    lambda w: 8 * w.rows * w.hidden + 8 * w.seq_len * w.head_dim, in_place=True),
    # An update's float32 error is set by 1 - beta2 ** step, which cancels: one rounding of 1.0 (6e-8) against
    # 1 - 0.999 is 6e-5 of it, half of that after the square root; about 1e-5 measured at the first step.
    StreamingKernel("adamw", adamw_inputs, adamw_run, adamw_reference, adamw_bytes, outputs=adamw_outputs,
                    float32_tolerance=1e-4),
]
KERNEL_NAMES = [k.name for k in KERNELS]


# ----------------------------------------------------------------------------------------------------------
# Check, then time
# ----------------------------------------------------------------------------------------------------------
def worst_error(kernel: StreamingKernel, width: Width, device) -> tuple[float, float]:
    """The relative error, against float64, of the kernel's output that is furthest from its dtype's tolerance
    (the project's per-dtype table), and that tolerance."""
    torch.manual_seed(0)
    inputs = kernel.make_inputs(width, device)
    if kernel.in_place:
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
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
    turn = iter(range(10**9))
    graph = captured_launches(lambda: kernel.run(sets[next(turn) % len(sets)]), LAUNCHES_PER_GRAPH)
    for inputs in sets:
        if "optimizer" in inputs:
            inputs["optimizer"].finish_capture()   # the addresses the capture recorded (kernels/adamw.py)
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
    wanted = KERNEL_NAMES if args.kernel is None else [n.strip() for n in args.kernel.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in KERNEL_NAMES] or ([] if wanted else ["(none)"])
    if unknown:
        parser.error(f"--kernel: unknown kernel {unknown[0]!r}; choose from {', '.join(KERNEL_NAMES)}")
    args.kernels = [k for k in KERNELS if k.name in wanted]
    if interpreter and (args.rows > INTERPRETER_LIMIT or max(args.widths) > INTERPRETER_LIMIT):
        parser.error(f"without a GPU the kernels run in Triton's CPU interpreter: keep --rows and --hidden-sizes "
                     f"at most {INTERPRETER_LIMIT} (it would take hours otherwise)")
    for hidden in args.widths:
        problem = width_problem(Width(args.rows, hidden, sequence_length(args.rows, 1024)))
        if problem:
            parser.error(f"--hidden-sizes {hidden}: {problem}")
    return args


def width_problem(width: Width) -> str | None:
    """Why version 4's kernels cannot run at this width (one line), or None."""
    if not width.head_dim:
        return f"no head dim of {SUPPORTED_HEAD_DIMS} divides it"
    return norm.shape_problem(width.hidden) or rope_shape_problem(width.rows, width.hidden, width.head_dim)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_checks_and_timings(args, argv)
    except torch.cuda.OutOfMemoryError:
        return fail(PROG, "out of GPU memory: each width holds its kernels' inputs twice over (the timing's copies) "
                          "and a float64 layer for the AdamW check; use fewer --rows or smaller --hidden-sizes")


def run_checks_and_timings(args, argv) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = [Width(args.rows, hidden, sequence_length(args.rows, 1024)) for hidden in args.widths]
    where = "Triton's CPU interpreter" if interpreter_active() else torch.cuda.get_device_name()
    print(f"Check on {where}: each kernel's outputs against float64, the relative error of the one nearest its "
          "dtype's tolerance")
    checks, all_ok = [], True
    for width in widths:
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
    for width in widths:
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
                  "model (run_bandwidth_benchmarks.py's docstring)",
        "checks": checks, "results": rows})
    print(f"results: {args.output_json}")


if __name__ == "__main__":
    sys.exit(run_command(PROG, main))   # Ctrl-C and a closed pipe end it quietly
