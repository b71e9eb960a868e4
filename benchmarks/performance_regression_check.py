"""Did a change make training slower? Compare two runs' metrics JSON files (written by --output-json).

    python benchmarks/performance_regression_check.py --baseline before.json --current after.json
    python benchmarks/performance_regression_check.py --baseline v1.json --current v2.json --min-speedup 1.2

Prints samples/s, median step time and peak memory of both runs and the change, then decides:
  exit 1  samples/s dropped by more than --max-drop-percent (default 5), or the speed-up current / baseline is
          below --min-speedup (when given);
  exit 0  otherwise;
  exit 2  a file is missing or is not a metrics JSON.

A comparison means something only like for like. When the two runs differ in model size, batch, sequence
length, precision, data, device or torch version, the script lists every difference before its verdict: a
"regression" between an H100 and a laptop, or between batch 8 and batch 32, is no regression. Comparing two
versions (v1 against v2) is the intended use of --min-speedup, so a different version is reported, not warned.

Step times jitter by a few percent from run to run (clocks, other processes); the default threshold leaves room
for that. Run both sides with enough steps (--num-steps 200) for a stable median.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared harness

from tinytransformer.cli import OneLineParser, non_negative_float, positive_float, run_command  # noqa: E402
from tinytransformer.profiling.result_fields import METRICS, check_metrics, read_json_file  # noqa: E402

PROG = "performance_regression_check.py"
DEFAULT_MAX_DROP_PERCENT = 5.0
# Settings that change how fast a run can be: a difference in any of them makes the comparison unfair.
TRAIN_SETTINGS = ("batch_size", "seq_len", "use_amp", "amp_dtype", "data")
DEVICE_SETTINGS = ("name", "backend", "torch_version", "count")


def load_metrics(path: str) -> dict:
    """A metrics JSON written by a training script's --output-json, every field this script reads checked."""
    return check_metrics(read_json_file(path, METRICS), path)


def differences(baseline: dict, current: dict) -> list[str]:
    """Every setting that differs between two runs and affects speed, as 'what: baseline -> current'."""
    found = []

    def note(label, a, b):
        if a != b:
            found.append(f"{label}: {a} -> {b}")

    model_a, model_b = baseline.get("model_config") or {}, current.get("model_config") or {}
    for key in sorted(set(model_a) | set(model_b)):
        note(f"model {key}", model_a.get(key), model_b.get(key))
    for key in TRAIN_SETTINGS:
        note(key, baseline["train_config"].get(key), current["train_config"].get(key))
    note("precision", baseline.get("precision"), current.get("precision"))
    for key in DEVICE_SETTINGS:
        note(f"device {key}", (baseline.get("device") or {}).get(key), (current.get("device") or {}).get(key))
    return found


def describe_run(metrics: dict) -> str:
    variant = ", ".join(f"{v}" for v in (metrics.get("variant") or {}).values())
    return f"{metrics.get('version', '?')} ({metrics.get('title', '?')}{'; ' + variant if variant else ''})"


def change(a, b) -> str:
    if a is None or b is None or not a:
        return "n/a"
    return f"{100 * (b - a) / a:+.1f}%"


def number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(baseline: dict, current: dict, max_drop_percent: float, min_speedup: float | None) -> tuple[list[str], bool]:
    """(lines to print, passed)."""
    rows = [
        ("samples/s", baseline["throughput"]["samples_per_s"], current["throughput"]["samples_per_s"], ",.1f"),
        ("median step ms", baseline["timing"].get("median_ms"), current["timing"].get("median_ms"), ".3f"),
        ("peak memory MiB", baseline["memory"].get("peak_allocated_mib"),
         current["memory"].get("peak_allocated_mib"), ",.1f"),
        ("final loss", (baseline.get("loss") or {}).get("final"), (current.get("loss") or {}).get("final"), ".4f"),
    ]
    lines = [f"baseline: {describe_run(baseline)}", f"current : {describe_run(current)}", ""]
    lines.append(f"{'':<16} {'baseline':>12} {'current':>12} {'change':>8}")
    for label, a, b, spec in rows:
        lines.append(f"{label:<16} {number(a, spec):>12} {number(b, spec):>12} {change(a, b):>8}")

    differ = differences(baseline, current)
    if differ:
        lines += ["", "NOTE: the runs are not like for like, so this is not a regression test in the strict sense:"]
        lines += [f"  - {item}" for item in differ]
    elif baseline.get("version") != current.get("version"):
        lines += ["", f"Same configuration and device, versions {baseline.get('version')} -> {current.get('version')}."]

    speedup = current["throughput"]["samples_per_s"] / baseline["throughput"]["samples_per_s"]
    drop_percent = 100 * (1 - speedup)
    lines.append("")
    failures = []
    if drop_percent > max_drop_percent:
        failures.append(f"samples/s dropped by {drop_percent:.1f}%, more than the allowed {max_drop_percent:g}%")
    if min_speedup is not None and speedup < min_speedup:
        failures.append(f"speed-up {speedup:.2f}x is below the required {min_speedup:g}x")
    if failures:
        lines += [f"REGRESSION: {reason}" for reason in failures]
    else:
        required = f", required >= {min_speedup:g}x" if min_speedup is not None else ""
        lines.append(f"OK: speed-up {speedup:.2f}x (allowed drop {max_drop_percent:g}%{required})")
    return lines, not failures


def parse_args(argv):
    parser = OneLineParser(
        prog=PROG,
        description="Compare two metrics JSON files (--output-json of a training run). Exit 1 when samples/s "
                    "dropped by more than --max-drop-percent or the speed-up is below --min-speedup.")
    parser.add_argument("--baseline", required=True, help="metrics JSON of the reference run")
    parser.add_argument("--current", required=True, help="metrics JSON of the run to check")
    parser.add_argument("--max-drop-percent", type=non_negative_float, default=DEFAULT_MAX_DROP_PERCENT,
                        help="largest allowed drop in samples/s, in percent")
    parser.add_argument("--min-speedup", type=positive_float,
                        help="also require current / baseline samples/s >= this (e.g. 1.2 for a new version)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        baseline, current = load_metrics(args.baseline), load_metrics(args.current)
        lines, passed = report(baseline, current, args.max_drop_percent, args.min_speedup)
        print("\n".join(lines))
        return 0 if passed else 1
    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
