"""The two Python profilers every version directory has, written once for all versions.

    run_pytorch_profiler.py  ->  pytorch_profiler_main(spec, argv)
    run_deepspeed_flops.py   ->  deepspeed_flops_main(spec, argv)

A version's script is a few lines: it imports the version's `SPEC` (a cli.VersionSpec) and calls one of
these functions, so every version is measured by exactly the same code and accepts every training flag.

run_pytorch_profiler.py trains a few steps under torch.profiler (through the shared Trainer) and prints
where the time went: top operators, top GPU kernels, kernels per step and the split between the model's
parts (attention, ffn, ...) and the training phases (backward, optimizer). `--analyze-existing TRACE`
prints the same tables for a trace recorded earlier, with no GPU needed.

run_deepspeed_flops.py counts FLOPs twice, with DeepSpeed's FLOPS profiler (which intercepts torch
functions during one forward pass) and with the analytic formulas of tinytransformer.flops, then times real
training steps to turn the count into achieved TFLOP/s and MFU (model FLOPs utilisation). On request it
also prints the arithmetic intensity of each matrix product of a layer and draws a roofline.

Bad input anywhere: one line on stderr and exit code 2, as in cli.py.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from . import flops, reports
from .cli import (EXIT_BAD_INPUT, VersionSpec, build_parser, non_negative_int, positive_int,
                  resolve_configs)
from .config import ConfigError, TrainConfig
from .outputs import ensure_directory, load_pyplot, write_json

DEFAULT_PROFILE_STEPS = 12          # steps of a profiler run when --num-steps is not given
DEFAULT_TABLE_ROWS = 20
DEFAULT_FLOPS_WARMUP_STEPS = 5
DEFAULT_TIMING_STEPS = 20
FLOPS_PROFILE_KIND = "flops_profile"

DEEPSPEED_MISSING = ("DeepSpeed is not installed: pip install deepspeed "
                     "(the FLOPS profiler needs no compiled ops)")
DEEPSPEED_VS_ANALYTIC = (
    "DeepSpeed counts what passes through the torch functions it intercepts: besides the matrix products "
    "(2 FLOPs per multiply-add, as in the analytic count) it adds one FLOP per element of softmax, SiLU and "
    "torch.mul/add calls, it misses the loss and the Python * and + operators, and it cannot see inside "
    "custom Triton kernels, so a ratio slightly above 1 is expected for a PyTorch model and a ratio well "
    "below 1 means part of the work ran where DeepSpeed cannot look.")


# ----------------------------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------------------------
def parse_or_exit_code(parser: argparse.ArgumentParser, argv) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code argparse chose (0 after --help, 2 after a bad flag)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:   # OneLineParser has already printed its one line
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_INPUT


def silence_closed_pipe() -> int:
    """Output piped into `head`: the reader has what it wanted; keep the exit flush from failing."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def given_arguments(argv) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


def command_line(prog: str, argv) -> str:
    return shlex.join([prog] + given_arguments(argv))


# ----------------------------------------------------------------------------------------------------------
# run_pytorch_profiler.py
# ----------------------------------------------------------------------------------------------------------
TRACE_PATTERNS = ("trace_*.json", "trace_*.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz")


def pytorch_profiler_parser(spec: VersionSpec) -> argparse.ArgumentParser:
    parser = build_parser(spec, prog="run_pytorch_profiler.py")
    parser.description = (f"TinyLlama {spec.name} ({spec.title}) under the PyTorch profiler: trains "
                          f"{DEFAULT_PROFILE_STEPS} steps (unless --num-steps says otherwise), records a few of "
                          "them and prints operator, kernel and phase tables. Every training flag works.")
    group = parser.add_argument_group("profiler script")
    group.add_argument("--analyze-existing", metavar="TRACE",
                       help="no training: analyse a recorded trace (a file, a directory holding trace_*.json "
                            "or *.pt.trace.json, or a quoted glob pattern; the newest match is used)")
    group.add_argument("--limit", type=non_negative_int, default=DEFAULT_TABLE_ROWS,
                       help="rows per table, 0 for all")
    group.add_argument("--generate-report", action="store_true",
                       help="also write profile_report_<version>.md: the run, the tables and the file list")
    return parser


def newest_trace_in(directory: Path) -> Path | None:
    """The newest trace file directly in `directory`, else in its immediate subdirectories (tensorboard/)."""
    def newest(paths):
        files = [p for p in paths if p.is_file()]
        return max(files, key=lambda p: p.stat().st_mtime) if files else None

    here = newest(p for pattern in TRACE_PATTERNS for p in directory.glob(pattern))
    return here or newest(p for pattern in TRACE_PATTERNS for p in directory.glob(f"*/{pattern}"))


