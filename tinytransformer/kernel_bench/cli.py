"""The command line of the kernel benchmark scripts: parse, check (optional), time, print, write the JSON file."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..cli import OneLineParser, command_line, fail, parse_or_exit_code, positive_int
from ..config import ConfigError, load_yaml, preset_path
from ..device import describe, peak_bandwidth_tbs
from ..memory import REFUSE_ABOVE, device_free_bytes, host_available_bytes
from ..outputs import write_json
from ..paths import prove_output_file
from ..precision import tf32_enabled
from ..triton_support import interpreter_active
from . import timing
from .correctness import check_op, float32_torch_matmuls
from .ops import DTYPES, INTERPRETER_SHAPE, SEED_SHAPE, BenchShape, OpBench, dtype_name
from .tables import footnote, format_check_table, format_timing_table

EXIT_CHECK_FAILED = 1


def build_parser(prog: str, description: str, ops: list[OpBench]) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description)
    sizes = parser.add_argument_group("input shapes (default: the seed config on a GPU, "
                                      "a small shape in Triton's CPU interpreter)")
    for flag, key in (("--batch-size", "batch_size"), ("--seq-len", "seq_len"), ("--hidden-dim", "hidden_dim"),
                      ("--num-heads", "num_heads"), ("--intermediate-size", "intermediate_size"),
                      ("--vocab-size", "vocab_size")):
        sizes.add_argument(flag, dest=key, type=positive_int, default=None,
                           help=f"default {SEED_SHAPE[key]} (interpreter: {INTERPRETER_SHAPE[key]})")
    sizes.add_argument("--preset", metavar="NAME", default=None,
                       help="the sizes of a size preset (configs/NAME.yaml: its model and its batch x sequence) "
                            "instead of the seed config; the flags above override them")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="dtype of every input tensor (default float32; with --preset bfloat16, the dtype "
                             "the presets train in)")
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


def preset_shape(name: str) -> dict:
    """The benchmark's sizes at a size preset: its model's dimensions, its training batch and sequence length."""
    settings = load_yaml(preset_path(name))   # model and train settings in one flat mapping
    return {key: settings.get(key, SEED_SHAPE[key]) for key in SEED_SHAPE}


def resolve_shape(args, use_interpreter_defaults: bool, ops: list[OpBench]) -> BenchShape:
    if args.preset:
        defaults = preset_shape(args.preset)
    else:
        defaults = INTERPRETER_SHAPE if use_interpreter_defaults else SEED_SHAPE
    sizes = {key: getattr(args, key) or value for key, value in defaults.items()}
    dtype = args.dtype or ("bfloat16" if args.preset else "float32")
    shape = BenchShape(dtype=DTYPES[dtype], **sizes)
    if shape.D % shape.H:
        raise ConfigError(f"--hidden-dim {shape.D} is not divisible by --num-heads {shape.H}")
    for op in ops:
        problem = op.validate(shape)
        if problem:
            raise ConfigError(f"{op.name}: {problem}")
    return shape


def check_memory(ops: list[OpBench], shape: BenchShape, device: torch.device) -> None:
    """ConfigError, before any tensor is made, when an op's tensors cannot fit: about twice the bytes its byte
    model moves (inputs, outputs and gradients, plus --check's float64 reference), against the GPU's free memory
    or, on the CPU, the host's. Refuses only the clearly impossible (REFUSE_ABOVE, as the training scripts do)."""
    on_gpu = device.type == "cuda"
    available = device_free_bytes(device) if on_gpu else host_available_bytes()
    if available is None:
        return
    for op in ops:
        needed = 2 * sum(op.bytes_moved(shape, direction) for direction in op.directions)
        if needed > REFUSE_ABOVE * available:
            raise ConfigError(f"{op.name} at these sizes needs about {needed / 2**30:.1f} GiB of "
                              f"{'GPU' if on_gpu else 'host'} memory but {available / 2**30:.1f} GiB is available; "
                              f"reduce --batch-size, --seq-len, --hidden-dim, --intermediate-size or --vocab-size")


def check_output_path(path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).parent
    if not parent.exists():   # this command creates no directories: a typo'd path is reported, not created
        raise ConfigError(f"--output-json {path}: directory {parent} does not exist")
    prove_output_file(path, "--output-json")


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
    """Why nothing is timed. Not an error: the checks still run with --check, and without it the shape is still
    recorded (the documents' GPU commands run as written on a laptop too)."""
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
    report.update(triton_version=triton.__version__, l2_cache_bytes=timing.l2_cache_bytes(device),
                  peak_bandwidth_gbps=peak * 1000 if peak else None,
                  do_bench=dict(warmup_ms=timing.WARMUP_MS, rep_ms=timing.REP_MS, return_mode="median"),
                  torch_matmul_allow_tf32=tf32_enabled())
    print(f"Timing on {info['name']} ({info['backend']}, torch {info['torch_version']}, triton "
          f"{triton.__version__}), {shape.describe()}")
    set_counts = {}
    for op in ops:
        rows = timing.time_op(op, shape, device)
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
    args = parse_or_exit_code(parser, argv)   # OneLineParser prints its one line (exit 2); --help exits 0
    if isinstance(args, int):
        return args
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    can_time = timing.timing_available()
    try:
        selected = select_ops(ops, args.kernel)
        shape = resolve_shape(args, use_interpreter_defaults=interpreter_active(), ops=selected)
        check_output_path(args.output_json)
        check_memory(selected, shape, device)
    except ConfigError as error:
        return fail(prog, str(error))

    report = dict(command=command_line(prog, argv), device=describe(device).as_dict(),
                  shape=shape_record(shape), triton_interpreter=interpreter_active(), checks=[], timings=[])
    if not can_time:
        print(no_timing_message(prog, args.check))
    passed = run_checks(selected, shape, device, report) if args.check else True
    if can_time and passed:
        run_timings(selected, shape, device, report)
    if args.output_json:
        write_json(args.output_json, finite_or_none(report))
        print(f"Wrote {args.output_json}")
    return 0 if passed else EXIT_CHECK_FAILED
