"""Cross-version benchmark: every version at one configuration, one table, one JSON.

    python benchmarks/compare_versions.py                          (small and fast: seed config, 30 steps)
    python benchmarks/compare_versions.py --num-steps 200 --dtype bfloat16 --output results.json
    python benchmarks/compare_versions.py --sweep --num-steps 60   (batch {4,8,16,32} x seq {128,...,1024})
    python benchmarks/compare_versions.py --sweep --num-steps 60 --output sweep.json --resume
                                                                   (finish a sweep that was cut short)
    python benchmarks/compare_versions.py --num-steps 200 --repeats 3   (each variant 3 times, interleaved)
    python benchmarks/compare_versions.py --preset medium --repeats 3   (a size preset's own batch and sequence
                                                                   length, bfloat16 unless --dtype says otherwise)

The rows: every version, version 2 compiled, and the peers, the models people train instead of ours: Hugging
Face's LlamaForCausalLM (hf), compiled (hf+compile), with Liger-Kernel's Triton kernels (hf+liger), both
(hf+liger+compile); see benchmarks/variants.py. A peer needs `pip install -r requirements-peers.txt`; a row that
cannot run says why in one line and the benchmark goes on. A peer whose first loss is not version 1's is refused.

Why fresh processes: each variant runs its own training script in a new Python process, exactly as a workshop
attendee runs it. Nothing leaks between variants (version 4's TF32 switch, torch.compile caches, the CUDA
caching allocator's pools), and the first variant does not pay everyone's warm-up.

Why they can be compared: every version (and peer) initialises from the same canonical weights for the same --seed and
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

Why one cuBLAS setting for every row: version 4's training script runs cuBLAS without a workspace, which spares
a memset before each of many Hopper GEMMs (tinytransformer/cublas_workspace.py). Any script can have that through
an environment variable, so with --cublas-workspace none (the default) every run gets it, exported here; with
default every run keeps cuBLAS's own workspace (version 4's rows are told so). The JSON records which.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from comparison_rows import (add_speedups, check_agreement, config_label, config_of, plot, rows_of, run_variant,
                             size_flags, table, was_profiled)
from result_formats import read_comparison
from training_runs import REPO_ROOT, checked_preset, triton_shape_problem
from variants import VARIANTS, default_variants

sys.path.insert(0, str(REPO_ROOT))  # the shared harness: result files and presets

from tinytransformer.cli import OneLineParser, non_negative_int, positive_int, seed_int  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.cublas_workspace import CHOICES as CUBLAS_WORKSPACE_CHOICES  # noqa: E402
from tinytransformer.cublas_workspace import VARIABLE as CUBLAS_WORKSPACE_VARIABLE  # noqa: E402
from tinytransformer.cublas_workspace import without_workspace  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import prove_outputs  # noqa: E402

SWEEP_BATCHES = (4, 8, 16, 32)
SWEEP_SEQ_LENS = (128, 256, 512, 1024)
# Without a GPU (a laptop, CI), the default is a quick look rather than a measurement: a small model, short
# sequences, and no torch.compile (which spends about a minute compiling on a CPU). Triton kernels run in the
# interpreter there, so versions 3 and 4 are much SLOWER than 1 and 2 on a CPU: the speeds say nothing about GPUs.
CPU_MODEL_FLAGS = ["--hidden-dim", "64", "--num-heads", "2", "--num-layers", "2", "--intermediate-size", "128",
                   "--vocab-size", "256"]
CPU_BATCH, CPU_SEQ_LEN = 2, 32


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


def preset_configs(args, error) -> list[tuple]:
    """--preset NAME[,NAME...]: each preset's model, batch and sequence length (the scripts read the preset
    themselves; batch and sequence length are passed too, so every row names them), bfloat16 unless --dtype says
    otherwise. Presets run one after the other: every variant and repeat of the first, then the next."""
    if args.sweep or args.batch_size or args.seq_len:
        error("--preset sets the batch size and sequence length itself; drop --sweep / --batch-size / --seq-len")
    configs = []
    for name in [n.strip() for n in args.preset.split(",") if n.strip()]:
        try:
            _, train = checked_preset(name)
        except ConfigError as problem:
            error(str(problem))
        configs.append((name, train.batch_size, train.seq_len))
    if not configs:
        error("--preset names no preset")
    args.dtype = args.dtype or "bfloat16"
    return configs


def apply_machine_defaults(args) -> None:
    """The seed configuration on a GPU; a quick small-model look without one (see CPU_MODEL_FLAGS)."""
    on_gpu = gpu_present(args.device)
    model_flags_given = args.preset or any(flag in args.extra for flag in CPU_MODEL_FLAGS[::2])
    args.machine_note = None   # printed by main once the arguments are checked
    if not on_gpu and not model_flags_given:
        args.extra = [*CPU_MODEL_FLAGS, *args.extra]
        args.machine_note = ("no GPU: comparing a small model on the CPU (Triton versions run in the interpreter, "
                             "slowly); the seed configuration needs a GPU")
    args.dtype = args.dtype or "float32"
    if args.batch_size is None:
        args.batch_size = 8 if on_gpu else CPU_BATCH
    if args.seq_len is None:
        args.seq_len = 128 if on_gpu else CPU_SEQ_LEN
    if args.variants is None:
        args.variants = ",".join(default_variants(on_gpu))


def parse_args(argv):
    parser = OneLineParser(prog="compare_versions.py",
                           description="Benchmark TinyLlama versions 1-4 and their peers at one configuration.")
    parser.add_argument("--variants", help=f"subset of {','.join(VARIANTS)} [all but v2+max-autotune; without a "
                                           "GPU also none that compiles and no Liger-Kernel]")
    parser.add_argument("--preset", help="size presets from configs/, comma-separated (tiny,small,medium,large): "
                                         "each one's model, batch and sequence length, bfloat16 by default")
    parser.add_argument("--batch-size", type=positive_int, help="[8; without a GPU: 2, with a small model]")
    parser.add_argument("--seq-len", type=positive_int, help="[128; without a GPU: 32]")
    parser.add_argument("--sweep", action="store_true",
                        help=f"batch sizes {SWEEP_BATCHES} x seq lens {SWEEP_SEQ_LENS} instead of one configuration")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="[float32; with --preset: bfloat16]")
    parser.add_argument("--num-steps", type=positive_int, default=30)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10)
    parser.add_argument("--seed", type=seed_int, default=42)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the profiled window (no kernels/step column)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="run every variant this many times, in interleaved rounds; report the median run [1]")
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per run")
    parser.add_argument("--output", help="write the results JSON here (rewritten after every run)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the successful runs already in --output and run only the missing ones")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--cublas-workspace", choices=CUBLAS_WORKSPACE_CHOICES, default="none",
                        help="the cuBLAS workspace of every row, one setting for all (see 'Why one cuBLAS setting'): "
                             "none, the default (no memset before each GEMM), or cuBLAS's default")
    parser.add_argument("extra", nargs="*", help="flags passed to every run, after --")
    args = parser.parse_args(argv)
    args.configs = preset_configs(args, parser.error) if args.preset else None
    apply_machine_defaults(args)
    if args.configs is None:
        args.configs = ([(None, b, s) for s in SWEEP_SEQ_LENS for b in SWEEP_BATCHES] if args.sweep
                        else [(None, args.batch_size, args.seq_len)])
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}")
    if not args.variants:
        parser.error("--variants names no variant: nothing to run")
    if args.warmup_steps >= args.num_steps:
        parser.error("--warmup-steps must be smaller than --num-steps")
    if args.resume and not args.output:
        parser.error("--resume needs --output: the results file to continue")
    try:   # before the first run, not after the last one
        prove_outputs(("--output", args.output, "file"), ("--plot", args.plot, "file"))
    except ConfigError as problem:
        parser.error(str(problem))
    return args


# The settings a resumed run must share with the file it continues, or its rows would not be comparable.
RESUME_KEYS = ("preset", "dtype", "num_steps", "warmup_steps", "repeats", "profile", "cublas_workspace_config")


def earlier_rows(args, parser_error) -> tuple[list, list]:
    """(successful rows, commands) of the results file that --resume continues; nothing if it does not exist."""
    path = Path(args.output)
    if not path.exists():
        print(f"--resume: {path} does not exist yet; starting from scratch", flush=True)
        return [], []
    try:   # every field read below is checked here: the file's type and range problems are this one line
        earlier = read_comparison(path, need_rows=False)
    except ConfigError as error:
        parser_error(f"--resume: {error}")
    earlier.setdefault("repeats", 1)   # files written before --repeats existed
    earlier.setdefault("preset", None)   # ... and before --preset
    earlier.setdefault("cublas_workspace_config", None)   # ... and before --cublas-workspace (cuBLAS's default)
    # ... and before the file said whether its runs had the profiled window (which is not timed)
    earlier["profile"] = was_profiled(earlier)
    mismatched = [k for k in RESUME_KEYS if earlier[k] != getattr(args, k)]
    rows = [r for r in earlier.get("runs", earlier["rows"]) if "error" not in r]
    commands = [earlier["command"], *earlier.get("resumed_by", [])]
    if mismatched:
        parser_error(f"--resume: {path} was measured with other " + ", ".join(
            f"{k} ({earlier[k]} there, {getattr(args, k)} here)" for k in mismatched))
    return rows, commands


def fail(message: str) -> None:
    print(f"compare_versions.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configs = args.configs
    problem = triton_shape_problem([(config_label(c), VARIANTS[label][0], size_flags(args, c))
                                    for c in configs for label in args.variants])
    if problem:
        fail(problem)
    if args.machine_note:
        print(args.machine_note, flush=True)
    command = shlex.join(["python", "benchmarks/compare_versions.py", *(sys.argv[1:] if argv is None else argv)])
    if args.cublas_workspace == "none":
        without_workspace()   # exported to every run (this process runs no GEMM itself)
    # What every run's cuBLAS gets (None: its default workspace), which a resumed run must share.
    args.cublas_workspace_config = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
    runs, commands = earlier_rows(args, fail) if args.resume else ([], [])
    from tinytransformer.device import software_and_gpu   # imports torch: only once the flags are checked
    results = {"command": commands[0] if commands else command, "environment": software_and_gpu(),
               "preset": args.preset, "dtype": args.dtype, "num_steps": args.num_steps,
               "warmup_steps": args.warmup_steps, "repeats": args.repeats, "profile": args.profile,
               "cublas_workspace": args.cublas_workspace,
               "cublas_workspace_config": args.cublas_workspace_config,
               "rows": rows_of(runs, args.repeats)}
    if args.repeats > 1:
        results["runs"] = runs   # every single run (the list grows below), beside the median rows
    if commands:
        results["resumed_by"] = [*commands[1:], command]
    done = {(r["variant"], config_of(r), r.get("repeat", 0)) for r in runs}
    # Round by round: every variant once, then every variant again (see "Why --repeats").
    todo = [(c, label, repeat) for c in configs for repeat in range(args.repeats) for label in args.variants
            if (label, c, repeat) not in done]
    total = len(runs) + len(todo)
    if done:
        print(f"--resume: {len(runs)} run(s) kept from {args.output}, {len(todo)} to go", flush=True)

    try:
        with tempfile.TemporaryDirectory() as scratch:
            for config, label, repeat in todo:
                run = run_variant(label, args, config, Path(scratch))
                run["repeat"] = repeat
                status = run.get("error") or f"{run['samples_per_s']:,.0f} samples/s"
                round_text = f" (round {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                print(f"  {label:<16} {config_label(config):<18} {status}{round_text}", flush=True)
                runs.append(run)
                results["rows"] = rows_of(runs, args.repeats)
                save(results, args.output, note=f"partial: {len(runs)} of {total} runs")
    except KeyboardInterrupt:
        where = f"; the {len(runs)} finished run(s) are in {args.output} (add --resume to finish)" if args.output else ""
        print(f"\ninterrupted after {len(runs)} of {total} runs{where}", file=sys.stderr)
        return 130
    rows = rows_of(runs, args.repeats)
    order = {key: i for i, key in enumerate((c, label) for c in configs for label in args.variants)}
    rows.sort(key=lambda r: order.get((config_of(r), r["variant"]), len(order)))
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
