"""python -m benchmarks.kernel_report: compile every Triton kernel for AMD and NVIDIA targets, report.

Exit status: 0 when every kernel configuration compiles and fits on every target asked for, 1 when one does
not (the table says which), 2 for bad input (one line).
"""
from __future__ import annotations

import shlex
import sys
import tempfile
import time
from pathlib import Path

from tinytransformer.cli import OneLineParser, given_arguments, parse_or_exit_code, run_command
from tinytransformer.config import ConfigError, available_presets
from tinytransformer.outputs import write_atomically, write_json
from .report_file import read_report
from .targets import TARGETS

PROG = "python -m benchmarks.kernel_report"
EXIT_NOT_ALL_COMPILED = 1


def _names(text: str, known: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"unknown {what} {', '.join(unknown) or repr(text)}; known: {', '.join(known)}")
    return names


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, description=(
        "Compile every Triton kernel of versions 3 and 4, with the launch configurations a training step uses "
        "at each size preset, for AMD and NVIDIA GPUs (no GPU needed); report registers, spills, shared "
        "memory / LDS and occupancy."))
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated compiler targets among {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--presets", default=",".join(available_presets()),
                        help="comma-separated size presets of configs/ (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="one launch configuration per kernel and target (the CI check), not all")
    parser.add_argument("--output-json", metavar="FILE", help="write every row as JSON")
    parser.add_argument("--markdown", metavar="FILE",
                        help="write the markdown summary into FILE, replacing its generated block if it has one")
    parser.add_argument("--from-json", metavar="FILE",
                        help="compile nothing: print the table (and write --markdown) from a JSON written before")
    return parser


def _check_writable(path: str, flag: str) -> None:
    """Fail now, in one line, rather than after minutes of compiling: the directory must take a new file."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as error:
        raise ConfigError(f"{flag} {path}: cannot write there ({error.strerror or error})") from None


def _markdown_text(path: str | None) -> str | None:
    """The text of an existing --markdown file, read before any compiling: a file that is not UTF-8 text is one
    line now, not an error after minutes of work. None when there is no such file (it will be created)."""
    if not path or not Path(path).exists():
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--markdown {path}: not a text (UTF-8) file; its generated block cannot be replaced") \
            from None
    except OSError as error:
        raise ConfigError(f"--markdown {path}: cannot read it ({error.strerror or error})") from None


def _write_markdown(path: str, existing: str | None, block: str) -> None:
    from .render import replace_block
    text = replace_block(existing, block) if existing is not None else block
    write_atomically(Path(path), lambda f: f.write(text))


def body(argv) -> int:
    args = parse_or_exit_code(build_parser(), argv)
    if isinstance(args, int):
        return args
    for flag, path in (("--output-json", args.output_json), ("--markdown", args.markdown)):
        if path:
            _check_writable(path, flag)
    existing_markdown = _markdown_text(args.markdown)
    from . import render
    if args.from_json:
        doc = read_report(args.from_json)
    else:
        targets = _names(args.targets, list(TARGETS), "target")
        presets = _names(args.presets, available_presets(), "preset")
        from .report import build
        started = time.perf_counter()
        rows = build(targets, presets, first_only=args.quick,
                     progress=lambda row: print(f"  {row['target']:7} {row['kernel']}: {row['status']}",
                                                file=sys.stderr, flush=True))
        doc = render.document(rows, targets, presets, f"{PROG} {shlex.join(given_arguments(argv))}".strip())
        print(f"{len(rows)} kernel configurations compiled in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
    print(render.terminal_table(doc["rows"]))
    if args.output_json:
        write_json(args.output_json, doc)
    if args.markdown:
        _write_markdown(args.markdown, existing_markdown, render.markdown(doc))
    failed = [r for r in doc["rows"] if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} kernel configuration(s) do not compile or do not fit: see the table",
              file=sys.stderr)
        return EXIT_NOT_ALL_COMPILED
    return 0


def main(argv=None) -> int:
    return run_command(PROG, lambda: body(argv))
