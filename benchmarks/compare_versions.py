"""Cross-version benchmark: every version at one configuration, one table, one JSON.

    python benchmarks/compare_versions.py                          (small and fast: seed config, 30 steps)
    python benchmarks/compare_versions.py --num-steps 200 --dtype bfloat16 --output results.json
    python benchmarks/compare_versions.py --sweep --num-steps 60   (batch {4,8,16,32} x seq {128,...,1024})
    python benchmarks/compare_versions.py --sweep --num-steps 60 --output sweep.json --resume
                                                                   (finish a sweep that was cut short)
    python benchmarks/compare_versions.py --num-steps 200 --repeats 3   (each variant 3 times, interleaved)

Why fresh processes: each variant runs its own training script in a new Python process, exactly as a workshop
attendee runs it. Nothing leaks between variants (version 4's TF32 switch, torch.compile caches, the CUDA
caching allocator's pools), and the first variant does not pay everyone's warm-up.

Why they can be compared: every version initialises from the same canonical weights for the same --seed and
reads the same batches (a function of seed and step), so their losses must agree step by step up to floating
point; the benchmark checks that before it reports any speed. Timing is the harness's: device events around
each step, warm-up steps excluded, median of the rest. Kernels per step come from a short profiled window of
the same run (those steps are excluded from the timing).

Why --repeats: at the seed size the eager versions are host-bound, and a shared or virtualised host is not
equally fast all the time: on an H100 node the same v1 run measured 17.0 ms per step one hour and 23.5 ms the
next. Within one run the median absorbs such spells; between runs it cannot, so a slow spell during one variant
skews the ratios. With --repeats N every variant runs N times, in rounds (v1, v2, ..., v4, then v1 again, ...),
so a slow spell hits all variants alike, and each reported row is the variant's run with the median samples/s;
all N throughputs are kept in the row (`repeats_samples_per_s`).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from table_format import NO_MATPLOTLIB, fmt, markdown_header, markdown_row
from training_runs import REPO_ROOT, SCRIPTS, run_training, triton_shape_problem

sys.path.insert(0, str(REPO_ROOT))  # the shared harness: result files and plots

from tinytransformer.outputs import load_pyplot, write_json  # noqa: E402

# label -> (version, extra flags)
VARIANTS = {
    "v1": ("v1", []),
    "v2": ("v2", []),
    "v2+compile": ("v2", ["--enable-torch-compile", "--torch-compile-mode", "reduce-overhead"]),
    "v3": ("v3", []),
    "v4": ("v4", []),
}
SWEEP_BATCHES = (4, 8, 16, 32)
SWEEP_SEQ_LENS = (128, 256, 512, 1024)
# Losses of different versions agree to floating point at the first step; later, rounding differences are
# amplified by training, so the final losses are compared with a looser bound.
FIRST_LOSS_RTOL = {"float32": 2e-3, "bfloat16": 2e-2}
# Without a GPU (a laptop, CI), the default is a quick look rather than a measurement: a small model, short
# sequences, and no torch.compile (which spends about a minute compiling on a CPU). Triton kernels run in the
# interpreter there, so versions 3 and 4 are much SLOWER than 1 and 2 on a CPU: the speeds say nothing about GPUs.
CPU_MODEL_FLAGS = ["--hidden-dim", "64", "--num-heads", "2", "--num-layers", "2", "--intermediate-size", "128",
                   "--vocab-size", "256"]
CPU_BATCH, CPU_SEQ_LEN = 2, 32
FINAL_LOSS_RTOL = 0.05


def run_variant(label, args, batch, seq, out_dir: Path) -> dict:
    version, extra = VARIANTS[label]
    json_path = out_dir / f"{label}_b{batch}_s{seq}.json"
    command = [sys.executable, str(REPO_ROOT / SCRIPTS[version]),
               "--batch-size", str(batch), "--seq-len", str(seq), "--max-seq-len", str(max(seq, 128)),
               "--num-steps", str(args.num_steps), "--warmup-steps", str(args.warmup_steps),
               "--seed", str(args.seed), "--device", args.device, "--log-every", str(args.num_steps),
               "--output-json", str(json_path), *extra]
    if args.dtype == "bfloat16":
        command += ["--use-amp", "--amp-dtype", "bfloat16"]
    if args.profile:
        command += ["--enable-pytorch-profiler", "--profile-steps", "2", "--profile-dir", str(out_dir / f"prof_{label}")]
    command += args.extra
    outcome = run_training(command, json_path, args.timeout)
    row = {"variant": label, "version": version, "batch_size": batch, "seq_len": seq, "dtype": args.dtype,
           "command": shlex.join([Path(command[1]).name] + command[2:]), "wall_s": outcome.wall_s}
    if outcome.error:
        row["error"] = outcome.error
        return row
    metrics = outcome.metrics
    row.update({
        "samples_per_s": metrics["throughput"]["samples_per_s"],
        "tokens_per_s": metrics["throughput"]["tokens_per_s"],
        "median_step_ms": metrics["timing"]["median_ms"],
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
    """Problems found comparing each variant's losses with v1's at the same configuration."""
    problems = []
    baseline = {(r["batch_size"], r["seq_len"]): r for r in rows if r["variant"] == "v1" and "error" not in r}
    for row in rows:
        ref = baseline.get((row["batch_size"], row["seq_len"]))
        if ref is None or row is ref or "error" in row:
            continue
        for key, rtol in (("first_loss", FIRST_LOSS_RTOL[dtype]), ("final_loss", FINAL_LOSS_RTOL)):
            if abs(row[key] - ref[key]) > rtol * abs(ref[key]):
                problems.append(f"{row['variant']} b{row['batch_size']} s{row['seq_len']}: {key} {row[key]:.4f} "
                                f"vs v1 {ref[key]:.4f} (allowed relative difference {rtol})")
    return problems


def add_speedups(rows: list[dict]) -> None:
    baseline = {(r["batch_size"], r["seq_len"]): r.get("samples_per_s") for r in rows if r["variant"] == "v1"}
    for row in rows:
        ref = baseline.get((row["batch_size"], row["seq_len"]))
        row["speedup_vs_v1"] = row["samples_per_s"] / ref if ref and row.get("samples_per_s") else None


def table(rows: list[dict]) -> str:
    header = ("variant", "batch", "seq", "samples/s", "tokens/s", "step ms", "peak MiB", "kernels/step",
              "vs v1", "final loss")
    lines = markdown_header(header)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch_size']} | {r['seq_len']} | failed: {r['error']} |")
            continue
        cells = (r["variant"], str(r["batch_size"]), str(r["seq_len"]), fmt(r["samples_per_s"], ",.0f"),
                 fmt(r["tokens_per_s"], ",.0f"), fmt(r["median_step_ms"], ".2f"), fmt(r["peak_memory_mib"], ",.0f"),
                 fmt(r["kernels_per_step"], ".0f"), fmt(r["speedup_vs_v1"], ".2f") + "x", fmt(r["final_loss"], ".4f"))
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def environment() -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["backend"] = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return info


def plot(rows: list[dict], path: Path) -> str:
    plt = load_pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    configs = sorted({(r["batch_size"], r["seq_len"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, len(configs) * 0.6), 4))
    for label in VARIANTS:
        points = {(r["batch_size"], r["seq_len"]): r.get("samples_per_s") for r in rows if r["variant"] == label}
        if points:
            ax.plot(range(len(configs)), [points.get(c) or float("nan") for c in configs], marker="o", label=label)
    ax.set_xticks(range(len(configs)), [f"b{b}\ns{s}" for b, s in configs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def save(results: dict, path: str | None, note: str | None) -> None:
    """Write the results JSON; during a run, after every variant, so a run cut short still leaves its rows."""
    if not path:
        return
    if note:
        results["note"] = note
    else:
        results.pop("note", None)
    write_json(path, results)


def gpu_present(requested: str) -> bool:
    if requested == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def apply_machine_defaults(args) -> None:
    """The seed configuration on a GPU; a quick small-model look without one (see CPU_MODEL_FLAGS)."""
    on_gpu = gpu_present(args.device)
    model_flags_given = any(flag in args.extra for flag in CPU_MODEL_FLAGS[::2])
    args.machine_note = None   # printed by main once the arguments are checked
    if not on_gpu and not model_flags_given:
        args.extra = [*CPU_MODEL_FLAGS, *args.extra]
        args.machine_note = ("no GPU: comparing a small model on the CPU (Triton versions run in the interpreter, "
                             "slowly); the seed configuration needs a GPU")
    if args.batch_size is None:
        args.batch_size = 8 if on_gpu else CPU_BATCH
    if args.seq_len is None:
        args.seq_len = 128 if on_gpu else CPU_SEQ_LEN
    if args.variants is None:
        args.variants = ",".join(v for v in VARIANTS if on_gpu or v != "v2+compile")


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Benchmark TinyLlama versions 1-4 at one configuration.")
    parser.add_argument("--variants", help=f"subset of {','.join(VARIANTS)} [all; without a GPU: all but v2+compile]")
    parser.add_argument("--batch-size", type=int, help="[8; without a GPU: 2, with a small model]")
    parser.add_argument("--seq-len", type=int, help="[128; without a GPU: 32]")
    parser.add_argument("--sweep", action="store_true",
                        help=f"batch sizes {SWEEP_BATCHES} x seq lens {SWEEP_SEQ_LENS} instead of one configuration")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the profiled window (no kernels/step column)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every variant this many times, in interleaved rounds; report the median run [1]")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    parser.add_argument("--output", help="write the results JSON here (rewritten after every run)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the successful runs already in --output and run only the missing ones")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("extra", nargs="*", help="flags passed to every run, after --")
    args = parser.parse_args(argv)
    apply_machine_defaults(args)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.warmup_steps >= args.num_steps:
        parser.error("--warmup-steps must be smaller than --num-steps")
    if args.resume and not args.output:
        parser.error("--resume needs --output: the results file to continue")
    return args


# The settings a resumed run must share with the file it continues, or its rows would not be comparable.
RESUME_KEYS = ("dtype", "num_steps", "warmup_steps", "repeats")


def earlier_rows(args, parser_error) -> tuple[list, list]:
    """(successful rows, commands) of the results file that --resume continues; nothing if it does not exist."""
    path = Path(args.output)
    if not path.exists():
        print(f"--resume: {path} does not exist yet; starting from scratch", flush=True)
        return [], []
    try:
        earlier = json.loads(path.read_text())
        earlier.setdefault("repeats", 1)   # files written before --repeats existed
        mismatched = [k for k in RESUME_KEYS if earlier[k] != getattr(args, k)]
        rows = [r for r in earlier.get("runs", earlier["rows"]) if "error" not in r]
        commands = [earlier["command"], *earlier.get("resumed_by", [])]
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser_error(f"--resume: cannot read {path} as compare_versions results ({error})")
    if mismatched:
        parser_error(f"--resume: {path} was measured with other " + ", ".join(
            f"{k} ({earlier[k]} there, {getattr(args, k)} here)" for k in mismatched))
    return rows, commands


def fail(message: str) -> None:
    print(f"compare_versions.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def median_runs(runs: list[dict]) -> list[dict]:
    """One row per (variant, batch, seq): its run with the median samples/s, carrying every run's samples/s.

    A failed run makes the row failed: a variant that fails one time in three is not measured."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["batch_size"], run["seq_len"]), []).append(run)
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


