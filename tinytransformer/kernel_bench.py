"""Per-kernel microbenchmarks: each Triton op of versions 3 and 4 against the PyTorch code it replaces.

version3_triton/run_triton_profiling.py and version4_triton_ultra/run_kernel_benchmarks.py only describe
their ops (how to make inputs, the PyTorch and the Triton implementation, a byte model) as `OpBench`
objects and call `main()` here, which does everything else: the command line, the correctness check, the
timing, the table and the JSON file. Both scripts therefore measure in exactly the same way.

What one table row means
    op, direction (fwd / bwd, and fwd+bwd for an op whose forward already computes the gradients), the
    PyTorch implementation compared, PyTorch time, Triton time (median microseconds per call), speed-up
    (PyTorch time / Triton time) and the Triton kernel's achieved bandwidth: bytes of the op's byte model
    divided by the Triton time. The byte model counts the bytes an op must read and write at least once (each input
    read once, each output written once, nothing re-read); each op states its model in a comment and the
    table's footnote prints it. A kernel that reaches the device's peak bandwidth on that count is as fast as
    a copy of its data, which is the best a memory-bound op can do.

How the times are taken
  * triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"): the same signature in
    Triton 3.6 and 3.9. warmup and rep are milliseconds of running fn (do_bench turns them into call counts
    from a first estimate), not numbers of calls. Each call is timed by a pair of device events; the median
    ignores the odd call slowed by a clock change or by another process on the GPU.
  * Cold caches. Before every timed call do_bench zeroes a 256 MB buffer, which evicts the inputs from the
    L2 cache (50 MB on an H100, 4 MB per XCD on an MI300X), so each call reads its inputs from HBM as the byte
    model assumes. We also rotate inputs: when the data one call reads (its inputs; for a backward also the
    incoming gradients and the tensors the forward saved) is smaller than the L2 cache, the timed function
    cycles through enough independent input sets to fill twice the L2 size (at most MAX_INPUT_SETS), so a
    call does not find the data of the calls just before it in L2 even where that flush would fall short.
    At the seed size an input set is about 1 MB, far below an H100's L2: without these guards a kernel would
    be timed at L2 bandwidth and its "GB/s" could exceed what the HBM can deliver.
  * Forward: the op with autograd recording (the inputs require grad), as in a training step; the outputs
    are dropped at once.
  * Backward: the forward runs once per input set OUTSIDE the timed function, and the timed function is
    torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True). Why retain_graph and not "run the
    forward again, outside the timed region": do_bench times everything fn does, and offers no untimed step
    between calls (other than resetting .grad), so a fresh forward before each backward would need a
    hand-written timing loop. retain_graph=True keeps the saved tensors alive, so one graph can be
    differentiated again and again; each call launches exactly the kernels of a normal backward, reading
    the same saved tensors. autograd.grad returns new gradient tensors instead of adding them into .grad,
    so no accumulation kernel creeps into the second and later calls.
  * Launch overhead: the times are GPU event times. While the GPU zeroes the flush buffer (about 80 us on
    an H100) the host has already queued the timed call, so Python's launch overhead stays hidden unless
    the host side of one call takes longer than that.

Correctness (--check)
    Before timing, every Triton output and input gradient is compared with the same PyTorch code evaluated
    in float64 on the same inputs (the exact answer, so the error shown is the Triton op's alone), and the
    PyTorch implementation at the benchmark's dtype is compared with it too, to show how much error plain
    rounding causes. Relative error ||out - ref|| / ||ref||; NaN or inf never passes.

No GPU: there is nothing to time; the scripts say so in one line and, with --check, run the comparison in
Triton's CPU interpreter at a small size (the scripts enable the interpreter before triton is imported).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .cli import EXIT_BAD_INPUT, OneLineParser, positive_int
from .config import ConfigError
from .device import describe, peak_bandwidth_tbs
from .outputs import write_json
from .precision import exact_float32_matmuls, tf32_enabled
from .triton_support import interpreter_active, is_rocm

WARMUP_MS = 25          # do_bench: milliseconds of untimed calls before timing
REP_MS = 100            # do_bench: milliseconds of timed calls; the median of them is reported
MAX_INPUT_SETS = 64     # at most this many rotating input sets (memory: a backward keeps every set's graph)
EXIT_CHECK_FAILED = 1
SMALL_OP_BYTES = 32 * 2**20   # below this an op's HBM time (~10 us on an H100) is comparable to launch costs
FOOTNOTE_WIDTH = 110

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative error allowed against the float64 reference, per dtype (the project's standard).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# float32 through TF32 tensor cores (Triton's flash attention on NVIDIA): every matmul input keeps 10
# mantissa bits, as in float16, and attention chains four matmuls (the flash attention tests use the same).
TF32_TOLERANCE = 5e-3

# The model's seed configuration: what is timed unless a flag says otherwise.
SEED_SHAPE = dict(batch_size=8, seq_len=128, hidden_dim=256, num_heads=8, intermediate_size=512,
                  vocab_size=1000)
# Without a GPU the kernels run in Triton's interpreter, which executes every block in NumPy: a small shape
# keeps the check to seconds. Sizes that are not powers of two exercise the kernels' masks.
INTERPRETER_SHAPE = dict(batch_size=2, seq_len=40, hidden_dim=64, num_heads=4, intermediate_size=96,
                         vocab_size=130)


# ----------------------------------------------------------------------------------------------------------
# What the scripts describe
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchShape:
    """The model sizes the inputs are cut to. The one-letter properties are the symbols of the byte models
    (printed in the footnote), so that each model's code reads exactly like its printed formula."""
    batch_size: int
    seq_len: int
    hidden_dim: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype

    @property
    def B(self):   # noqa: N802 (the byte models' symbols)
        return self.batch_size

    @property
    def S(self):   # noqa: N802
        return self.seq_len

    @property
    def N(self):   # noqa: N802  tokens: one row of every [N, D] activation
        return self.batch_size * self.seq_len

    @property
    def D(self):   # noqa: N802
        return self.hidden_dim

    @property
    def H(self):   # noqa: N802
        return self.num_heads

    @property
    def Dh(self):  # noqa: N802  head dim; q, k and v of all heads hold B*H*S*Dh = N*D elements
        return self.hidden_dim // self.num_heads

    @property
    def F(self):   # noqa: N802
        return self.intermediate_size

    @property
    def V(self):   # noqa: N802
        return self.vocab_size

    @property
    def e(self):
        """Bytes per element of the benchmark's dtype."""
        return self.dtype.itemsize

    def describe(self) -> str:
        return (f"batch {self.B}, seq {self.S}, hidden {self.D}, heads {self.H} (head dim {self.Dh}), "
                f"FFN {self.F}, vocab {self.V}, {dtype_name(self.dtype)}")


