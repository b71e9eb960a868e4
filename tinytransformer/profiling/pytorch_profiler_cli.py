"""run_pytorch_profiler.py of every version: a short training run under torch.profiler, then where the time went.

    run_pytorch_profiler.py  ->  pytorch_profiler_main(spec, argv)

A version's script is a few lines: it imports the version's `SPEC` (a cli.VersionSpec) and calls
pytorch_profiler_main, so every version is measured by exactly the same code and accepts every training flag.
The run goes through the shared Trainer (which records the trace and writes the report files); this command then
prints top operators, top GPU kernels, kernels per step and the split between the model's parts (attention,
ffn, ...) and the training phases (backward, optimizer). `--analyze-existing TRACE` prints the same tables for a
trace recorded earlier, with no GPU needed.

Bad input anywhere: one line on stderr and exit code 2, as in cli.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli import (VersionSpec, build_parser, command_line, given_arguments, non_negative_int, parse_or_exit_code,
                   resolve_configs, run_command)
from ..config import ConfigError, TrainConfig
from ..paths import ensure_directory, refuse_output_over_input
from .tables import REPORT_NAMES, trace_tables, write_reports
from .trace import TraceError, load_trace, resolve_trace_argument

DEFAULT_PROFILE_STEPS = 12          # steps of a profiler run when --num-steps is not given
DEFAULT_TABLE_ROWS = 20


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


def report_path(directory, spec: VersionSpec) -> Path:
    """Where --generate-report writes its markdown report."""
    return Path(directory) / f"profile_report_{spec.name}.md"


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
    trace = load_trace(trace_path)
    out_dir = ensure_directory(args.profile_dir, "--profile-dir") if args.profile_dir else trace_path.parent
    reports = [out_dir / name for name in REPORT_NAMES] + ([report_path(out_dir, spec)] if args.generate_report else [])
    refuse_output_over_input([("--profile-dir", path) for path in reports], [("--analyze-existing", trace_path)])
    sort_by = args.sort_by or TrainConfig.sort_by
    try:
        written = write_reports(trace, out_dir, sort_by=sort_by, limit=args.limit)
    except OSError as error:
        raise ConfigError(f"cannot write reports into {out_dir}: {error.strerror or error}") from None
    tables = trace_tables(trace, sort_by, args.limit)
    print("\n".join(tables))
    files = [f"Chrome trace        : {trace_path}",
             f"Reports             : {', '.join(p.name for p in written.values())} in {out_dir}/"]
    if args.generate_report:
        report = report_path(out_dir, spec)
        write_profile_report(report, spec, command, [f"trace analysed: {trace_path}"], tables, files)
        files.append(f"Report              : {report}")
    print("\n--- Files ---\n" + "\n".join(files))
    return 0


def profile_training_run(spec: VersionSpec, args, argv, command: str) -> int:
    from ..training.preflight import run_inputs, settings_files   # after parsing, so that --help stays fast
    from ..training.trainer import Trainer
    args.enable_pytorch_profiler = True
    if args.num_steps is None:
        args.num_steps = DEFAULT_PROFILE_STEPS
    model_config, train_config = resolve_configs(args)
    if args.generate_report:   # the trainer checks the files it writes itself; this one is written here
        refuse_output_over_input([("--generate-report", report_path(train_config.profile_dir, spec))],
                                 run_inputs(train_config, settings_files(args)))
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
    trace = load_trace(trace_path)
    profile_dir = Path(train_config.profile_dir)
    # The trainer wrote these reports already, with 20 rows in summary.md; again with this --limit.
    written = write_reports(trace, profile_dir, sort_by=train_config.sort_by, limit=args.limit)
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
        report = report_path(profile_dir, spec)
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
    if args.analyze_existing:
        return run_command(parser.prog, lambda: analyze_existing_trace(spec, args, command), errors=(TraceError,))
    return run_command(parser.prog, lambda: profile_training_run(spec, args, argv, command), errors=(TraceError,))