def resolve_trace_argument(text: str) -> tuple[Path, str | None]:
    """(trace file, a note saying how it was chosen) for --analyze-existing's file / directory / glob.

    A glob the shell left unexpanded matched nothing there, so when it matches nothing here either, the
    newest trace in the pattern's directory is used (with a note): the workshop's classic command
    `--analyze-existing pytorch_profiles/profile_*.json` then finds `pytorch_profiles/trace_v1.json`.
    """
    path = Path(text)
    if path.is_dir():
        found = newest_trace_in(path)
        if found is None:
            raise reports.TraceError(f"no trace_*.json or *.pt.trace.json file in directory {path}")
        return found, f"newest trace in {path}/: {found}"
    if path.exists() or not glob.has_magic(text):
        return path, None                     # reports.load_trace reports a missing file in its own words
    matches = [Path(p) for p in glob.glob(text) if Path(p).is_file()]
    if matches:
        newest = max(matches, key=lambda p: p.stat().st_mtime)
        return newest, (f"{len(matches)} files match {text!r}; using the newest: {newest}"
                        if len(matches) > 1 else None)
    parent = path.parent
    if not glob.has_magic(str(parent)) and parent.is_dir():
        found = newest_trace_in(parent)
        if found is not None:
            return found, f"no file matches {text!r}; using the newest trace in {parent}/: {found}"
    raise reports.TraceError(f"no file matches {text!r}")


def operator_columns(meta: dict) -> list[str]:
    """The operator table's columns, leaving out those that would be all zeros on this trace."""
    columns = ["name", "calls", "self_cpu_us", "cpu_us"]
    if meta["has_device"]:
        columns += ["self_device_us", "device_us"]
    if meta["has_memory"]:
        columns += ["self_cpu_mem_bytes"] + (["self_device_mem_bytes"] if meta["has_device"] else [])
    return columns


def trace_tables(trace, sort_by: str, limit: int) -> list[str]:
    """The console report of one trace: per-step counts, the phase split, top operators, top kernels."""
    summary = reports.summarize(trace)
    phases = reports.phase_split(trace)
    operators = reports.top_operators(trace, sort_by=sort_by, limit=limit)
    kernels = reports.top_kernels(trace, limit=limit)
    steps = summary["steps"]
    lines = [f"Trace: {trace.path}"]
    lines.append(f"Profiled steps: {steps}" + (f" (mean {summary['step_us_mean'] / 1e3:.2f} ms each)" if steps
                                               else " (no ProfilerStep#N ranges: nothing to divide by)"))
    if summary["has_device"]:
        per_step = summary["kernels_per_step"]
        lines.append("GPU kernels per step: " + (f"{per_step:.1f}" if per_step is not None else "n/a"))
        if summary["device_us_per_step"] is not None:
            lines.append(f"GPU time per step: {summary['device_us_per_step'] / 1e3:.3f} ms")
    if summary["operators_per_step"] is not None:
        where = "" if summary["has_device"] else "; a CPU trace has no GPU kernels to count"
        lines.append(f"Operators per step (top-level aten ops{where}): {summary['operators_per_step']:.1f}")

    lines += ["", f"--- Time per phase ({phases['label']}) ---"]
    lines.append(reports.format_table(phases["rows"], [("phase", "phase"), ("us", "total_us"), ("pct", "%"),
                                                       ("count", "events"), ("us_per_step", "us_per_step")]))
    lines += ["", f"--- Top operators by {operators.meta['sort_by']} ---"]
    if operators.meta["note"]:
        lines.append(f"(note: {operators.meta['note']})")
    lines.append(reports.format_table(operators, operator_columns(operators.meta)))
    if summary["has_device"]:
        lines += ["", "--- Top GPU kernels by total time ---"]
        lines.append(reports.format_table(kernels, ["name", "category", "calls", "total_us", "mean_us",
                                                    "pct_device_time"]))
    return lines


def write_profile_report(path: Path, spec: VersionSpec, command: str, run_lines: list[str],
                         table_lines: list[str], file_lines: list[str]) -> None:
    text = [f"# PyTorch profiler report: {spec.name} ({spec.title})", "", f"- command: `{command}`"]
    text += [f"- {line}" for line in run_lines]
    text += ["", "## Tables", "", "```text", *table_lines, "```", "", "## Files", ""]
    text += [f"- {line.strip()}" for line in file_lines]
    path.write_text("\n".join(text) + "\n")


def run_summary_lines(metrics: dict) -> list[str]:
    """A few lines about the training run that produced the trace (for the markdown report)."""
    t, tp = metrics["timing"], metrics["throughput"]
    lines = [f"device: {metrics['device']['name']} ({metrics['device']['backend']}), {metrics['precision']}"]
    if t["median_ms"] is not None:
        lines.append(f"step time (unprofiled steps): median {t['median_ms']:.2f} ms over {t['count']} steps")
        lines.append(f"throughput: {tp['samples_per_s']:.1f} samples/s, {tp['training_tflops_per_s']:.3f} TFLOP/s")
    return lines