@dataclass
class InputSet:
    """One set of inputs: `differentiable` leaves (requires_grad) and `constants` (tables, targets).

    Every implementation is called as fn(*differentiable, *constants). grad_outputs (one random tensor per
    output, the gradients a backward receives) are drawn once per set and shared by every implementation.
    """
    differentiable: list
    constants: list = field(default_factory=list)
    grad_outputs: list | None = None

    def args(self):
        return (*self.differentiable, *self.constants)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.args() if isinstance(t, torch.Tensor))

    def to_float64(self) -> InputSet:
        """The same values in float64 (fresh leaves), for the exact reference. Integer tensors are kept."""
        def widen(t, grad):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                return t
            return t.detach().to(torch.float64).requires_grad_(grad)
        return InputSet([widen(t, True) for t in self.differentiable], [widen(t, False) for t in self.constants],
                        None if self.grad_outputs is None else [widen(g, False) for g in self.grad_outputs])


@dataclass
class OpBench:
    """One op to benchmark: inputs, the Triton op, the PyTorch code it replaces, and a byte model.

    pytorch: label -> implementation; the first one is also the reference of --check.
    byte_model: direction -> (formula as printed, function of a BenchShape giving bytes).
    """
    name: str
    make_inputs: Callable[[BenchShape, torch.device], InputSet]
    triton: Callable
    pytorch: dict[str, Callable]
    output_names: tuple[str, ...]
    input_names: tuple[str, ...]
    byte_model: dict[str, tuple[str, Callable[[BenchShape], int]]]
    validate: Callable[[BenchShape], str | None] = lambda shape: None   # a message when the shape is unusable
    uses_tl_dot: bool = False        # bfloat16 tl.dot is wrong in Triton's interpreter: not checkable there
    tf32_dots: bool = False          # float32 tl.dot through TF32 on NVIDIA: the TF32 tolerance applies
    note: str = ""                   # printed under the table, e.g. what a direction contains

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(self.byte_model)

    def bytes_moved(self, shape: BenchShape, direction: str) -> int:
        return self.byte_model[direction][1](shape)