def training_flags(args, batch: int, seq: int) -> list[str]:
    """The flags of a variant's run that decide its sizes and precision (run_variant adds the rest)."""
    flags = ["--batch-size", str(batch), "--seq-len", str(seq), "--max-seq-len", str(max(seq, 128)),
             "--device", args.device]
    if args.dtype == "bfloat16":
        flags += ["--use-amp", "--amp-dtype", "bfloat16"]
    return flags + list(args.extra)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configs = ([(b, s) for s in SWEEP_SEQ_LENS for b in SWEEP_BATCHES] if args.sweep
               else [(args.batch_size, args.seq_len)])
    problem = triton_shape_problem([(f"batch {b}, seq {s}", VARIANTS[label][0], training_flags(args, b, s))
                                    for b, s in configs for label in args.variants])
    if problem:
        fail(problem)
    if args.machine_note:
        print(args.machine_note, flush=True)
    command = shlex.join(["python", "benchmarks/compare_versions.py", *(sys.argv[1:] if argv is None else argv)])
    runs, commands = earlier_rows(args, fail) if args.resume else ([], [])
    results = {"command": commands[0] if commands else command, "environment": environment(),
               "dtype": args.dtype, "num_steps": args.num_steps, "warmup_steps": args.warmup_steps,
               "repeats": args.repeats, "rows": rows_of(runs, args.repeats)}
    if args.repeats > 1:
        results["runs"] = runs   # every single run (the list grows below), beside the median rows
    if commands:
        results["resumed_by"] = [*commands[1:], command]
    done = {(r["variant"], r["batch_size"], r["seq_len"], r.get("repeat", 0)) for r in runs}
    # Round by round: every variant once, then every variant again (see "Why --repeats").
    todo = [(b, s, label, repeat) for b, s in configs for repeat in range(args.repeats) for label in args.variants
            if (label, b, s, repeat) not in done]
    total = len(runs) + len(todo)
    if done:
        print(f"--resume: {len(runs)} run(s) kept from {args.output}, {len(todo)} to go", flush=True)

    try:
        with tempfile.TemporaryDirectory() as scratch:
            for batch, seq, label, repeat in todo:
                run = run_variant(label, args, batch, seq, Path(scratch))
                run["repeat"] = repeat
                status = run.get("error") or f"{run['samples_per_s']:,.0f} samples/s"
                round_text = f" (round {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                print(f"  {label:<11} b{batch:<3} s{seq:<5} {status}{round_text}", flush=True)
                runs.append(run)
                results["rows"] = rows_of(runs, args.repeats)
                save(results, args.output, note=f"partial: {len(runs)} of {total} runs")
    except KeyboardInterrupt:
        where = f"; the {len(runs)} finished run(s) are in {args.output} (add --resume to finish)" if args.output else ""
        print(f"\ninterrupted after {len(runs)} of {total} runs{where}", file=sys.stderr)
        return 130
    rows = rows_of(runs, args.repeats)
    order = {key: i for i, key in enumerate((b, s, label) for b, s in configs for label in args.variants)}
    rows.sort(key=lambda r: order.get((r["batch_size"], r["seq_len"], r["variant"]), len(order)))
    results["rows"] = rows
    add_speedups(rows)
    problems = check_agreement(rows, args.dtype)
    print()
    print(table(rows))
    if args.repeats > 1:
        print(f"each row: the median of {args.repeats} runs (samples/s of every run in the JSON)")
    print("loss agreement with v1: " + ("ok" if not problems else "PROBLEMS"))
    for problem in problems:
        print(f"  {problem}")
    results["loss_agreement_problems"] = problems
    save(results, args.output, note=None)
    if args.output:
        print(f"results: {args.output}")
    if args.plot:
        print(plot(rows, Path(args.plot)))
    failed = any("error" in r for r in rows)
    return 1 if (failed or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