def analyze_existing_trace(spec: VersionSpec, args, command: str) -> int:
    trace_path, note = resolve_trace_argument(args.analyze_existing)
    if note:
        print(f"note: {note}")
    trace = reports.load_trace(trace_path)
    out_dir = ensure_directory(args.profile_dir, "--profile-dir") if args.profile_dir else trace_path.parent
    sort_by = args.sort_by or TrainConfig.sort_by
    try:
        written = reports.write_reports(trace, out_dir, sort_by=sort_by, limit=args.limit)
    except OSError as error:
        raise ConfigError(f"cannot write reports into {out_dir}: {error.strerror or error}") from None
    tables = trace_tables(trace, sort_by, args.limit)
    print("\n".join(tables))
    files = [f"Chrome trace        : {trace_path}",
             f"Reports             : {', '.join(p.name for p in written.values())} in {out_dir}/"]
    if args.generate_report:
        report = out_dir / f"profile_report_{spec.name}.md"
        write_profile_report(report, spec, command, [f"trace analysed: {trace_path}"], tables, files)
        files.append(f"Report              : {report}")
    print("\n--- Files ---\n" + "\n".join(files))
    return 0


def profile_training_run(spec: VersionSpec, args, argv, command: str) -> int:
    from .trainer import Trainer   # after parsing, so that --help stays fast
    args.enable_pytorch_profiler = True
    if args.num_steps is None:
        args.num_steps = DEFAULT_PROFILE_STEPS
    model_config, train_config = resolve_configs(args)
    ensure_directory(train_config.profile_dir, "--profile-dir")
    trainer = Trainer(spec, model_config, train_config, args, out=sys.stdout, argv=given_arguments(argv))
    result = trainer.run()
    if getattr(result, "exit_code", 0):   # the run was stopped early (Ctrl-C / SIGTERM)
        return result.exit_code
    profile = result.metrics.get("profile") or {}
    trace_path = Path(profile["trace"]) if profile.get("trace") else None
    if trace_path is None or not trace_path.exists():
        print(f"{spec.name}: the profiler recorded no step, so there is no trace to analyse", file=sys.stderr)
        return 1
    trace = reports.load_trace(trace_path)
    profile_dir = Path(train_config.profile_dir)
    # The trainer wrote these reports already, with 20 rows in summary.md; again with this --limit.
    written = reports.write_reports(trace, profile_dir, sort_by=train_config.sort_by, limit=args.limit)
    print()
    tables = trace_tables(trace, train_config.sort_by, args.limit)
    print("\n".join(tables))

    files = [f"Chrome trace        : {trace_path}  (open in https://ui.perfetto.dev or chrome://tracing)",
             f"TensorBoard traces  : {profile_dir / 'tensorboard'}  "
             f"(tensorboard --logdir {profile_dir / 'tensorboard'})"]
    timeline = profile.get("memory_timeline")
    if timeline and Path(timeline).exists():
        files.append(f"Memory timeline     : {timeline}")
    elif train_config.profile_memory:   # torch's exporter skips the .html plot without matplotlib, or fails
        files.append("Memory timeline     : not written (torch's exporter needs matplotlib for the HTML "
                     "plot; see any note above)")
    files.append(f"Reports             : {', '.join(p.name for p in written.values())} in {profile_dir}/")
    if args.generate_report:
        report = profile_dir / f"profile_report_{spec.name}.md"
        write_profile_report(report, spec, command, run_summary_lines(result.metrics), tables, files)
        files.append(f"Report              : {report}")
    print("\n--- Files ---\n" + "\n".join(files))
    return 0


def pytorch_profiler_main(spec: VersionSpec, argv=None) -> int:
    """run_pytorch_profiler.py: profile a short training run, or analyse an existing trace."""
    parser = pytorch_profiler_parser(spec)
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args
    command = command_line(parser.prog, argv)
    try:
        if args.analyze_existing:
            return analyze_existing_trace(spec, args, command)
        return profile_training_run(spec, args, argv, command)
    except (ConfigError, reports.TraceError) as error:
        return fail(parser.prog, str(error))
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return silence_closed_pipe()


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: the parser
# ----------------------------------------------------------------------------------------------------------
def deepspeed_flops_parser(spec: VersionSpec) -> argparse.ArgumentParser:
    parser = build_parser(spec, prog="run_deepspeed_flops.py")
    parser.description = (f"TinyLlama {spec.name} ({spec.title}): FLOPs of one forward pass counted by DeepSpeed "
                          "and by formula, then achieved training TFLOP/s and MFU from timed steps. "
                          "--num-steps is not used here: the timing runs --warmup-steps + --timing-steps steps.")
    group = parser.add_argument_group("FLOPS analysis")
    group.add_argument("--output-dir", default="flops_analysis",
                       help="where flops_profile.json, model_profile.txt and mfu_analysis.csv go")
    group.add_argument("--analyze-results", metavar="FILE",
                       help="no run: print the summary of a saved flops_profile.json again")
    group.add_argument("--timing-steps", type=positive_int, default=DEFAULT_TIMING_STEPS,
                       help=f"timed training steps, after --warmup-steps (here default "
                            f"{DEFAULT_FLOPS_WARMUP_STEPS}) untimed ones")
    group.add_argument("--computational-intensity", action="store_true",
                       help="print the arithmetic intensity (FLOPs per byte) of each matrix product of a layer")
    group.add_argument("--generate-roofline", action="store_true",
                       help="write roofline.png (needs matplotlib and a device with known peaks)")
    return parser


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: (a) DeepSpeed's count
# ----------------------------------------------------------------------------------------------------------
def deepspeed_import_problem() -> str | None:
    """None when DeepSpeed's FLOPS profiler imports; else the line to show the user."""
    try:
        from deepspeed.profiling.flops_profiler import FlopsProfiler  # noqa: F401
    except ImportError as error:
        if (error.name or "deepspeed").split(".")[0] == "deepspeed":
            return DEEPSPEED_MISSING
        return f"DeepSpeed is installed but does not import on this machine ({type(error).__name__}: {error})"
    except Exception as error:  # DeepSpeed probes the accelerator at import time; that can fail too
        return f"DeepSpeed is installed but does not import on this machine ({type(error).__name__}: {error})"
    return None