# ----------------------------------------------------------------------------------------------------------
# Helpers for the scripts' op descriptions
# ----------------------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(shape, dtype, device, scale=1.0, requires_grad=True) -> torch.Tensor:
    """Normal(0, scale) values (never zeros: a kernel that forgets to load would still look right on zeros),
    drawn in float32 from the global generator and rounded once to dtype."""
    t = (scale * torch.randn(shape, device=device, dtype=torch.float32)).to(dtype)
    return t.requires_grad_(requires_grad)


def random_norm_weight(dim, dtype, device) -> torch.Tensor:
    """A norm weight near 1 as in a trained model, but not exactly 1 (that would hide a missing multiply)."""
    return (1.0 + 0.1 * torch.randn(dim, device=device)).to(dtype).requires_grad_()


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs (what the model uses), float64 for the float64 reference."""
    return torch.promote_types(dtype, torch.float32)


def torch_rms_norm(x, weight, eps):
    """Version 1's RMSNorm written as a function: statistics in (at least) float32, result in x's dtype."""
    x_wide = x.to(statistics_dtype(x.dtype))
    variance = x_wide.pow(2).mean(-1, keepdim=True)
    return (weight * (x_wide * torch.rsqrt(variance + eps))).to(x.dtype)


def as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


# ----------------------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------------------
def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; infinite when out holds NaN or inf, so those never pass."""
    out, ref = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def tolerance_for(op: OpBench, dtype: torch.dtype, device: torch.device) -> float:
    gpu_tf32 = (op.tf32_dots and dtype == torch.float32 and device.type == "cuda"
                and not interpreter_active() and not is_rocm())
    return TF32_TOLERANCE if gpu_tf32 else TOLERANCE[dtype]


def run_with_grads(fn, inputs: InputSet):
    """Outputs of fn and the gradients of its differentiable inputs for inputs.grad_outputs."""
    outputs = as_tuple(fn(*inputs.args()))
    if inputs.grad_outputs is None:
        inputs.grad_outputs = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs.differentiable, inputs.grad_outputs)
    return [o.detach() for o in outputs], list(grads)


@contextlib.contextmanager
def float32_torch_matmuls():
    """torch's float32 matmuls in full float32 for a while, then the setting as it was.

    The check holds float32 results to float32 tolerances, and its PyTorch implementations (and Triton ops that
    call torch matmuls, such as the chunked output head) would otherwise follow a process-wide TF32 switch that
    someone else turned on (version 4's --tf32 does, for its own run).
    """
    with exact_float32_matmuls():
        yield


