"""Fusion ablation: what each of version 2's switches buys, alone and among the others, in one table.

    python fusion_ablation.py                                   (16 runs, eager, seed config)
    python fusion_ablation.py --with-compile --profile          (+ torch.compile, + kernels per step)
    python fusion_ablation.py --num-steps 100 -- --use-amp      (flags after -- go to every run)

The rows: every switch off (version 1's computation), each switch alone, every switch on, and every switch on
but one ("all-rope": what RoPE's rewrite adds to the rest). The switches: the six fusions and TF32 for float32
matmuls on a GPU ("tf32"; under --use-amp the matmuls are bfloat16 and it changes nothing). Each runs
tiny_llama_v2.py in a fresh process (so nothing, e.g. a compile cache, carries over) from the same canonical
weights and data; the table shows median samples/s, the speed-up over "none", peak memory and, with --profile,
GPU kernels per training step.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # the shared harness: flags, path checks, atomic writes

from tinytransformer.cli import HelpFormatter, OneLineParser, non_negative_int, positive_int  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import prove_output_file  # noqa: E402

# (short label, tiny_llama_v2.py's flag that turns the switch on, the flag that turns it off): the fusions'
# --enable-X / --disable-X, and TF32 for float32 matmuls on a GPU (on a CPU both flags compute exact float32).
FUSIONS = (("qkv", "qkv-fusion"), ("flash", "flash-attention"), ("swiglu", "swiglu-fusion"),
           ("rmsnorm", "torch-rmsnorm"), ("rope", "rolled-rope"), ("adamw", "fused-adamw"))
SWITCHES = (*((name, f"--enable-{flag}", f"--disable-{flag}") for name, flag in FUSIONS),
            ("tf32", "--tf32", "--no-tf32"))
COMPILE = ["--enable-torch-compile", "--torch-compile-mode", "reduce-overhead"]


def flags_for(enabled: set) -> list:
    return [on if name in enabled else off for name, on, off in SWITCHES]


def combinations(with_compile: bool):
    """(label, flags): none first, then each switch alone, all, all but each; optionally the compiled runs."""
    names = [name for name, _, _ in SWITCHES]
    runs = [("none", flags_for(set()))]
    runs += [(name, flags_for({name})) for name in names]
    runs.append(("all", flags_for(set(names))))
    runs += [(f"all-{name}", flags_for(set(names) - {name})) for name in names]
    if with_compile:
        runs.append(("all+compile", [*flags_for(set(names)), *COMPILE]))
        runs.append(("all+compile+opt", [*flags_for(set(names)), *COMPILE, "--compile-optimizer"]))
    return runs


def run_one(label, flags, args, extra, scratch: Path) -> dict:
    out = scratch / f"{label.replace('+', '_')}.json"
    command = [sys.executable, str(HERE / "tiny_llama_v2.py"), *flags, "--num-steps", str(args.num_steps),
               "--warmup-steps", str(args.warmup_steps), "--log-every", str(args.num_steps),
               "--output-json", str(out), *extra]
    if args.profile:
        command += ["--enable-pytorch-profiler", "--profile-steps", "2", "--profile-dir", str(scratch / label)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return {"label": label, "error": lines[-1] if lines else f"exit code {result.returncode}"}
    metrics = json.loads(out.read_text())
    return {"label": label, "samples_per_s": metrics["throughput"]["samples_per_s"],
            "median_step_ms": metrics["timing"]["median_ms"],
            "peak_memory_mib": metrics["memory"]["peak_allocated_mib"],
            "kernels_per_step": (metrics.get("profile") or {}).get("kernels_per_step"),
            "final_loss": metrics["loss"]["final"], "device": metrics["device"]["name"]}


def print_table(rows) -> None:
    baseline = next((r.get("samples_per_s") for r in rows if r["label"] == "none"), None)
    fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "n/a"  # noqa: E731
    print(f"{'fusions':<18} {'samples/s':>10} {'ms/step':>8} {'vs none':>8} {'peak MiB':>9} {'kernels':>8} "
          f"{'final loss':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<18} failed: {r['error']}")
            continue
        speedup = r["samples_per_s"] / baseline if baseline else None
        print(f"{r['label']:<18} {fmt(r['samples_per_s'], ',.1f'):>10} {fmt(r['median_step_ms'], '.2f'):>8} "
              f"{fmt(speedup, '.2f'):>7}x {fmt(r['peak_memory_mib'], ',.0f'):>9} "
              f"{fmt(r['kernels_per_step'], '.0f'):>8} {fmt(r['final_loss'], '.4f'):>10}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(prog="fusion_ablation.py", formatter_class=HelpFormatter,
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-steps", type=positive_int, default=40)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--with-compile", action="store_true",
                        help="add all switches + torch.compile (reduce-overhead), and + a compiled optimizer step")
    parser.add_argument("--profile", action="store_true", help="also count GPU kernels per step")
    parser.add_argument("--output-json", help="write the table's rows here")
    args = parser.parse_args(own)
    if args.warmup_steps >= args.num_steps:
        parser.error("--warmup-steps must be smaller than --num-steps")
    if args.output_json:
        try:   # before eight training runs, not after them
            prove_output_file(args.output_json, "--output-json")
        except ConfigError as problem:
            parser.error(str(problem))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, flags in combinations(args.with_compile):
            row = run_one(label, flags, args, extra, Path(scratch))
            rows.append(row)
            status = row.get("error") or f"{row['samples_per_s']:,.1f} samples/s, {row['median_step_ms']:.2f} ms/step"
            print(f"  {label:<18} {status}", flush=True)
    print_table(rows)
    if args.output_json:
        write_json(args.output_json, {"command": " ".join(["python", "fusion_ablation.py", *argv]), "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