def deepspeed_forward_profile(model, forward, output_file: Path) -> dict:
    """Run `forward()` once under DeepSpeed's FlopsProfiler; the per-module tree goes to `output_file`.

    Returns the totals, and FLOPs / MACs / parameters / latency of the modules down to depth 2 (embed_tokens,
    layers.0, lm_head, ...) and of the first layer's children (layers.0.attention, ...). DeepSpeed patches
    torch functions while it profiles; the `finally` puts them back even if the forward pass fails.
    """
    import deepspeed
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    from deepspeed.profiling.flops_profiler.profiler import get_module_duration, get_module_flops, get_module_macs

    profiler = FlopsProfiler(model)
    profiler.start_profile()
    try:
        forward()
        profiler.stop_profile()
        modules = []
        for name, module in model.named_modules():
            parts = name.split(".") if name else []
            if 1 <= len(parts) <= 2 or (len(parts) == 3 and parts[1] == "0"):
                modules.append({"module": name, "params": int(getattr(module, "__params__", 0)),
                                "flops": int(get_module_flops(module)), "macs": int(get_module_macs(module)),
                                "latency_ms": 1e3 * get_module_duration(module)})
        result = {"available": True, "message": None, "deepspeed_version": deepspeed.__version__,
                  "forward_flops": int(profiler.get_total_flops()), "forward_macs": int(profiler.get_total_macs()),
                  "params": int(profiler.get_total_params()),
                  "forward_latency_ms": 1e3 * profiler.get_total_duration(), "modules": modules,
                  "model_profile": str(output_file)}
        profiler.print_model_profile(profile_step=1, module_depth=-1, top_modules=3, detailed=True,
                                     output_file=str(output_file))
    finally:
        profiler.end_profile()
    return result


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: (b) the analytic count, (d) arithmetic intensity
# ----------------------------------------------------------------------------------------------------------
ATTENTION_MATMULS = ("q_proj", "k_proj", "v_proj", "attention_scores", "attention_values", "o_proj")
FFN_MATMULS = ("gate_proj", "up_proj", "down_proj")


def analytic_counts(cfg, batch: int, seq: int) -> dict:
    per_layer = flops.forward_flops_per_layer(cfg, batch, seq)
    output_head = 2 * batch * seq * cfg.hidden_dim * cfg.vocab_size
    return {"per_layer": per_layer, "per_layer_total": sum(per_layer.values()), "num_layers": cfg.num_layers,
            "output_head": output_head, "forward_flops": flops.forward_flops(cfg, batch, seq),
            "training_flops": flops.training_flops(cfg, batch, seq),
            "conventions": "matrix products only, 2 FLOPs per multiply-add, full S x S attention; "
                           "training step = 3 x forward"}


BYTE_MODEL = ("bytes moved = (elements of A + elements of B + elements of C) x bytes per element: each operand "
              "is read from device memory once and the result written once (perfect on-chip reuse, the least "
              "traffic possible); the unfused rows are the computation as version 1 writes it")


def compare_parts(deepspeed_result: dict, analytic: dict) -> list[dict]:
    """DeepSpeed's FLOPs of a module beside the analytic FLOPs of the same part, where the module exists."""
    per_layer = analytic["per_layer"]
    expected = {
        "layers.0.attention": ("attention of one layer", sum(per_layer[k] for k in ATTENTION_MATMULS)),
        "layers.0.feed_forward": ("feed-forward of one layer", sum(per_layer[k] for k in FFN_MATMULS)),
        "layers.0": ("one layer", analytic["per_layer_total"]),
        "lm_head": ("output head", analytic["output_head"]),
    }
    measured = {row["module"]: row["flops"] for row in deepspeed_result["modules"]}
    rows = [{"part": label, "module": module, "analytic_flops": count, "deepspeed_flops": measured[module],
             "ratio": measured[module] / count if count else None}
            for module, (label, count) in expected.items() if module in measured]
    rows.append({"part": "whole forward pass", "module": "(model)", "analytic_flops": analytic["forward_flops"],
                 "deepspeed_flops": deepspeed_result["forward_flops"],
                 "ratio": deepspeed_result["forward_flops"] / analytic["forward_flops"]})
    return rows