def check_op(op: OpBench, shape: BenchShape, device: torch.device) -> list[dict]:
    """Compare the Triton op (and the first PyTorch implementation) with the PyTorch code in float64."""
    skip = interpreter_skip_reason(op, shape)
    if skip:
        return [dict(op=op.name, tensor="(all)", skipped=skip)]
    torch.manual_seed(0)
    inputs = op.make_inputs(shape, device)
    triton_out, triton_grads = run_with_grads(op.triton, inputs)        # also draws inputs.grad_outputs
    reference_fn = next(iter(op.pytorch.values()))
    torch_out, torch_grads = run_with_grads(reference_fn, inputs)
    ref_out, ref_grads = run_with_grads(reference_fn, inputs.to_float64())

    tolerance = tolerance_for(op, shape.dtype, device)
    names = list(op.output_names) + [f"grad {name}" for name in op.input_names]
    rows = []
    for name, tri, ours, ref in zip(names, triton_out + triton_grads, torch_out + torch_grads,
                                    ref_out + ref_grads, strict=True):
        error = relative_error(tri, ref)
        rows.append(dict(op=op.name, tensor=name, triton_error=error, pytorch_error=relative_error(ours, ref),
                         tolerance=tolerance, ok=bool(error <= tolerance)))
    return rows


def interpreter_skip_reason(op: OpBench, shape: BenchShape) -> str | None:
    if op.uses_tl_dot and shape.dtype == torch.bfloat16 and interpreter_active():
        return ("SKIPPED: Triton's CPU interpreter computes tl.dot on bfloat16 wrongly; "
                "check bfloat16 on a GPU (or use float32/float16 here)")
    return None


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------
def input_set_count(call_bytes: int, l2_bytes: int) -> int:
    """How many input sets to rotate through, for calls that each read `call_bytes`: one when that exceeds
    the L2 cache, else enough sets to fill twice the L2 size (at most MAX_INPUT_SETS)."""
    if l2_bytes <= 0 or call_bytes >= l2_bytes:
        return 1
    return max(2, min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / max(call_bytes, 1))))


def l2_cache_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def make_input_sets(op: OpBench, shape: BenchShape, device: torch.device) -> list[InputSet]:
    """As many input sets as the forward could use (each with its random grad_outputs drawn)."""
    first = op.make_inputs(shape, device)
    count = input_set_count(first.nbytes(), l2_cache_bytes(device))
    input_sets = [first] + [op.make_inputs(shape, device) for _ in range(count - 1)]
    for inputs in input_sets:
        with torch.no_grad():   # only the outputs' shapes are wanted here, not a graph
            outputs = as_tuple(op.triton(*inputs.args()))
        inputs.grad_outputs = [torch.randn_like(o) for o in outputs]
    return input_sets


def timing_available() -> bool:
    """Timing needs a GPU and compiled kernels: under the interpreter it would time NumPy, not the GPU."""
    return torch.cuda.is_available() and not interpreter_active()


def median_ms(fn) -> float:
    import triton.testing  # imported here: the scripts must choose the interpreter before triton loads
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def rotating(calls: list[Callable]) -> Callable:
    """One function that makes the next call of the list each time it runs (round robin)."""
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


def timed_call(fn, inputs: InputSet, direction: str) -> Callable:
    """The zero-argument function do_bench times for one input set (see the module docstring)."""
    if direction == "fwd":
        return lambda: fn(*inputs.args())
    if direction == "bwd":
        outputs = as_tuple(fn(*inputs.args()))   # forward outside the timed function; graph kept below
        return lambda: torch.autograd.grad(outputs, inputs.differentiable, inputs.grad_outputs,
                                           retain_graph=True)
    if direction == "fwd+bwd":
        return lambda: torch.autograd.grad(as_tuple(fn(*inputs.args())), inputs.differentiable,
                                           inputs.grad_outputs)
    raise ValueError(f"unknown direction {direction!r}")


def time_us(fn, input_sets: list[InputSet], direction: str) -> tuple[float, int]:
    """Median microseconds per call, and the number of input sets the calls rotated through.

    A backward reads the incoming gradients and the tensors its graph saved, not just the inputs: the
    memory the first graph holds is added to the bytes one call reads before choosing the number of sets.
    This also bounds memory: all retained graphs together stay near twice the L2 size.
    """
    device = input_sets[0].grad_outputs[0].device
    before = allocated_bytes(device)
    calls = [timed_call(fn, input_sets[0], direction)]
    call_bytes = input_sets[0].nbytes() + (allocated_bytes(device) - before)
    if direction != "fwd":
        call_bytes += sum(g.nbytes for g in input_sets[0].grad_outputs)
    count = min(len(input_sets), input_set_count(call_bytes, l2_cache_bytes(device)))
    calls += [timed_call(fn, inputs, direction) for inputs in input_sets[1:count]]
    return 1000.0 * median_ms(rotating(calls)), count


