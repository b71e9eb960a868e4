"""Kernels per training step, and GPU time per kernel family, for versions 1-4 side by side.

Each version is profiled in a fresh process (so one version's global settings, such as version 4's TF32 switch,
cannot leak into another) with the PyTorch profiler, at the same configuration. The traces are then analysed
with tinytransformer.profiling, so the kernel counts quoted in the docs are measured, not asserted.

    python run_ultra_profiling.py                        (seed config, float32, all four versions)
    python run_ultra_profiling.py --use-amp --versions v2,v4 --output-dir ultra_profiles
    python run_ultra_profiling.py --analyze-only ultra_profiles     (re-analyse traces already recorded)

Any training flag after `--` is passed to every version (e.g. `-- --batch-size 32 --seq-len 512`).
"""
import argparse
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import ensure_directory  # noqa: E402
from tinytransformer.profiling import analysis  # noqa: E402
# The kernel families (by kernel name) are the profiler reports' own: every version is grouped the same way.
from tinytransformer.profiling.kernel_names import FAMILY_NAMES, family_of  # noqa: E402
from tinytransformer.profiling.trace import TraceError, load_trace  # noqa: E402

SCRIPTS = {
    "v1": REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py",
    "v2": REPO_ROOT / "version2_pytorch_fused" / "tiny_llama_v2.py",
    "v3": REPO_ROOT / "version3_triton" / "tiny_llama_v3.py",
    "v4": REPO_ROOT / "version4_triton_ultra" / "tiny_llama_v4.py",
}

def profile_version(version: str, out_dir: Path, train_flags: list[str]) -> Path:
    profile_dir = out_dir / version
    command = [sys.executable, str(SCRIPTS[version]), "--enable-pytorch-profiler", "--profile-dir",
               str(profile_dir), "--num-steps", "12", "--profile-steps", "3", "--log-every", "100", *train_flags]
    print(f"[{version}] {' '.join(command)}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    (out_dir / f"{version}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{version} failed (exit {result.returncode}): {last}")
    return profile_dir / f"trace_{version}.json"


def analyse(trace_path: Path) -> dict:
    trace = load_trace(trace_path)
    steps = max(1, len(analysis.profiler_steps(trace)))
    per_family = defaultdict(float)
    for kernel in analysis.device_kernels(trace, include_memory_ops=True):
        if kernel["step"] is not None:
            per_family[family_of(kernel["name"])] += kernel["dur_us"] / steps
    return {"kernels_per_step": analysis.kernels_per_step(trace),
            "step_wall_us": analysis.summarize(trace)["step_us_mean"],   # host view, profiler overhead included
            "device_us_per_step": sum(per_family.values()),
            "family_us_per_step": dict(per_family)}


def print_table(results: dict) -> None:
    families = [f for f in FAMILY_NAMES if any(r["family_us_per_step"].get(f) for r in results.values())]
    header = ["version", "kernels/step", "step wall us", "GPU us/step"] + families
    rows = [header]
    for version, r in results.items():
        kps = r["kernels_per_step"]
        wall = r["step_wall_us"]
        rows.append([version, f"{kps:.0f}" if kps is not None else "n/a", f"{wall:.0f}" if wall else "n/a",
                     f"{r['device_us_per_step']:.0f}"]
                    + [f"{r['family_us_per_step'].get(f, 0.0):.0f}" for f in families])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("(per training step, from the profiled steps: wall time as the host saw it, profiler overhead included;"
          " GPU time per kernel family in microseconds)")


def shape_problem(versions: list[str], train_flags: list[str]) -> str | None:
    """Sizes that a Triton version's kernels cannot take (tiny_llama_v3/v4.shape_problem_of_flags), or training
    flags it refuses: found before the first version runs, rather than after the versions before it."""
    from tinytransformer.equivalence import load_version
    for version in versions:
        module = load_version(version)
        if hasattr(module, "shape_problem_of_flags"):
            try:
                problem = module.shape_problem_of_flags(train_flags)
            except ConfigError as error:
                problem = f"{version}: {error}"
            if problem:
                return problem
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default="v1,v2,v3,v4", help="comma-separated subset of v1,v2,v3,v4")
    parser.add_argument("--output-dir", default="ultra_profiles", help="traces, logs and results.json go here")
    parser.add_argument("--use-amp", action="store_true", help="bfloat16 autocast for every version")
    parser.add_argument("--analyze-only", metavar="DIR", help="analyse the traces in DIR, record nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    unknown = [v for v in versions if v not in SCRIPTS]
    if unknown:
        parser.exit(2, f"{parser.prog}: error: unknown version(s) {', '.join(unknown)}; use v1,v2,v3,v4\n")
    if args.use_amp:
        train_flags = ["--use-amp", "--amp-dtype", "bfloat16", *train_flags]
    if not args.analyze_only:
        problem = shape_problem(versions, train_flags)
        if problem:
            parser.exit(2, f"{parser.prog}: error: {problem}\n")
    if args.analyze_only:
        out_dir = Path(args.analyze_only)
        if not out_dir.is_dir():
            parser.exit(2, f"{parser.prog}: error: --analyze-only {out_dir}: no such directory\n")
    else:
        try:   # proven writable before the first version is profiled, not after
            out_dir = ensure_directory(args.output_dir, "--output-dir")
        except ConfigError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    results = {}
    for version in versions:
        trace = out_dir / version / f"trace_{version}.json"
        try:
            if not args.analyze_only:
                trace = profile_version(version, out_dir, train_flags)
            results[version] = analyse(trace)
        except (RuntimeError, TraceError) as error:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 1 if not args.analyze_only else 2
    write_json(out_dir / "results.json", results)
    print_table(results)
    print(f"results: {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
