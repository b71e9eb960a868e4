"""The command line every version shares, and `run(spec, argv)`, the entry point of each tiny_llama_vK.py.

Settings are resolved in three layers: the dataclass defaults (the seed configuration), then a YAML file
(`--config FILE` or `--preset NAME`), then the flags given on the command line. Any bad input ends with ONE
line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from .config import (ConfigError, ModelConfig, TrainConfig, check_compatible, load_yaml, preset_path,
                     split_settings)
from .profiling import SORT_KEYS

EXIT_BAD_INPUT = 2


@dataclass
class VersionSpec:
    """What a version plugs into the shared harness."""
    name: str                                    # "v1"
    title: str                                   # "PyTorch baseline"
    build_model: Callable                        # (ModelConfig, args) -> nn.Module
    add_arguments: Callable | None = None        # (parser) -> None: the version's own flags
    check_arguments: Callable | None = None      # (args, device) -> None; raises ConfigError
    describe: Callable | None = None             # (args) -> dict printed in the header and saved in JSON
    make_step: Callable | None = None            # (model, optimizer, device, train, args) -> step(inputs, targets)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (program: error: ...) and exit code 2."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser(spec: VersionSpec, prog: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description=f"TinyLlama {spec.name} ({spec.title}): train, time and profile.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Defaults are None here so that we can tell "not given" from "given"; the real defaults are the
    # dataclass fields (shown in the help text), overridden by --config/--preset, then by the flags.
    model = parser.add_argument_group("model size (defaults: the seed config)")
    model.add_argument("--vocab-size", type=positive_int, help="vocabulary size [1000]")
    model.add_argument("--hidden-dim", type=positive_int, help="model width D [256]")
    model.add_argument("--num-layers", type=positive_int, help="transformer blocks [4]")
    model.add_argument("--num-heads", type=positive_int, help="attention heads; must divide D [8]")
    model.add_argument("--intermediate-size", type=positive_int, help="SwiGLU width F [512]")
    model.add_argument("--max-seq-len", type=positive_int, help="longest sequence the model supports [128]")

    run = parser.add_argument_group("training")
    run.add_argument("--config", help="YAML file with model/train settings (flags override it)")
    run.add_argument("--preset", help="a size preset from configs/: tiny, small, medium, large")
    run.add_argument("--batch-size", type=positive_int, help="sequences per step (per rank) [8]")
    run.add_argument("--seq-len", type=positive_int, help="tokens per sequence [128]")
    run.add_argument("--num-steps", type=positive_int, help="optimizer steps in the run [100]")
    run.add_argument("--warmup-steps", type=non_negative_int,
                     help="TIMING warm-up: the first N steps are excluded from throughput figures "
                          "[min(5, (num_steps-1)//2)]")
    run.add_argument("--learning-rate", type=positive_float, help="AdamW learning rate [1e-3]")
    run.add_argument("--seed", type=int, help="seed for weights and data [42]")
    run.add_argument("--device", choices=["auto", "cuda", "cpu"], help="cuda = any GPU (NVIDIA or AMD) [auto]")
    run.add_argument("--use-amp", action="store_true", default=None, help="mixed precision (autocast)")
    run.add_argument("--amp-dtype", choices=["bfloat16", "float16"], help="autocast dtype [bfloat16]")
    run.add_argument("--data", help="markov (learnable, known optimum) | random | text:PATH [markov]")

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", help="write the run's metrics (config, device, speed, memory, loss) here")
    out.add_argument("--log-every", type=positive_int, help="print a step line every N steps [10]")
    out.add_argument("--tensorboard-dir", help="write TensorBoard scalars here")
    out.add_argument("--timing-breakdown", action="store_true", default=None,
                     help="also time forward / backward / optimizer separately")
    out.add_argument("--validate-setup", action="store_true", default=None,
                     help="check the environment (device, libraries, a tiny step) before running")

    prof = parser.add_argument_group("profiling")
    prof.add_argument("--enable-pytorch-profiler", action="store_true", default=None,
                      help="record a PyTorch-profiler trace of a few steps")
    prof.add_argument("--profile-memory", "--enable-memory-profiling", action="store_true", default=None,
                      dest="profile_memory", help="record allocations too and export a memory timeline")
    prof.add_argument("--profile-dir", help="where traces and reports go [pytorch_profiles]")
    prof.add_argument("--profile-operators", action="store_true", default=None,
                      help="print the top operators table after profiling")
    prof.add_argument("--sort-by", choices=SORT_KEYS, help="operator table order [self_device_time_total]")
    prof.add_argument("--profile-steps", type=positive_int, help="active steps recorded by the profiler [3]")
    prof.add_argument("--enable-deepspeed-flops", action="store_true", default=None,
                      help="DeepSpeed FLOPS profile of one forward pass (needs deepspeed)")
    if spec.add_arguments:
        spec.add_arguments(parser.add_argument_group(f"{spec.name} options"))
    return parser


def resolve_configs(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """Defaults <- YAML (--preset, then --config) <- explicit flags."""
    settings: dict = {}
    if args.preset:
        settings.update(load_yaml(preset_path(args.preset)))
    if args.config:
        settings.update(load_yaml(args.config))
    for key, value in vars(args).items():
        if value is not None and key not in ("config", "preset"):
            settings[key] = value
    model_settings, train_settings = split_settings(settings)
    try:
        model = ModelConfig(**model_settings)
        train = TrainConfig(**train_settings)
    except TypeError as error:
        raise ConfigError(str(error)) from None
    if "warmup_steps" not in train_settings:
        train.warmup_steps = min(5, max(0, (train.num_steps - 1) // 2))
    # A config file may set max_seq_len below a requested --seq-len; a flag --seq-len alone above the
    # default max is an error, reported by check_compatible with the fix to apply.
    check_compatible(model, train)
    return model, train


def run(spec: VersionSpec, argv=None) -> int:
    """Parse, configure, train, report. Returns the process exit code."""
    parser = build_parser(spec)
    args = parser.parse_args(argv)
    from .trainer import Trainer  # after parsing: --help stays fast
    try:
        model_config, train_config = resolve_configs(args)
        trainer = Trainer(spec, model_config, train_config, args)
        if train_config.validate_setup:
            from .validate import validate_setup
            if not validate_setup(trainer):
                return 1
        trainer.run()
        if train_config.validate_setup:
            from .validate import check_outputs
            return 0 if check_outputs(trainer) else 1
    except ConfigError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    return 0