def time_op(op: OpBench, shape: BenchShape, device: torch.device) -> list[dict]:
    """One row per direction and PyTorch implementation."""
    torch.manual_seed(0)
    input_sets = make_input_sets(op, shape, device)
    rows = []
    for direction in op.directions:
        triton_us, triton_sets = time_us(op.triton, input_sets, direction)
        bytes_moved = op.bytes_moved(shape, direction)
        for label, fn in op.pytorch.items():
            pytorch_us, pytorch_sets = time_us(fn, input_sets, direction)
            rows.append(dict(op=op.name, direction=direction, pytorch=label, pytorch_us=pytorch_us,
                             triton_us=triton_us, speedup=pytorch_us / triton_us, bytes=bytes_moved,
                             triton_gbps=bytes_moved / triton_us / 1e3,
                             pytorch_input_sets=pytorch_sets, triton_input_sets=triton_sets))
    del input_sets
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the retained graphs' memory back before the next op
    return rows


# ----------------------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------------------
def format_timing_table(rows: list[dict]) -> str:
    header = (f"{'op':<22}{'dir':<9}{'PyTorch':<26}{'PyTorch us':>12}{'Triton us':>12}{'speed-up':>10}"
              f"{'Triton GB/s':>13}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:<22}{r['direction']:<9}{r['pytorch']:<26}{r['pytorch_us']:>12.1f}"
                     f"{r['triton_us']:>12.1f}{r['speedup']:>9.2f}x{r['triton_gbps']:>13.1f}")
    return "\n".join(lines)