def layer_matmuls(cfg, batch: int, seq: int) -> list[tuple[str, int, int, int, int]]:
    """(name, M, K, N, count): each matrix product C[M, N] = A[M, K] @ B[K, N] of one layer, done `count`
    times (once per batch element and head for attention), then the output head (once per model)."""
    tokens, d, f = batch * seq, cfg.hidden_dim, cfg.intermediate_size
    heads, head_dim = cfg.num_heads, cfg.head_dim
    return [
        ("q_proj", tokens, d, d, 1),
        ("k_proj", tokens, d, d, 1),
        ("v_proj", tokens, d, d, 1),
        ("attention_scores", seq, head_dim, seq, batch * heads),    # Q K^T: the S x S scores per head
        ("attention_values", seq, seq, head_dim, batch * heads),    # P V
        ("o_proj", tokens, d, d, 1),
        ("gate_proj", tokens, d, f, 1),
        ("up_proj", tokens, d, f, 1),
        ("down_proj", tokens, f, d, 1),
        ("output_head (once per model)", tokens, d, cfg.vocab_size, 1),
    ]


def intensity_rows(cfg, batch: int, seq: int, bytes_per_element: int, ridge: float | None) -> list[dict]:
    rows = []
    for name, m, k, n, count in layer_matmuls(cfg, batch, seq):
        flop = 2 * m * k * n * count
        moved = (m * k + k * n + m * n) * count * bytes_per_element
        rows.append({"matmul": name, "shape": f"{count} x [{m}x{k}] @ [{k}x{n}]" if count > 1 else
                     f"[{m}x{k}] @ [{k}x{n}]", "flops": flop, "bytes": moved})
    # Flash attention fuses scores -> softmax -> values: the S x S matrices never reach memory.
    scores = next(r for r in rows if r["matmul"] == "attention_scores")
    values = next(r for r in rows if r["matmul"] == "attention_values")
    rows.insert(rows.index(values) + 1, {"matmul": "attention fused (flash: Q,K,V in, O out)", "shape": "scores + values",
                    "flops": scores["flops"] + values["flops"],
                    "bytes": 4 * batch * seq * cfg.hidden_dim * bytes_per_element})
    for row in rows:
        row["flops_per_byte"] = row["flops"] / row["bytes"]
        row["bound"] = ("-" if ridge is None else "compute" if row["flops_per_byte"] >= ridge else "memory")
    return rows


def write_roofline(path: Path, peak_tflops: float, bandwidth_tbs: float, rows: list[dict],
                   achieved_tflops: float | None, title: str) -> str | None:
    """Draw the roofline with each matrix product at its attainable ceiling; None when matplotlib is absent."""
    plt = load_pyplot()
    if plt is None:
        return None
    ridge = peak_tflops / bandwidth_tbs
    intensities = [row["flops_per_byte"] for row in rows]
    low, high = min(intensities + [ridge]) / 4, max(intensities + [ridge]) * 4
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    figure, axes = plt.subplots(figsize=(9, 6))
    axes.loglog(xs, [min(peak_tflops, x * bandwidth_tbs) for x in xs], color="black",
                label=f"roof: {bandwidth_tbs} TB/s x intensity, capped at {peak_tflops:g} TFLOP/s")
    # Products with the same intensity (q, k, v, o; gate, up, down) share one point and one label.
    names_at: dict[float, list[str]] = {}
    for row in rows:
        names_at.setdefault(round(row["flops_per_byte"], 6), []).append(row["matmul"])
    for intensity, names in sorted(names_at.items()):
        ceiling = min(peak_tflops, intensity * bandwidth_tbs)
        axes.scatter([intensity], [ceiling], zorder=3)
        axes.annotate(", ".join(names), (intensity, ceiling), fontsize=8, xytext=(8, -4),
                      textcoords="offset points")
    if achieved_tflops:
        axes.axhline(achieved_tflops, linestyle="--", color="tab:red",
                     label=f"measured: whole training step, {achieved_tflops:.3g} TFLOP/s")
    axes.axvline(ridge, linestyle=":", color="gray", label=f"ridge point {ridge:.0f} FLOP/byte")
    axes.set_xlabel("arithmetic intensity (FLOP/byte)")
    axes.set_ylabel("attainable TFLOP/s")
    axes.set_title(title)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: (c) timed training steps
