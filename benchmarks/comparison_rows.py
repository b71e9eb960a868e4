"""The rows of a cross-version comparison: one run of a variant, the loss check against version 1, the speed-ups,
the median of repeated runs, and the table and plot made of them (benchmarks/compare_versions.py runs them)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from table_format import NO_MATPLOTLIB, fmt, markdown_header, markdown_row
from training_runs import REPO_ROOT, SCRIPTS, run_training
from variants import VARIANTS, is_peer

sys.path.insert(0, str(REPO_ROOT))  # the shared harness: plots

from tinytransformer.outputs import load_pyplot  # noqa: E402

# Losses of different versions agree to floating point at the first step; later, rounding differences are
# amplified by training, so the final losses are compared with a looser bound.
FIRST_LOSS_RTOL = {"float32": 2e-3, "bfloat16": 2e-2}
FINAL_LOSS_RTOL = 0.05


def config_of(row: dict) -> tuple:
    """What a row was measured at: (preset or None, batch, seq). Rows are compared only within one config."""
    return row.get("preset"), row["batch_size"], row["seq_len"]


def config_label(config: tuple) -> str:
    preset, batch, seq = config
    return (f"{preset} " if preset else "") + f"b{batch} s{seq}"


def size_flags(args, config: tuple) -> list[str]:
    """The flags of a run that decide its model, sizes and precision (the same for every variant)."""
    preset, batch, seq = config
    flags = [*(["--preset", preset] if preset else []),
             "--batch-size", str(batch), "--seq-len", str(seq), "--max-seq-len", str(max(seq, 128)),
             "--device", args.device]
    if args.dtype == "bfloat16":
        flags += ["--use-amp", "--amp-dtype", "bfloat16"]
    return flags + list(args.extra)


# Steps each run records for its kernels/step (unless --no-profile); they, and the profiler's wait and warm-up step
# before them, are not timed (tinytransformer/training/tools.py: profiler_window).
PROFILE_STEPS = 2


def was_profiled(results: dict) -> bool:
    """Whether a results file's runs had the profiled window: what the file says, or, in files from before it said
    so, its command (a file joined by merge_presets.py: whether any of its parts' commands had it)."""
    if "profile" in results:
        return results["profile"]
    if results.get("parts"):
        return any(was_profiled(part) for part in results["parts"])
    return "--no-profile" not in str(results.get("command", "")).split()


def variant_command(label: str, args, config: tuple, json_path: Path, out_dir: Path) -> list[str]:
    script, extra = VARIANTS[label]
    command = [sys.executable, str(REPO_ROOT / SCRIPTS[script]),
               "--num-steps", str(args.num_steps), "--warmup-steps", str(args.warmup_steps),
               "--seed", str(args.seed), "--log-every", str(args.num_steps), "--output-json", str(json_path), *extra]
    if script == "v4" and args.cublas_workspace == "default":
        command += ["--cublas-workspace", "default"]   # version 4's own default is none (compare_versions.py)
    if args.profile:
        command += ["--enable-pytorch-profiler", "--profile-steps", str(PROFILE_STEPS),
                    "--profile-dir", str(out_dir / f"prof_{label}")]
    return command + size_flags(args, config)


def run_variant(label, args, config: tuple, out_dir: Path) -> dict:
    """One run of a variant, as a row. Batch and sequence length are read back from the run itself, so the row
    names the shape that really ran (flags passed after -- could have changed it)."""
    preset, batch, seq = config
    json_path = out_dir / f"{label}_{config_label(config).replace(' ', '_')}.json"
    command = variant_command(label, args, config, json_path, out_dir)
    outcome = run_training(command, json_path, args.timeout)
    row = {"variant": label, "version": VARIANTS[label][0], "preset": preset, "batch_size": batch, "seq_len": seq,
           "dtype": args.dtype, "command": shlex.join([Path(command[1]).name] + command[2:]), "wall_s": outcome.wall_s}
    if outcome.error:
        row["error"] = outcome.error
        return row
    metrics = outcome.metrics
    row.update({
        "batch_size": metrics["train_config"]["batch_size"],
        "seq_len": metrics["train_config"]["seq_len"],
        "parameters": metrics.get("parameters"),
        "samples_per_s": metrics["throughput"]["samples_per_s"],
        "tokens_per_s": metrics["throughput"]["tokens_per_s"],
        "median_step_ms": metrics["timing"]["median_ms"],
        "timed_steps": metrics["timing"].get("count"),   # after warm-up, less the profiled window
        "p10_step_ms": metrics["timing"]["p10_ms"],
        "p90_step_ms": metrics["timing"]["p90_ms"],
        "mfu": metrics["throughput"]["mfu"],
        "peak_memory_mib": metrics["memory"]["peak_allocated_mib"],
        "kernels_per_step": (metrics.get("profile") or {}).get("kernels_per_step"),
        "first_loss": metrics["loss"]["first"],
        "final_loss": metrics["loss"]["final"],
        "variant_description": metrics.get("variant"),
        "device": metrics["device"],
    })
    return row


def check_agreement(rows: list[dict], dtype: str) -> list[str]:
    """Problems found comparing each row's losses with v1's at the same configuration.

    A peer that does not compute our function is refused: its row becomes an error row that says why, since a
    speed of another function means nothing here. A version that disagrees is reported (and fails the run)."""
    problems = []
    baseline = {config_of(r): r for r in rows if r["variant"] == "v1" and "error" not in r}
    for row in rows:
        ref = baseline.get(config_of(row))
        if ref is None or row is ref or "error" in row:
            continue
        for key, rtol in (("first_loss", FIRST_LOSS_RTOL[dtype]), ("final_loss", FINAL_LOSS_RTOL)):
            if abs(row[key] - ref[key]) > rtol * abs(ref[key]):
                problem = (f"{key} {row[key]:.4f} vs v1 {ref[key]:.4f} (allowed relative difference {rtol})")
                if is_peer(row["variant"]):
                    row["error"] = f"refused: not the same function as v1 ({problem})"
                    break
                problems.append(f"{row['variant']} {config_label(config_of(row))}: {problem}")
    return problems


def add_speedups(rows: list[dict]) -> None:
    baseline = {config_of(r): r.get("samples_per_s") for r in rows if r["variant"] == "v1"}
    for row in rows:
        ref = baseline.get(config_of(row))
        row["speedup_vs_v1"] = row["samples_per_s"] / ref if ref and row.get("samples_per_s") else None


def median_runs(runs: list[dict]) -> list[dict]:
    """One row per (variant, config): its run with the median samples/s, carrying every run's samples/s.

    A failed run makes the row failed: a variant that fails one time in three is not measured."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["variant"], *config_of(run)), []).append(run)
    rows = []
    for group in groups.values():
        failed = [r for r in group if "error" in r]
        if failed:
            row = dict(failed[0])   # a copy: the run itself stays as it was in the list of runs
            row.pop("repeat", None)
            rows.append(row)
            continue
        ordered = sorted(group, key=lambda r: r["samples_per_s"])
        row = dict(ordered[(len(ordered) - 1) // 2])   # an odd count: the middle run; even: the slower middle
        row.pop("repeat", None)
        row["repeats_samples_per_s"] = [r["samples_per_s"] for r in sorted(group, key=lambda r: r.get("repeat", 0))]
        rows.append(row)
    return rows


def rows_of(runs: list[dict], repeats: int) -> list[dict]:
    """The reported rows: with repeats, each variant's median run (median_runs); without, the runs themselves
    (copies without the round number)."""
    if repeats > 1:
        return median_runs(runs)
    return [{k: v for k, v in run.items() if k != "repeat"} for run in runs]


def table(rows: list[dict]) -> str:
    header = ("variant", "preset", "batch", "seq", "samples/s", "tokens/s", "step ms", "MFU", "peak MiB",
              "kernels/step", "vs v1", "final loss")
    lines = markdown_header(header)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r.get('preset') or '-'} | {r['batch_size']} | {r['seq_len']} | "
                         f"failed: {r['error']} |")
            continue
        mfu = 100 * r["mfu"] if r.get("mfu") is not None else None
        cells = (r["variant"], r.get("preset") or "-", str(r["batch_size"]), str(r["seq_len"]),
                 fmt(r["samples_per_s"], ",.0f"),
                 fmt(r["tokens_per_s"], ",.0f"), fmt(r["median_step_ms"], ".2f"), fmt(mfu, ".1f", "%"),
                 fmt(r["peak_memory_mib"], ",.0f"), fmt(r["kernels_per_step"], ".0f"),
                 fmt(r["speedup_vs_v1"], ".2f", "x"), fmt(r["final_loss"], ".4f"))
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str:
    plt = load_pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    configs = sorted({config_of(r) for r in rows}, key=lambda c: (c[1], c[2]))
    fig, ax = plt.subplots(figsize=(max(6, len(configs) * 0.6), 4))
    for label in VARIANTS:
        points = {config_of(r): r.get("samples_per_s") for r in rows if r["variant"] == label}
        if points:
            ax.plot(range(len(configs)), [points.get(c) or float("nan") for c in configs], marker="o", label=label)
    ax.set_xticks(range(len(configs)), [config_label(c).replace(" ", "\n") for c in configs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"