def format_check_table(rows: list[dict]) -> str:
    header = f"{'op':<22}{'tensor':<20}{'Triton err':>12}{'PyTorch err':>13}{'tolerance':>11}  result"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['op']:<22}{r['tensor']:<20}  {r['skipped']}")
            continue
        lines.append(f"{r['op']:<22}{r['tensor']:<20}{r['triton_error']:>12.2e}{r['pytorch_error']:>13.2e}"
                     f"{r['tolerance']:>11.0e}  {'ok' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def footnote(ops: list[OpBench], shape: BenchShape, device_name: str, set_counts: dict) -> str:
    """How to read the table: the timing method, the input rotation and every byte model, with its bytes."""
    def paragraph(text, indent="  "):
        return textwrap.fill(text, width=FOOTNOTE_WIDTH, subsequent_indent=indent)

    peak = peak_bandwidth_tbs(device_name)
    peak_text = (f"this device's data-sheet peak is {peak * 1000:.0f} GB/s" if peak
                 else "this device's peak bandwidth is not in tinytransformer/device.py")
    lines = [
        paragraph(f"Times: median of triton.testing.do_bench (warmup {WARMUP_MS} ms, rep {REP_MS} ms, L2 "
                  "flushed before every call). fwd = the forward with autograd recording; bwd = "
                  "torch.autograd.grad(..., retain_graph=True) on a graph built outside the timed call. "
                  "speed-up = PyTorch us / Triton us."),
        paragraph("Input sets: where the data one call reads (inputs; for bwd also the saved tensors and "
                  "incoming gradients) fits in L2, the calls rotate through enough fresh sets to fill twice "
                  f"the L2 cache, at most {MAX_INPUT_SETS}. Most sets used per op: "
                  + ", ".join(f"{name} {count}" for name, count in set_counts.items())
                  + " (per row in --output-json)."),
        paragraph(f"Triton GB/s = byte model / Triton time; {peak_text}. Byte models: N = B*S tokens, "
                  f"e = {shape.e} bytes per {dtype_name(shape.dtype)} element, q/k/v of all heads hold N*D "
                  "elements; rstd, lse and grad_weight sums are float32 (4 bytes), targets int64 (8 bytes):"),
    ]
    for op in ops:
        for direction, (formula, _) in op.byte_model.items():
            lines.append(f"  {op.name} {direction}: {formula} = {op.bytes_moved(shape, direction):,} bytes")
        if op.note:
            lines.append(paragraph(f"  note ({op.name}): {op.note}", indent="    "))
    if shape.dtype == torch.float32 and any(op.tf32_dots for op in ops):
        lines.append(paragraph(
            "float32: Triton's flash attention multiplies through TF32 tensor cores on NVIDIA (as in versions 3 "
            "and 4); the PyTorch matmuls keep torch's setting (TF32 "
            f"{'on' if tf32_enabled() else 'off'}). Compare float16/bfloat16 for equal matmul precision."))
    largest = max(op.bytes_moved(shape, d) for op in ops for d in op.directions)
    if largest < SMALL_OP_BYTES:
        lines.append(paragraph(
            f"No op here moves more than {largest / 2**20:.3g} MiB per call, a few microseconds of HBM time: "
            "fixed launch and ramp-up costs weigh heavily and GB/s stays well below peak; a larger "
            "--batch-size / --seq-len shows each kernel's bandwidth limit."))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def build_parser(prog: str, description: str, ops: list[OpBench]) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description)
    sizes = parser.add_argument_group("input shapes (default: the seed config on a GPU, "
                                      "a small shape in Triton's CPU interpreter)")
    for flag, key in (("--batch-size", "batch_size"), ("--seq-len", "seq_len"), ("--hidden-dim", "hidden_dim"),
                      ("--num-heads", "num_heads"), ("--intermediate-size", "intermediate_size"),
                      ("--vocab-size", "vocab_size")):
        sizes.add_argument(flag, dest=key, type=positive_int, default=None,
                           help=f"default {SEED_SHAPE[key]} (interpreter: {INTERPRETER_SHAPE[key]})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of every input tensor (default float32)")
    names = ",".join(op.name for op in ops)
    parser.add_argument("--kernel", metavar="NAME[,NAME]", default=None,
                        help=f"only these ops, comma-separated, among {names} (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="first compare every Triton output and gradient with the PyTorch code in float64")
    parser.add_argument("--output-json", metavar="FILE", default=None,
                        help="also write every number, the device and the command to FILE")
    return parser


def select_ops(ops: list[OpBench], kernel_arg: str | None) -> list[OpBench]:
    if kernel_arg is None:
        return list(ops)
    by_name = {op.name: op for op in ops}
    wanted = [name.strip() for name in kernel_arg.split(",") if name.strip()]
    if not wanted:
        raise ConfigError("--kernel needs at least one name")
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise ConfigError(f"--kernel: unknown op {unknown[0]!r}; choose from {', '.join(by_name)}")
    return [by_name[name] for name in dict.fromkeys(wanted)]   # the order given, without repeats


def resolve_shape(args, use_interpreter_defaults: bool, ops: list[OpBench]) -> BenchShape:
    defaults = INTERPRETER_SHAPE if use_interpreter_defaults else SEED_SHAPE
    sizes = {key: getattr(args, key) or value for key, value in defaults.items()}
    shape = BenchShape(dtype=DTYPES[args.dtype], **sizes)
    if shape.D % shape.H:
        raise ConfigError(f"--hidden-dim {shape.D} is not divisible by --num-heads {shape.H}")
    for op in ops:
        problem = op.validate(shape)
        if problem:
            raise ConfigError(f"{op.name}: {problem}")
    return shape


def check_output_path(path: str | None) -> None:
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--output-json {path}: is a directory")
    if not target.parent.is_dir():
        raise ConfigError(f"--output-json {path}: directory {target.parent} does not exist")


def shape_record(shape: BenchShape) -> dict:
    record = {key: getattr(shape, key) for key in SEED_SHAPE}
    return record | dict(head_dim=shape.Dh, dtype=dtype_name(shape.dtype))


def finite_or_none(value):
    """JSON has no NaN or infinity: an error that is not finite (a failed check) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_or_none(item) for item in value]
    return value


def no_timing_message(prog: str, check: bool) -> str:
    reason = ("Triton's interpreter is on (TRITON_INTERPRET=1)" if torch.cuda.is_available()
              else "no GPU (CUDA or ROCm) found")
    then = (": running --check in Triton's CPU interpreter only." if check
            else ". Use --check to verify the kernels in Triton's CPU interpreter.")
    return f"{prog}: timing needs a GPU with compiled Triton kernels; {reason}{then}"


def run_checks(ops: list[OpBench], shape: BenchShape, device: torch.device, report: dict) -> bool:
    """Print the correctness table; record its rows in the report. Returns True when every check passed."""
    print(f"Correctness on {report['device']['name']}, {shape.describe()}: relative error "
          "||out - ref|| / ||ref||, ref = the PyTorch code in float64 on the same inputs")
    with float32_torch_matmuls():
        for op in ops:
            report["checks"] += check_op(op, shape, device)
    print(format_check_table(report["checks"]))
    passed = all(row.get("ok", True) for row in report["checks"])
    skipped = sum("skipped" in row for row in report["checks"])
    if not passed:
        print("Check: FAILED, not timing a wrong kernel.")
    elif skipped:
        print(f"Check: all within tolerance ({skipped} op{'s' if skipped > 1 else ''} skipped, see above).")
    else:
        print("Check: all within tolerance.")
    print()
    return passed


def run_timings(ops: list[OpBench], shape: BenchShape, device: torch.device, report: dict) -> None:
    """Time every op, print the table and its footnote; record the numbers and the method in the report."""
    import triton  # already loaded by the scripts (after the interpreter choice); wanted for its version
    info = report["device"]
    peak = peak_bandwidth_tbs(info["name"])
    report.update(triton_version=triton.__version__, l2_cache_bytes=l2_cache_bytes(device),
                  peak_bandwidth_gbps=peak * 1000 if peak else None,
                  do_bench=dict(warmup_ms=WARMUP_MS, rep_ms=REP_MS, return_mode="median"),
                  torch_matmul_allow_tf32=tf32_enabled())
    print(f"Timing on {info['name']} ({info['backend']}, torch {info['torch_version']}, triton "
          f"{triton.__version__}), {shape.describe()}")
    set_counts = {}
    for op in ops:
        rows = time_op(op, shape, device)
        set_counts[op.name] = max(max(r["triton_input_sets"], r["pytorch_input_sets"]) for r in rows)
        report["timings"] += rows
    print(format_timing_table(report["timings"]))
    print(footnote(ops, shape, info["name"], set_counts))
    report["input_sets"] = set_counts
    report["byte_models"] = {f"{op.name} {direction}": formula
                             for op in ops for direction, (formula, _) in op.byte_model.items()}


def main(ops: list[OpBench], prog: str, description: str, argv=None) -> int:
    """The whole script: parse, check (optional), time, print, write JSON. Returns the exit code."""
    parser = build_parser(prog, description, ops)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:   # OneLineParser printed its one line (exit 2); --help exits 0
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_INPUT
    try:
        selected = select_ops(ops, args.kernel)
        shape = resolve_shape(args, use_interpreter_defaults=interpreter_active(), ops=selected)
        check_output_path(args.output_json)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    given = list(sys.argv[1:] if argv is None else argv)
    report = dict(command=shlex.join([prog] + given), device=describe(device).as_dict(),
                  shape=shape_record(shape), triton_interpreter=interpreter_active(), checks=[], timings=[])
    can_time = timing_available()
    if not can_time:
        print(no_timing_message(prog, args.check))
    passed = run_checks(selected, shape, device, report) if args.check else True
    if can_time and passed:
        run_timings(selected, shape, device, report)
    if args.output_json:
        write_json(args.output_json, finite_or_none(report))
        print(f"Wrote {args.output_json}")
    return 0 if passed else EXIT_CHECK_FAILED