# ----------------------------------------------------------------------------------------------------------
def time_training_steps(trainer, warmup_steps: int, timing_steps: int) -> dict:
    """Median step time of `timing_steps` steps after `warmup_steps`, timed as the Trainer times them."""
    from .trainer import StepTimer, summarize_times
    timer = StepTimer(trainer.device)
    for step in range(warmup_steps + timing_steps):
        inputs, targets = trainer.stream.batch(step)
        start = timer.mark()
        trainer.step_fn(inputs, targets)
        timer.add((start, timer.mark()))
    step_ms = [marks[0] for marks in timer.collect()][warmup_steps:]   # collect() synchronises once
    return {**summarize_times(step_ms), "warmup_steps": warmup_steps}


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: the run
# ----------------------------------------------------------------------------------------------------------
def measure_flops(spec: VersionSpec, args, argv, command: str) -> dict:
    """Everything flops_profile.json holds; writes model_profile.txt (and roofline.png) on the way."""
    import torch

    from .device import describe, peak_bandwidth_tbs, peak_tflops
    from .trainer import Trainer, autocast_context
    from .weights import parameter_count

    if args.num_steps is not None:
        print("note: --num-steps is not used here; the timing runs --warmup-steps + --timing-steps steps")
    warmup = args.warmup_steps if args.warmup_steps is not None else DEFAULT_FLOPS_WARMUP_STEPS
    args.num_steps = warmup + args.timing_steps      # only so that the shared validation sees a consistent run
    args.warmup_steps = warmup
    model_config, train_config = resolve_configs(args)
    out_dir = ensure_directory(args.output_dir, "--output-dir")
    trainer = Trainer(spec, model_config, train_config, args, out=sys.stdout, argv=given_arguments(argv))
    trainer.build()            # the model exactly as training builds it: canonical weights, on the device
    cfg, batch, seq = model_config, train_config.batch_size, train_config.seq_len
    info = describe(trainer.device)
    precision = train_config.amp_dtype if train_config.use_amp else "float32"
    on_gpu = trainer.device.type == "cuda"
    peak = peak_tflops(info.name, precision) if on_gpu else None
    bandwidth = peak_bandwidth_tbs(info.name) if on_gpu else None
    print(f"=== DeepSpeed FLOPS analysis: {spec.name} ({spec.title}) ===")
    print(f"device : {info.name} ({info.backend}), {precision}")
    print(f"model  : hidden {cfg.hidden_dim}, layers {cfg.num_layers}, heads {cfg.num_heads}, ffn "
          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; batch {batch} x seq {seq}")

    # (a) DeepSpeed on one forward pass (after one unprofiled pass: allocator and library start-up)
    inputs, targets = trainer.stream.batch(0)

    def forward():
        with torch.no_grad(), autocast_context(trainer.device, train_config):
            trainer.model(inputs, targets)

    problem = deepspeed_import_problem()
    if problem is None:
        forward()
        deepspeed_result = deepspeed_forward_profile(trainer.model, forward, out_dir / "model_profile.txt")
    else:
        deepspeed_result = {"available": False, "message": problem}   # printed with the summary

    # (b) the formulas
    analytic = analytic_counts(cfg, batch, seq)
    ratio = (deepspeed_result["forward_flops"] / analytic["forward_flops"]
             if deepspeed_result["available"] else None)

    # (c) timed training steps
    print(f"timing {args.timing_steps} training steps after {warmup} warm-up steps ...")
    timing = time_training_steps(trainer, warmup, args.timing_steps)
    median_s = timing["median_ms"] / 1e3 if timing["median_ms"] else None
    achieved = analytic["training_flops"] / median_s / 1e12 if median_s else None
    throughput = {"samples_per_s": batch / median_s if median_s else None,
                  "tokens_per_s": batch * seq / median_s if median_s else None,
                  "training_tflops_per_s": achieved, "peak_tflops": peak,
                  "mfu": achieved / peak if (achieved and peak) else None, "peak_bandwidth_tbs": bandwidth}

    result = {
        "schema_version": 1, "kind": FLOPS_PROFILE_KIND, "version": spec.name, "title": spec.title,
        "variant": trainer.variant_description(), "command": command, "device": info.as_dict(),
        "precision": precision, "model_config": asdict(cfg), "parameters": parameter_count(cfg),
        "batch_size": batch, "seq_len": seq, "deepspeed": deepspeed_result, "analytic": analytic,
        "comparison": {"deepspeed_over_analytic": ratio, "explanation": DEEPSPEED_VS_ANALYTIC,
                       "parts": compare_parts(deepspeed_result, analytic) if deepspeed_result["available"] else []},
        "timing": timing, "throughput": throughput, "intensity": None, "roofline": None,
    }

    # (d) arithmetic intensity and the roofline
    if args.computational_intensity or args.generate_roofline:
        bytes_per_element = torch.finfo(getattr(torch, precision)).bits // 8
        ridge = peak / bandwidth if (peak and bandwidth) else None
        result["intensity"] = {"byte_model": BYTE_MODEL, "bytes_per_element": bytes_per_element,
                               "ridge_flops_per_byte": ridge,
                               "rows": intensity_rows(cfg, batch, seq, bytes_per_element, ridge)}
    if args.generate_roofline:
        result["roofline"] = roofline_result(out_dir, result, info.name, precision)
    return result


def roofline_result(out_dir: Path, result: dict, device_name: str, precision: str) -> dict:
    peak, bandwidth = result["throughput"]["peak_tflops"], result["throughput"]["peak_bandwidth_tbs"]
    if not (peak and bandwidth):
        return {"path": None, "message": f"no roofline: the peak FLOP/s or memory bandwidth of {device_name} "
                                         "is not in tinytransformer/device.py's tables"}
    title = f"{result['version']} on {device_name}: {precision} peak {peak:g} TFLOP/s, {bandwidth} TB/s"
    path = write_roofline(out_dir / "roofline.png", peak, bandwidth, result["intensity"]["rows"],
                          result["throughput"]["training_tflops_per_s"], title)
    if path is None:
        return {"path": None, "message": "no roofline: matplotlib is not installed (pip install matplotlib)"}
    return {"path": path, "message": None}


def write_flops_outputs(out_dir: Path, result: dict) -> dict:
    """flops_profile.json (every number) and mfu_analysis.csv (one row); returns {name: path}."""
    analytic, throughput, timing = result["analytic"], result["throughput"], result["timing"]
    row = {
        "version": result["version"], "device": result["device"]["name"], "precision": result["precision"],
        "batch_size": result["batch_size"], "seq_len": result["seq_len"],
        "warmup_steps": timing["warmup_steps"], "timed_steps": timing["count"],
        "median_step_ms": timing["median_ms"], "p10_step_ms": timing["p10_ms"], "p90_step_ms": timing["p90_ms"],
        "samples_per_s": throughput["samples_per_s"], "tokens_per_s": throughput["tokens_per_s"],
        "analytic_forward_flops": analytic["forward_flops"],
        "analytic_training_flops_per_step": analytic["training_flops"],
        "achieved_tflops": throughput["training_tflops_per_s"], "peak_tflops": throughput["peak_tflops"],
        "mfu_percent": 100 * throughput["mfu"] if throughput["mfu"] is not None else None,
        "deepspeed_forward_flops": result["deepspeed"].get("forward_flops"),
        "deepspeed_over_analytic": result["comparison"]["deepspeed_over_analytic"],
    }
    paths = {"flops_profile.json": out_dir / "flops_profile.json", "mfu_analysis.csv": out_dir / "mfu_analysis.csv"}
    with open(paths["mfu_analysis.csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(row))
        writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    result["files"] = {name: str(path) for name, path in paths.items()}
    if result["deepspeed"].get("model_profile"):
        result["files"]["model_profile.txt"] = result["deepspeed"]["model_profile"]
    if result["roofline"] and result["roofline"]["path"]:
        result["files"]["roofline.png"] = result["roofline"]["path"]
    write_json(paths["flops_profile.json"], result)
    return result["files"]


# ----------------------------------------------------------------------------------------------------------
# run_deepspeed_flops.py: the summary (printed after a run, and again by --analyze-results)
# ----------------------------------------------------------------------------------------------------------
def gflop(count: float | None) -> str:
    return "n/a" if count is None else f"{count / 1e9:.4f} GFLOP"


def flops_summary(result: dict) -> list[str]:
    ds, analytic, comparison = result["deepspeed"], result["analytic"], result["comparison"]
    t, tp = result["timing"], result["throughput"]
    lines = [f"=== FLOPs and MFU: {result['version']} ({result['title']}) on {result['device']['name']}, "
             f"{result['precision']}, batch {result['batch_size']} x seq {result['seq_len']} ==="]

    lines += ["", "--- (a) DeepSpeed FLOPS profiler, one forward pass ---"]
    if ds["available"]:
        lines.append(f"forward FLOPs {gflop(ds['forward_flops'])}, MACs {ds['forward_macs'] / 1e9:.4f} G, "
                     f"parameters {ds['params']:,}, forward latency {ds['forward_latency_ms']:.2f} ms "
                     f"(with DeepSpeed's per-module synchronisation)")
        shown = [{**row, "latency_us": 1e3 * row["latency_ms"]} for row in ds["modules"]]
        lines.append(reports.format_table(shown, ["module", "params", "flops", "macs", "latency_us"]))
        lines.append(f"every module in detail: {ds['model_profile']}")
    else:
        lines.append(ds["message"])

    lines += ["", "--- (b) analytic count (tinytransformer/flops.py: " + analytic["conventions"] + ") ---"]
    per_layer = analytic["per_layer_total"]
    rows = [{"matmul": name, "flops": value, "pct_of_layer": 100 * value / per_layer}
            for name, value in analytic["per_layer"].items()]
    lines.append(reports.format_table(rows, ["matmul", "flops", "pct_of_layer"]))
    lines.append(f"one layer {gflop(per_layer)} x {analytic['num_layers']} layers + output head "
                 f"{gflop(analytic['output_head'])} = forward {gflop(analytic['forward_flops'])}; "
                 f"training step (3 x forward) {gflop(analytic['training_flops'])}")
    if comparison["deepspeed_over_analytic"] is not None:
        ratio = comparison["deepspeed_over_analytic"]
        lines.append(f"DeepSpeed / analytic = {ratio:.4f}")
        if comparison.get("parts"):
            shown = [{**row, "ratio": "-" if row["ratio"] is None else f"{row['ratio']:.4f}"}
                     for row in comparison["parts"]]   # four decimals: the differences are small
            lines.append(reports.format_table(shown, ["part", "module", "analytic_flops", "deepspeed_flops",
                                                      ("ratio", "deepspeed/analytic")]))
        lines.append(comparison["explanation"])
        if ratio < 0.9:
            lines.append("note: DeepSpeed sees less than the matrix products alone: part of this model runs "
                         "in code it cannot intercept (custom Triton kernels, or a compiled graph)")

    lines += ["", "--- (c) training throughput ---"]
    if t["median_ms"] is None:
        lines.append("no timed steps")
    else:
        lines.append(f"step time: median {t['median_ms']:.3f} ms (p10 {t['p10_ms']:.3f}, p90 {t['p90_ms']:.3f}) "
                     f"over {t['count']} steps after {t['warmup_steps']} warm-up")
        lines.append(f"achieved: {tp['training_tflops_per_s']:.4f} TFLOP/s (analytic training FLOPs / median "
                     f"step time), {tp['samples_per_s']:.1f} samples/s, {tp['tokens_per_s']:,.0f} tokens/s")
        if tp["mfu"] is not None:
            lines.append(f"MFU: {100 * tp['mfu']:.2f}% of {tp['peak_tflops']:g} TFLOP/s "
                         f"({result['precision']} data-sheet peak of this device)")
        else:
            lines.append("MFU: unknown (no peak for this device)")

    intensity = result.get("intensity")
    if intensity:
        ridge = intensity["ridge_flops_per_byte"]
        lines += ["", "--- (d) arithmetic intensity of one layer's matrix products (forward) ---"]
        lines.append(f"byte model: {intensity['byte_model']}; {intensity['bytes_per_element']} bytes per "
                     f"element ({result['precision']})")
        lines.append(reports.format_table(intensity["rows"], ["matmul", "shape", "flops", "bytes",
                                                              "flops_per_byte", "bound"]))
        lines.append(f"ridge point: {ridge:.1f} FLOP/byte (peak FLOP/s / memory bandwidth); below it a product "
                     "is memory-bound" if ridge else
                     "ridge point: unknown (no peak FLOP/s or bandwidth for this device), so no bound column")
    roofline = result.get("roofline")
    if roofline:
        lines.append(f"roofline: {roofline['path']}" if roofline["path"] else roofline["message"])
    if result.get("files"):
        lines += ["", "--- Files ---"] + [f"{name:<18}: {path}" for name, path in result["files"].items()]
    return lines


def load_flops_result(text: str, output_dir: str) -> dict:
    """A saved flops_profile.json; a bare name is also looked for in --output-dir. ConfigError if bad."""
    path = Path(text)
    if not path.exists() and not path.is_absolute() and (Path(output_dir) / path).exists():
        path = Path(output_dir) / path
    if not path.is_file():
        raise ConfigError(f"--analyze-results: no such file: {text}")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"--analyze-results: {path} is not readable JSON ({type(error).__name__})") from None
    needed = ("deepspeed", "analytic", "comparison", "timing", "throughput", "device")
    if not isinstance(result, dict) or result.get("kind") != FLOPS_PROFILE_KIND or any(
            key not in result for key in needed):
        raise ConfigError(f"--analyze-results: {path} is not a flops_profile.json written by run_deepspeed_flops.py")
    return result


def deepspeed_flops_main(spec: VersionSpec, argv=None) -> int:
    """run_deepspeed_flops.py: DeepSpeed and analytic FLOPs, achieved TFLOP/s and MFU."""
    parser = deepspeed_flops_parser(spec)
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args
    try:
        if args.analyze_results:
            result = load_flops_result(args.analyze_results, args.output_dir)
        else:
            result = measure_flops(spec, args, argv, command_line(parser.prog, argv))
            try:
                write_flops_outputs(Path(args.output_dir), result)
            except OSError as error:
                raise ConfigError(f"cannot write into {args.output_dir}: {error.strerror or error}") from None
        print("\n".join(flops_summary(result)))
    except (ConfigError, reports.TraceError) as error:
        return fail(parser.prog, str(error))
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return silence_closed_pipe()
    return 0
