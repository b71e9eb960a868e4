"""Weak scaling: the same per-GPU batch on 1, 2, ..., N GPUs, for each version and size preset.

    python benchmarks/scaling.py --max-gpus 2                                  (v1-v4 x tiny, medium; 1, 2 GPUs)
    python benchmarks/scaling.py --versions v1 v4 --presets medium --gpus 1 2 4 8 --num-steps 60
    python benchmarks/scaling.py --engine deepspeed --zero-stage 1 --presets medium --max-gpus 2
    python benchmarks/scaling.py --versions v4 --presets small medium --dtype bfloat16 --gpus 1 --with-single-process
    python benchmarks/scaling.py --versions v4 --presets medium --dtype bfloat16 --gpus 1 2 --repeats 3
    python benchmarks/scaling.py --device cpu --versions v1 --presets tiny --max-gpus 2 \\
        -- --hidden-dim 32 --num-heads 2 --num-layers 1 --intermediate-size 64 --seq-len 16   (CPU smoke test, gloo)

Weak scaling keeps the work of each GPU fixed (--batch-size is per rank) and grows the global batch with the GPU
count. Perfectly, N GPUs process N times the samples per second of one: the efficiency column is
samples/s(N) / (N x samples/s(1)). What is lost is mostly the gradient all-reduce (about parameters x 4 bytes per
step) that the backward pass could not hide; see README, "Scaling out". The 1-GPU point also runs under torchrun,
with DDP around the model (version 4's graph-captured step: its own all-reduces instead), so every point pays the
same communication path. --with-single-process adds a plain process (no torchrun, no process group) for each
version and preset as the reference of the speed-up and efficiency columns: the 1-GPU torchrun point's
efficiency then shows what the data-parallel path itself costs on one GPU.

Each point is a fresh `torchrun --standalone --nproc-per-node N` process (a free port each time), started exactly
as a user would start it; its rank 0 writes --output-json, which is collected here. Results: a JSON file (with
the machine and every command), a markdown table, and a PNG plot when matplotlib is installed. --repeats N runs the
whole list of points N times, interleaved (1 GPU, 2 GPUs, 1 GPU, 2 GPUs, ...: a machine that drifts moves every
point alike), and each row is the point's median run, with every run's samples/s kept beside it.
"""
from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from scaling_table import gpus_cell
from table_format import NO_MATPLOTLIB, fmt, markdown_header, markdown_row, percent
from training_runs import REPO_ROOT, SCRIPTS, checked_preset, run_training, triton_shape_problem

sys.path.insert(0, str(REPO_ROOT))  # the shared harness: result files and plots

from tinytransformer.cli import HelpFormatter, OneLineParser, non_negative_int, positive_int  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.outputs import load_pyplot, write_json  # noqa: E402
from tinytransformer.paths import prove_output_dir  # noqa: E402

EXIT_BAD_INPUT = 2


def torchrun_command(version: str, preset: str, gpus: int, json_path: Path, args) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               str(REPO_ROOT / SCRIPTS[version]), "--preset", preset, "--device", args.device,
               "--num-steps", str(args.num_steps), "--warmup-steps", str(args.warmup_steps),
               "--log-every", str(args.num_steps), "--output-json", str(json_path)]
    if args.dtype == "bfloat16":
        command += ["--use-amp", "--amp-dtype", "bfloat16"]
    if args.engine == "deepspeed":
        command += ["--deepspeed", "--zero-stage", str(args.zero_stage)]
    return command + args.extra


def run_point(version: str, preset: str, gpus: int, args, out_dir: Path, launcher: str = "torchrun") -> dict:
    """One training run on `gpus` processes (launcher "torchrun"), or one plain process (launcher "none": gpus
    must be 1); its metrics, or the last line of its error."""
    json_path = out_dir / (f"{version}_{preset}_{gpus}gpu.json" if launcher == "torchrun"
                           else f"{version}_{preset}_single_process.json")
    command = torchrun_command(version, preset, gpus, json_path, args)
    if launcher == "none":
        command = [sys.executable] + command[6:]   # the script and its flags, without the launcher's six words
    env = dict(os.environ)
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"   # versions 3 and 4 run their Triton kernels in the interpreter on a CPU
    shown = ["torchrun"] + command[3:] if launcher == "torchrun" else ["python"] + command[1:]
    row = {"version": version, "preset": preset, "gpus": gpus, "launcher": launcher, "command": shlex.join(shown)}
    outcome = run_training(command, json_path, args.timeout, env=env, cwd=REPO_ROOT)
    if outcome.wall_s is not None:
        row["wall_s"] = round(outcome.wall_s, 1)
    if outcome.error:
        row["error"] = outcome.error
        return row
    metrics = outcome.metrics
    row.update({
        "global_batch_size": metrics["distributed"]["global_batch_size"],
        "batch_size_per_gpu": metrics["distributed"]["batch_size_per_rank"],
        "parameters": metrics["parameters"],
        "samples_per_s": metrics["throughput"]["samples_per_s"],
        "tokens_per_s": metrics["throughput"]["tokens_per_s"],
        "median_step_ms": metrics["timing"]["median_ms"],
        "mfu": metrics["throughput"]["mfu"],
        "peak_memory_mib_per_gpu": metrics["memory"]["peak_allocated_mib"],
        "final_loss": metrics["loss"]["final"],
        "device": metrics["device"]["name"],
        "gradients_averaged_by": metrics["distributed"].get("gradients_averaged_by"),   # ddp, step (v4's graph)
    })
    return row


