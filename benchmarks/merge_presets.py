"""Join the per-preset results of compare_versions.py into one file.

    python benchmarks/merge_presets.py tiny.json small.json medium.json large.json \\
        --output benchmarks/results/h100_presets_bfloat16.json

Why. Every preset at its own size, every row three times in interleaved rounds, is close to an hour of GPU time
(the large preset alone takes about 8 minutes a round). That does not fit one command on a machine whose commands
are limited in time, so each preset runs as its own command, `compare_versions.py --preset NAME --repeats 3
--output NAME.json`, continued with `--resume` until its rounds are complete; on a machine with several GPUs
the presets can run side by side, one per GPU (`CUDA_VISIBLE_DEVICES=i`). This script then joins the files.

What stays true. The rows of one preset all come from one file, that is from one command (and its resumptions)
on one GPU, so every ratio inside a preset's table compares rows measured together, the way compare_versions.py
measures them. The joined file keeps every part's commands, notes and loss-agreement problems (`parts`), and
every single run (`runs`) next to the median rows.

Refused with one line and exit 2: a file that cannot be read or is not compare_versions results, parts with
different dtype, step counts, repeats or profiled windows (their rows would not be comparable), parts measured on
different GPU models or software versions, two parts holding the same preset, and an output that cannot be written.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared harness

from comparison_rows import was_profiled  # noqa: E402  (this script's folder is on the path when it runs)
from result_formats import read_comparison  # noqa: E402
from tinytransformer.cli import OneLineParser, fail  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import prove_output_file, refuse_output_over_input  # noqa: E402

PROG = "merge_presets.py"
# What every part must share, or its rows could not stand in one table with the others'.
SETTINGS = ("dtype", "num_steps", "warmup_steps", "repeats")
SOFTWARE = ("gpu", "backend", "torch", "triton")


def read_part(path: str) -> dict:
    """A compare_versions.py --preset results file, every field this script joins checked."""
    part = read_comparison(path, need_rows=True)
    if any(row.get("preset") is None for row in part["rows"]):
        raise ConfigError(f"{path}: rows without a preset (this joins runs of compare_versions.py --preset NAME)")
    if "repeats" not in part:   # optional for other readers (files older than --repeats), needed to compare parts
        raise ConfigError(f"{path}: repeats is missing")
    return part


def presets_of(part: dict) -> list[str]:
    return list(dict.fromkeys(row["preset"] for row in part["rows"]))


def check_parts(paths: list[str], parts: list[dict]) -> None:
    """Every part measured like the first, on the same kind of machine, and no preset twice."""
    first, seen = parts[0], {}
    for path, part in zip(paths, parts):
        for key in SETTINGS:
            if part[key] != first[key]:
                raise ConfigError(f"{path}: {key} is {part[key]}, {paths[0]} has {first[key]}: not comparable")
        if was_profiled(part) != was_profiled(first):   # the profiled window is not timed: other steps
            window = {True: "with", False: "without"}
            raise ConfigError(f"{path}: {window[was_profiled(part)]} the profiled window, {paths[0]} "
                              f"{window[was_profiled(first)]} it: timed over other steps")
        for key in SOFTWARE:
            if part["environment"].get(key) != first["environment"].get(key):
                raise ConfigError(f"{path}: measured with {key} {part['environment'].get(key)}, {paths[0]} with "
                                  f"{first['environment'].get(key)}")
        for preset in presets_of(part):
            if preset in seen:
                raise ConfigError(f"{path}: preset {preset} is in {seen[preset]} too; give each preset once")
            seen[preset] = path


def describe_part(path: str, part: dict) -> dict:
    kept = {"file": Path(path).name, "presets": presets_of(part), "command": part["command"]}
    for key in ("resumed_by", "note", "loss_agreement_problems"):
        if part.get(key):
            kept[key] = part[key]
    return kept


def merged(paths: list[str], parts: list[dict], command: str) -> dict:
    first = parts[0]
    result = {"command": command, "environment": first["environment"],
              "preset": ",".join(p for part in parts for p in presets_of(part)),
              **{key: first[key] for key in SETTINGS}, "profile": was_profiled(first),
              "rows": [row for part in parts for row in part["rows"]],
              "parts": [describe_part(path, part) for path, part in zip(paths, parts)]}
    if any("runs" in part for part in parts):
        # A part measured once per row has no separate runs: its rows are its runs.
        result["runs"] = [run for part in parts for run in part.get("runs", part["rows"])]
    problems = [problem for part in parts for problem in part.get("loss_agreement_problems", [])]
    result["loss_agreement_problems"] = problems
    notes = join_notes(paths, parts)
    if notes:
        result["note"] = notes
    return result


def join_notes(paths, parts) -> str:
    """Each distinct note once, after the names of the files that carry it."""
    files_by_note = {}
    for path, part in zip(paths, parts):
        if part.get("note"):
            files_by_note.setdefault(part["note"], []).append(Path(path).name)
    if len(files_by_note) == 1 and len(next(iter(files_by_note.values()))) == len(parts) > 1:
        return f"every part: {next(iter(files_by_note))}"
    return "; ".join(f"{', '.join(files)}: {note}" for note, files in files_by_note.items())


def parse_args(argv):
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", help="compare_versions.py results files, one or more presets each")
    parser.add_argument("--output", required=True, help="the joined results file (written atomically)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        refuse_output_over_input([("--output", args.output)], [("this command", path) for path in args.parts])
        prove_output_file(args.output, "--output")
        parts = [read_part(path) for path in args.parts]
        check_parts(args.parts, parts)
    except ConfigError as error:
        return fail(PROG, str(error))
    result = merged(args.parts, parts, shlex.join(["python", "benchmarks/merge_presets.py", *argv]))
    write_json(args.output, result)
    print(f"{args.output}: presets {result['preset']} ({len(result['rows'])} rows from {len(parts)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
