"""run_deepspeed_flops.py of every version: FLOPs counted twice, then achieved TFLOP/s and MFU.

    run_deepspeed_flops.py  ->  deepspeed_flops_main(spec, argv)

A version's script imports its `SPEC` (a cli.VersionSpec) and calls deepspeed_flops_main, so every version is
measured by the same code. The model is built exactly as training builds it (the shared Trainer); then
  (a) DeepSpeed's FLOPS profiler counts one forward pass (profiling/deepspeed_flops.py),
  (b) the analytic formulas of tinytransformer/flops.py count the same pass,
  (c) timed training steps turn the count into achieved TFLOP/s and MFU (model FLOPs utilisation),
  (d) on request, the arithmetic intensity of each matrix product of a layer and a roofline plot.
Everything goes into flops_profile.json (and mfu_analysis.csv); the summary (profiling/flops_summary.py) is
printed after the run and again by --analyze-results. Bad input anywhere: one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..cli import (VersionSpec, build_parser, command_line, given_arguments, parse_or_exit_code, positive_int,
                   resolve_configs, run_command)
from ..config import ConfigError
from ..device import describe, peak_bandwidth_tbs, peak_tflops
from ..flops import BYTE_MODEL, analytic_counts, intensity_rows
from ..outputs import write_json
from ..paths import ensure_directory
from ..weights import parameter_count
from .deepspeed_flops import deepspeed_import_problem, profile_forward
from .flops_summary import DEEPSPEED_VS_ANALYTIC, check_flops_profile, compare_parts, flops_summary
from .roofline import write_roofline
from .trace import TraceError

# The training script's PyTorch-profiler flags, which this command accepts (it shares the parser) but does not use:
# it times its steps itself and records no trace (run_pytorch_profiler.py does).
PROFILER_FLAGS = {"enable_pytorch_profiler": "--enable-pytorch-profiler", "profile_memory": "--profile-memory",
                  "profile_dir": "--profile-dir", "profile_operators": "--profile-operators",
                  "sort_by": "--sort-by", "profile_steps": "--profile-steps"}
DEFAULT_FLOPS_WARMUP_STEPS = 5
DEFAULT_TIMING_STEPS = 20
FLOPS_PROFILE_KIND = "flops_profile"


def deepspeed_flops_parser(spec: VersionSpec) -> argparse.ArgumentParser:
    parser = build_parser(spec, prog="run_deepspeed_flops.py")
    parser.description = (f"TinyLlama {spec.name} ({spec.title}): FLOPs of one forward pass counted by DeepSpeed "
                          "and by formula, then achieved training TFLOP/s and MFU from timed steps. "
                          "--num-steps is not used here: the timing runs --warmup-steps + --timing-steps steps.")
    group = parser.add_argument_group("FLOPS analysis")
    group.add_argument("--output-dir", default="flops_analysis",
                       help="where flops_profile.json, model_profile.txt and mfu_analysis.csv go")
    group.add_argument("--analyze-results", metavar="FILE",
                       help="no run: print the summary of a saved flops_profile.json again")
    group.add_argument("--timing-steps", type=positive_int, default=DEFAULT_TIMING_STEPS,
                       help=f"timed training steps, after --warmup-steps (here default "
                            f"{DEFAULT_FLOPS_WARMUP_STEPS}) untimed ones")
    group.add_argument("--computational-intensity", action="store_true",
                       help="print the arithmetic intensity (FLOPs per byte) of each matrix product of a layer")
    group.add_argument("--generate-roofline", action="store_true",
                       help="write roofline.png (needs matplotlib and a device with known peaks)")
    return parser


def deepspeed_count(model, forward, model_profile: Path) -> dict:
    """DeepSpeed's count of one forward pass (after one unprofiled pass: allocator and library start-up), as
    flops_profile.json holds it; without DeepSpeed, the line that says why (printed with the summary)."""
    problem = deepspeed_import_problem()
    if problem is not None:
        return {"available": False, "message": problem}
    forward()
    counted = profile_forward(model, forward, model_profile)
    return {"available": True, "message": None, "deepspeed_version": counted["deepspeed_version"],
            "forward_flops": counted["forward_flops"], "forward_macs": counted["forward_macs"],
            "params": counted["params"], "forward_latency_ms": 1e3 * counted["forward_latency_s"],
            "modules": counted["modules"], "model_profile": str(model_profile)}


def measure_flops(spec: VersionSpec, args, argv, command: str) -> dict:
    """Everything flops_profile.json holds; writes model_profile.txt (and roofline.png) on the way."""
    import torch

    from ..training.step import autocast_context
    from ..training.timing import time_training_steps
    from ..training.trainer import Trainer

    if args.num_steps is not None:
        print("note: --num-steps is not used here; the timing runs --warmup-steps + --timing-steps steps")
    unused = [flag for dest, flag in PROFILER_FLAGS.items() if getattr(args, dest, None) is not None]
    if unused:
        print(f"note: {', '.join(unused)} not used here: this command records no PyTorch-profiler trace "
              f"(run_pytorch_profiler.py does)")
    warmup = args.warmup_steps if args.warmup_steps is not None else DEFAULT_FLOPS_WARMUP_STEPS
    args.num_steps = warmup + args.timing_steps      # only so that the shared validation sees a consistent run
    args.warmup_steps = warmup
    model_config, train_config = resolve_configs(args)
    out_dir = ensure_directory(args.output_dir, "--output-dir")
    trainer = Trainer(spec, model_config, train_config, args, out=sys.stdout, argv=given_arguments(argv))
    trainer.build()            # the model exactly as training builds it: canonical weights, on the device
    cfg, batch, seq = model_config, train_config.batch_size, train_config.seq_len
    info = describe(trainer.device)
    precision = train_config.amp_dtype if train_config.use_amp else "float32"
    on_gpu = trainer.device.type == "cuda"
    peak = peak_tflops(info.name, precision) if on_gpu else None
    bandwidth = peak_bandwidth_tbs(info.name) if on_gpu else None
    print(f"=== DeepSpeed FLOPS analysis: {spec.name} ({spec.title}) ===")
    print(f"device : {info.name} ({info.backend}), {precision}")
    print(f"model  : hidden {cfg.hidden_dim}, layers {cfg.num_layers}, heads {cfg.num_heads}, ffn "
          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; batch {batch} x seq {seq}")

    # (a) DeepSpeed on one forward pass
    inputs, targets = trainer.stream.batch(0)

    def forward():
        with torch.no_grad(), autocast_context(trainer.device, train_config):
            trainer.model(inputs, targets)

    deepspeed_result = deepspeed_count(trainer.model, forward, out_dir / "model_profile.txt")

    # (b) the formulas
    analytic = analytic_counts(cfg, batch, seq)
    ratio = (deepspeed_result["forward_flops"] / analytic["forward_flops"]
             if deepspeed_result["available"] else None)

    # (c) timed training steps
    print(f"timing {args.timing_steps} training steps after {warmup} warm-up steps ...")
    timing = time_training_steps(trainer.step_fn, trainer.stream, trainer.device, warmup, args.timing_steps)
    median_s = timing["median_ms"] / 1e3 if timing["median_ms"] else None
    achieved = analytic["training_flops"] / median_s / 1e12 if median_s else None
    throughput = {"samples_per_s": batch / median_s if median_s else None,
                  "tokens_per_s": batch * seq / median_s if median_s else None,
                  "training_tflops_per_s": achieved, "peak_tflops": peak,
                  "mfu": achieved / peak if (achieved and peak) else None, "peak_bandwidth_tbs": bandwidth}

    result = {
        "schema_version": 1, "kind": FLOPS_PROFILE_KIND, "version": spec.name, "title": spec.title,
        "variant": trainer.variant_description(), "command": command, "device": info.as_dict(),
        "precision": precision, "model_config": asdict(cfg), "parameters": parameter_count(cfg),
        "batch_size": batch, "seq_len": seq, "deepspeed": deepspeed_result, "analytic": analytic,
        "comparison": {"deepspeed_over_analytic": ratio, "explanation": DEEPSPEED_VS_ANALYTIC,
                       "parts": compare_parts(deepspeed_result, analytic) if deepspeed_result["available"] else []},
        "timing": timing, "throughput": throughput, "intensity": None, "roofline": None,
    }

    # (d) arithmetic intensity and the roofline
    if args.computational_intensity or args.generate_roofline:
        bytes_per_element = torch.finfo(getattr(torch, precision)).bits // 8
        ridge = peak / bandwidth if (peak and bandwidth) else None
        result["intensity"] = {"byte_model": BYTE_MODEL, "bytes_per_element": bytes_per_element,
                               "ridge_flops_per_byte": ridge,
                               "rows": intensity_rows(cfg, batch, seq, bytes_per_element, ridge)}
    if args.generate_roofline:
        result["roofline"] = roofline_result(out_dir, result, info.name, precision)
    return result


def roofline_result(out_dir: Path, result: dict, device_name: str, precision: str) -> dict:
    peak, bandwidth = result["throughput"]["peak_tflops"], result["throughput"]["peak_bandwidth_tbs"]
    if not (peak and bandwidth):
        return {"path": None, "message": f"no roofline: the peak FLOP/s or memory bandwidth of {device_name} "
                                         "is not in tinytransformer/device.py's tables"}
    title = f"{result['version']} on {device_name}: {precision} peak {peak:g} TFLOP/s, {bandwidth} TB/s"
    path = write_roofline(out_dir / "roofline.png", peak, bandwidth, result["intensity"]["rows"],
                          result["throughput"]["training_tflops_per_s"], title)
    if path is None:
        return {"path": None, "message": "no roofline: matplotlib is not installed (pip install matplotlib)"}
    return {"path": path, "message": None}


def write_flops_outputs(out_dir: Path, result: dict) -> dict:
    """flops_profile.json (every number) and mfu_analysis.csv (one row); returns {name: path}."""
    analytic, throughput, timing = result["analytic"], result["throughput"], result["timing"]
    row = {
        "version": result["version"], "device": result["device"]["name"], "precision": result["precision"],
        "batch_size": result["batch_size"], "seq_len": result["seq_len"],
        "warmup_steps": timing["warmup_steps"], "timed_steps": timing["count"],
        "median_step_ms": timing["median_ms"], "p10_step_ms": timing["p10_ms"], "p90_step_ms": timing["p90_ms"],
        "samples_per_s": throughput["samples_per_s"], "tokens_per_s": throughput["tokens_per_s"],
        "analytic_forward_flops": analytic["forward_flops"],
        "analytic_training_flops_per_step": analytic["training_flops"],
        "achieved_tflops": throughput["training_tflops_per_s"], "peak_tflops": throughput["peak_tflops"],
        "mfu_percent": 100 * throughput["mfu"] if throughput["mfu"] is not None else None,
        "deepspeed_forward_flops": result["deepspeed"].get("forward_flops"),
        "deepspeed_over_analytic": result["comparison"]["deepspeed_over_analytic"],
    }
    paths = {"flops_profile.json": out_dir / "flops_profile.json", "mfu_analysis.csv": out_dir / "mfu_analysis.csv"}
    with open(paths["mfu_analysis.csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(row))
        writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    result["files"] = {name: str(path) for name, path in paths.items()}
    if result["deepspeed"].get("model_profile"):
        result["files"]["model_profile.txt"] = result["deepspeed"]["model_profile"]
    if result["roofline"] and result["roofline"]["path"]:
        result["files"]["roofline.png"] = result["roofline"]["path"]
    write_json(paths["flops_profile.json"], result)
    return result["files"]


def load_flops_result(text: str, output_dir: str) -> dict:
    """A saved flops_profile.json; a bare name is also looked for in --output-dir. ConfigError if bad."""
    path = Path(text)
    if not path.exists() and not path.is_absolute() and (Path(output_dir) / path).exists():
        path = Path(output_dir) / path
    if not path.is_file():
        raise ConfigError(f"--analyze-results: no such file: {text}")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"--analyze-results: {path} is not readable JSON ({type(error).__name__})") from None
    needed = ("deepspeed", "analytic", "comparison", "timing", "throughput", "device")
    if not isinstance(result, dict) or result.get("kind") != FLOPS_PROFILE_KIND or any(
            key not in result for key in needed):
        raise ConfigError(f"--analyze-results: {path} is not a flops_profile.json written by run_deepspeed_flops.py")
    try:
        return check_flops_profile(result, path)
    except ConfigError as problem:
        raise ConfigError(f"--analyze-results: {problem}") from None


def deepspeed_flops_main(spec: VersionSpec, argv=None) -> int:
    """run_deepspeed_flops.py: DeepSpeed and analytic FLOPs, achieved TFLOP/s and MFU."""
    parser = deepspeed_flops_parser(spec)
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        if args.analyze_results:
            result = load_flops_result(args.analyze_results, args.output_dir)
        else:
            result = measure_flops(spec, args, argv, command_line(parser.prog, argv))
            try:
                write_flops_outputs(Path(args.output_dir), result)
            except OSError as error:
                raise ConfigError(f"cannot write into {args.output_dir}: {error.strerror or error}") from None
        print("\n".join(flops_summary(result)))
        return 0

    return run_command(parser.prog, body, errors=(TraceError,))