def median_run(runs: list[dict]) -> dict:
    """The run whose samples/s is the median of the repeats (the lower middle for an even count; a failed run
    counts as slowest), with every repeat's samples/s under "repeats_samples_per_s"."""
    speeds = [run.get("samples_per_s") for run in runs]
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda run: run.get("samples_per_s") or 0.0)
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["repeats_samples_per_s"] = speeds
    return row


def add_efficiency(rows: list[dict]) -> None:
    """Speed-up over the 1-GPU point of the same version and preset, and weak-scaling efficiency. The reference
    is the plain single process where there is one (--with-single-process), else the 1-GPU torchrun point."""
    single = {}
    for r in sorted(rows, key=lambda r: r.get("launcher") == "none"):   # a plain process overrides torchrun
        if r["gpus"] == 1:
            single[(r["version"], r["preset"])] = r.get("samples_per_s")
    for row in rows:
        base = single.get((row["version"], row["preset"]))
        if base and row.get("samples_per_s"):
            row["speedup"] = row["samples_per_s"] / base
            row["efficiency"] = row["speedup"] / row["gpus"]
        else:
            row["speedup"] = row["efficiency"] = None


def table(rows: list[dict]) -> str:
    header = ("version", "preset", "GPUs", "global batch", "samples/s", "step ms", "speed-up", "efficiency",
              "MFU", "MiB/GPU")
    lines = markdown_header(header)
    for r in rows:
        gpus = gpus_cell(r)
        if "error" in r:
            lines.append(f"| {r['version']} | {r['preset']} | {gpus} | failed: {r['error']} |")
            continue
        cells = (r["version"], r["preset"], gpus, str(r["global_batch_size"]),
                 fmt(r["samples_per_s"], ",.0f"), fmt(r["median_step_ms"], ".2f"), fmt(r["speedup"], ".2f", "x"),
                 percent(r["efficiency"]), percent(r["mfu"]), fmt(r["peak_memory_mib_per_gpu"], ",.0f"))
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str:
    plt = load_pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    series = sorted({(r["version"], r["preset"]) for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for version, preset in series:
        points = sorted((r["gpus"], r["efficiency"]) for r in rows
                        if (r["version"], r["preset"]) == (version, preset) and r.get("efficiency")
                        and r.get("launcher") != "none")
        if points:
            ax.plot([g for g, _ in points], [100 * e for _, e in points], marker="o", label=f"{version} {preset}")
    ax.axhline(100, color="gray", linestyle="--", linewidth=1, label="perfect")
    ax.set_xlabel("GPUs (processes)")
    ax.set_ylabel("weak-scaling efficiency (%)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def environment(device: str) -> dict:
    import torch
    from tinytransformer.device import software_and_gpu
    info = {**software_and_gpu(on_gpu=device != "cpu"), "host": platform.node(), "device": device}
    if "gpu" in info:
        info["gpus_visible"] = torch.cuda.device_count()
        from tinytransformer.distributed import nccl_high_priority   # imports torch's distributed package
        info["nccl_high_priority_stream"] = nccl_high_priority()   # distributed.nccl_options (absent: before it)
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_IB_DISABLE",
                 "NCCL_SOCKET_IFNAME", "TORCH_NCCL_HIGH_PRIORITY"):
        if name in os.environ:
            info.setdefault("environment", {})[name] = os.environ[name]
    return info


def parse_args(argv):
    parser = OneLineParser(
        prog="scaling.py", formatter_class=HelpFormatter, description="Weak scaling of TinyLlama versions over 1..N GPUs (torchrun, one process per GPU).",
        epilog="Flags after -- go to every training run (e.g. -- --batch-size 32).")
    parser.add_argument("--versions", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"], help="size presets from configs/")
    parser.add_argument("--gpus", nargs="+", type=positive_int, help="process counts to run (default 1..--max-gpus)")
    parser.add_argument("--max-gpus", type=positive_int, help="run 1, 2, ..., this many processes [all visible GPUs]")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: gloo between CPU processes, a smoke test on a machine without GPUs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--engine", choices=["ddp", "deepspeed"], default="ddp")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0, help="with --engine deepspeed")
    parser.add_argument("--num-steps", type=positive_int, default=40)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--with-single-process", action="store_true",
                        help="also run each version and preset as one plain process (no torchrun), the reference "
                             "of the speed-up and efficiency columns")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="run every point this many times, interleaved; each row is its median run")
    parser.add_argument("--timeout", type=positive_int, default=1200, help="seconds allowed per run")
    parser.add_argument("--output-dir", help="where the JSON, table and plot go [benchmarks/results/scaling_TIME]")
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    if args.warmup_steps >= args.num_steps:
        parser.error("--warmup-steps must be smaller than --num-steps")
    try:   # every preset known and the output directory writable before the first (long) run
        for preset in args.presets:
            checked_preset(preset)   # its values too, as a training script would check them
        if args.output_dir:
            prove_output_dir(args.output_dir, "--output-dir")
    except ConfigError as problem:
        parser.error(str(problem))
    args.gpus = sorted(set(args.gpus or range(1, (args.max_gpus or visible_gpus(args.device)) + 1)))
    if not args.gpus:   # --max-gpus left out on a machine without GPUs
        parser.error("no process count to run: no GPU visible (use --device cpu for a CPU smoke test)")
    if args.device == "cuda" and args.gpus[-1] > visible_gpus("cuda"):
        parser.error(f"{args.gpus[-1]} GPUs requested but {visible_gpus('cuda')} visible (use --device cpu for "
                     f"a CPU smoke test)")
    return args


def visible_gpus(device: str) -> int:
    if device == "cpu":
        return 2   # a smoke test: two CPU processes
    import torch
    return torch.cuda.device_count()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # The batch is per process; the script's flags follow the launcher's six words.
    problem = triton_shape_problem([(f"--presets {preset}", version,
                                     torchrun_command(version, preset, 1, Path("unused.json"), args)[6:])
                                    for version in args.versions for preset in args.presets])
    if problem:
        print(f"scaling.py: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stamp = datetime.now().strftime("%Y%m%d_%H%M%S")
    out_dir = Path(args.output_dir or REPO_ROOT / "benchmarks" / "results" / f"scaling_{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}   # (preset, version, gpus, launcher) -> that point's runs, in the order the table lists them
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(1, args.repeats + 1):
            for preset in args.presets:
                for version in args.versions:
                    points = [(1, "none")] if args.with_single_process else []
                    for gpus, launcher in points + [(gpus, "torchrun") for gpus in args.gpus]:
                        row = run_point(version, preset, gpus, args, Path(scratch), launcher)
                        status = row.get("error") or f"{fmt(row.get('samples_per_s'), ',.0f')} samples/s"
                        where = f"{gpus} GPU(s)" if launcher == "torchrun" else "1 process without torchrun"
                        run_number = f" (run {repeat} of {args.repeats})" if args.repeats > 1 else ""
                        print(f"{version} {preset} {where}{run_number}: {status}", flush=True)
                        runs.setdefault((preset, version, gpus, launcher), []).append(row)
    rows = [median_run(point_runs) for point_runs in runs.values()]
    add_efficiency(rows)
    markdown = table(rows)
    print(markdown)
    command = " ".join(["python", "benchmarks/scaling.py", *map(shlex.quote, sys.argv[1:])])
    result = {"benchmark": "weak scaling", "command": command, "engine": args.engine, "zero_stage": args.zero_stage,
              "with_single_process": args.with_single_process, "dtype": args.dtype, "num_steps": args.num_steps,
              "warmup_steps": args.warmup_steps, "repeats": args.repeats,
              "extra_flags": args.extra, "environment": environment(args.device), "rows": rows}
    write_json(out_dir / "scaling.json", result)
    (out_dir / "scaling.md").write_text(markdown + "\n")
    print(f"results: {out_dir / 'scaling.json'}, {out_dir / 'scaling.md'}")
    print(plot(rows, out_dir / "scaling.png"))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
