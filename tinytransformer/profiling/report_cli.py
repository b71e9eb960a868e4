"""The report command: operator, kernel and phase tables of a trace recorded earlier, with no GPU needed.

    python -m tinytransformer.profiling.report_cli trace.json --limit 15 --output-dir reports/
    python -m tinytransformer.profiling.report_cli trace.json.gz --sort-by self_cpu_time

It needs the standard library alone (no torch): a trace recorded on a GPU machine can be analysed on a laptop.
Bad input: one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ..checks import ConfigError
from ..paths import prove_output_dir
from .analysis import (SORT_KEY_ALIASES, SORT_KEYS, family_split, phase_split, summarize, top_kernels,
                       top_operators)
from .tables import (FAMILY_COLUMNS, KERNEL_COLUMNS, PHASE_COLUMNS, format_table, headline, operator_columns,
                     write_reports)
from .trace import TraceError, load_trace

PROG = "python -m tinytransformer.profiling.report_cli"


def _positive_or_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0 shows every row)")
    return value


def _parser() -> argparse.ArgumentParser:
    from ..cli import OneLineParser   # here: cli.py imports this package
    parser = OneLineParser(
        prog=PROG,
        description="Operator, kernel and phase tables from a torch.profiler trace (.json or .json.gz).",
    )
    parser.add_argument("trace", help="trace written by torch.profiler's export_chrome_trace")
    parser.add_argument("--sort-by", default="self_device_time", metavar="KEY",
                        choices=list(SORT_KEYS) + list(SORT_KEY_ALIASES),
                        help="operator sort key: %(choices)s (default: %(default)s)")
    parser.add_argument("--limit", type=_positive_or_zero, default=20,
                        help="rows per table, 0 for all (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="also write operators.csv, kernels.csv, phases.csv, families.csv and summary.md here")
    return parser


def _fail(parser: argparse.ArgumentParser, message: str):
    """argparse's error format and exit status 2, without the usage block: the options were fine."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables for one trace. Bad input: one line on stderr and exit status 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.output_dir is not None:
        try:   # before reading a trace that may take a while
            prove_output_dir(args.output_dir, "--output-dir")
        except ConfigError as err:
            _fail(parser, str(err))
    try:
        trace = load_trace(args.trace)
        operators = top_operators(trace, sort_by=args.sort_by, limit=args.limit)
        kernels = top_kernels(trace, limit=args.limit)
        phases = phase_split(trace)
        families = family_split(trace)
        summary = summarize(trace)
    except TraceError as err:
        _fail(parser, str(err))

    out = [f"Trace: {trace.path}"] + headline(summary)
    out += ["", f"Time per phase ({phases['label']}):", format_table(phases["rows"], PHASE_COLUMNS)]
    if families:
        out += ["", "Device time per kernel family (by kernel name):", format_table(families, FAMILY_COLUMNS)]
    out += ["", f"Top operators by {operators.meta['sort_by']}:"]
    if operators.meta["note"]:
        out.append(f"(note: {operators.meta['note']})")
    out.append(format_table(operators, operator_columns(operators.meta)))
    if kernels:
        out += ["", "Top kernels by total device time:", format_table(kernels, KERNEL_COLUMNS)]

    if args.output_dir is not None:
        try:
            paths = write_reports(trace, args.output_dir, sort_by=args.sort_by, limit=args.limit)
        except OSError as err:
            _fail(parser, f"cannot write reports to {args.output_dir}: {err.strerror or err}")
        out += ["", "Wrote: " + ", ".join(str(path) for path in paths.values())]
    try:
        print("\n".join(out))
    except BrokenPipeError:  # piped into `head`: the reader has what it wanted; silence the exit flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
