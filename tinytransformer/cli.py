"""The command line every version shares, and `run(spec, argv)`, the entry point of each tiny_llama_vK.py.

Settings are resolved in three layers: the dataclass defaults (the seed configuration), then a YAML file
(`--config FILE` or `--preset NAME`), then the flags given on the command line. Any bad input ends with ONE
line on stderr and exit code 2, never a traceback. The small helpers at the end of the argparse section (fail,
parse_or_exit_code, run_command, command_line) keep the harness's other commands to the same rule.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Callable

from .checks import SEED_LIMIT, parse_int, parse_number
from .config import (GRAD_REDUCE_DTYPES, ConfigError, ModelConfig, TrainConfig, check_compatible, load_yaml,
                     preset_path, split_settings)
from .distributed import finish_together, is_main_process, shutdown as leave_process_group
from .profiling.session import SORT_KEYS

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
    make_step: Callable | None = None            # (model, optimizer, device, train, args, gradient_sync=None)
                                                 #   -> step(inputs, targets), or None for the default step
    # (args, device) -> bool: under torchrun (DDP), this version's own step averages the gradients over the ranks
    # for these arguments: the model is not wrapped in DDP and make_step gets gradient_sync (gradient_sync.py).
    averages_gradients: Callable | None = None


# Under torchrun every rank finds the same bad input and rank 0 alone reports it. The others wait this long
# before exiting: torchrun stops all workers as soon as one exits with an error, which could otherwise stop
# rank 0 before it has printed its line.
SILENT_RANK_EXIT_DELAY_S = 3.0


def let_rank_zero_report() -> None:
    if not is_main_process():
        time.sleep(SILENT_RANK_EXIT_DELAY_S)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (program: error: ...) and exit code 2."""

    def error(self, message):
        # Under torchrun every rank parses the same arguments: rank 0 alone says what is wrong.
        let_rank_zero_report()
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n" if is_main_process() else None)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for option, switch_dest, switch in vars(namespace).pop(NEEDS_SWITCH_KEY, []):
            if not getattr(namespace, switch_dest, None):
                self.error(f"{option} only applies with {switch}: add {switch}, or drop {option}")
        return namespace, extras


# Where needs_switch's action notes, during parsing, the options that were given (popped again after parsing).
NEEDS_SWITCH_KEY = "_options_needing_a_switch"


def needs_switch(switch_dest: str, switch: str) -> type[argparse.Action]:
    """The argparse action of an option that means something only together with an on/off `switch` (e.g.
    --torch-compile-mode without --enable-torch-compile): given without it, the command line is one line of error
    instead of an option silently ignored. OneLineParser checks it once every flag is parsed (flags come in any
    order)."""
    class StoreNeedingSwitch(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            setattr(namespace, self.dest, values)
            noted = getattr(namespace, NEEDS_SWITCH_KEY, [])
            setattr(namespace, NEEDS_SWITCH_KEY, noted + [(option_string, switch_dest, switch)])
    return StoreNeedingSwitch


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help that shows each default once. The harness's flags default to None (so that a flag given can be told
    from one left out) and write their real default into the help text as [value]; argparse's
    ArgumentDefaultsHelpFormatter would add "(default: None)" to each of them. This one adds "(default: X)" only
    where the help text does not state the default already, and never for None, for on/off switches or for
    suppressed defaults."""

    STATES_DEFAULT = re.compile(r"\[[^\]]*\]\s*$|\(default|%\(default\)", re.IGNORECASE)

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is argparse.SUPPRESS or action.nargs == 0
                or self.STATES_DEFAULT.search(text)):
            return text
        return super()._get_help_string(action)


def _flag_type(parse: Callable, *bounds, **options) -> Callable[[str], object]:
    """An argparse type that converts a flag's text and checks it with checks.py: the same rules as a YAML or
    checkpoint value; a refusal becomes argparse's own one-line error."""
    def convert(text: str):
        try:
            return parse(text, "the value", *bounds, **options)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return convert


positive_int = _flag_type(parse_int, 1)
non_negative_int = _flag_type(parse_int, 0)
seed_int = _flag_type(parse_int, 0, SEED_LIMIT)
positive_float = _flag_type(parse_number, positive=True)
non_negative_float = _flag_type(parse_number, minimum=0.0)
# Eager steps before a CUDA/HIP graph is captured (versions 2 and 4): a few make the optimizer state and compile the
# code; more than this only postpones the capture the flag asks for. (The lower bound, 1, is the versions' check.)
GRAPH_WARMUP_LIMIT = 1000
graph_warmup_int = _flag_type(parse_int, None, GRAPH_WARMUP_LIMIT)


def parse_or_exit_code(parser: argparse.ArgumentParser, argv) -> argparse.Namespace | int:
    """Parsed arguments, or the exit code argparse chose (0 after --help, 2 after a bad flag): for a command
    that returns its exit code instead of ending the process."""
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:   # OneLineParser has already printed its one line
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_INPUT


def fail(prog: str, message: str) -> int:
    """The one-line error of a command: printed on stderr; returns the exit code to end with."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def silence_closed_pipe() -> int:
    """Output piped into `head`: the reader has what it wanted; keep the exit flush from failing. Returns 0."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run_command(prog: str, body: Callable[[], int], errors: tuple = ()) -> int:
    """Run a command's body and return its exit code: ConfigError (and `errors`) become the one-line error (exit
    2), Ctrl-C exits with 130, and a reader that went away (`| head`) ends the command quietly."""
    try:
        return body()
    except (ConfigError, *errors) as error:
        return fail(prog, str(error))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return silence_closed_pipe()


def given_arguments(argv) -> list[str]:
    """The arguments a command was given: `argv`, or the process's own when it is None."""
    return list(sys.argv[1:] if argv is None else argv)


def command_line(prog: str, argv) -> str:
    """The command as typed (for reports and JSON files): prog and its arguments, quoted for a shell."""
    return shlex.join([prog] + given_arguments(argv))


def build_parser(spec: VersionSpec, prog: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description=f"TinyLlama {spec.name} ({spec.title}): train, time and profile.",
        formatter_class=HelpFormatter)
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
                     help="TIMING warm-up: the first N steps (of this process: after --resume, its first N) are "
                          "excluded from throughput figures [min(5, (steps to run - 1)//2)]")
    run.add_argument("--learning-rate", type=positive_float, help="peak AdamW learning rate [1e-3]")
    run.add_argument("--lr-schedule", choices=["constant", "cosine"],
                     help="learning rate over the run: constant, or cosine decay to 10%% of the peak [constant]")
    run.add_argument("--lr-warmup-steps", type=non_negative_int,
                     help="LEARNING-RATE warm-up: ramp the learning rate linearly to its peak over the first N "
                          "steps (not --warmup-steps, which only excludes steps from the timing) [0]")
    run.add_argument("--seed", type=seed_int, help="seed for weights and data [42]")
    run.add_argument("--device", choices=["auto", "cuda", "cpu"], help="cuda = any GPU (NVIDIA or AMD) [auto]")
    run.add_argument("--use-amp", action="store_true", default=None, help="mixed precision (autocast)")
    run.add_argument("--amp-dtype", choices=["bfloat16", "float16"], help="autocast dtype [bfloat16]")
    run.add_argument("--data", help="markov (learnable, known optimum) | random | text:PATH (bytes of a file) | "
                                    "text:stdlib (Python's standard-library source, built in) [markov]")

    keep = parser.add_argument_group("validation and checkpoints")
    keep.add_argument("--eval-every", type=non_negative_int,
                      help="report the held-out (validation) loss every N steps and at the end; 0 = never [0]")
    keep.add_argument("--eval-batches", type=positive_int,
                      help="batches per validation: the same fixed batches every time; at most as many as hold "
                           "every window of the validation split once [8]")
    keep.add_argument("--save-every", type=non_negative_int,
                      help="write a checkpoint every N steps and at the end; 0 = only when stopped by "
                           "Ctrl-C / SIGTERM, and only with --checkpoint-dir or --resume [0]")
    keep.add_argument("--checkpoint-dir",
                      help="where checkpoints are written; giving it also asks for a checkpoint when Ctrl-C / "
                           "SIGTERM stops the run [checkpoints]")
    keep.add_argument("--keep-last", type=non_negative_int,
                      help="keep only the newest K checkpoints in --checkpoint-dir; 0 = keep all [3]")
    keep.add_argument("--resume", metavar="PATH|auto",
                      help="continue a run from a checkpoint file, or 'auto': the newest valid checkpoint in "
                           "--checkpoint-dir (none there: start from step 0). --num-steps is the run's total")

    out = parser.add_argument_group("output")
    out.add_argument("--output-json", help="write the run's metrics (config, device, speed, memory, loss) here")
    out.add_argument("--log-every", type=positive_int, help="print a step line every N steps [10]")
    out.add_argument("--tensorboard-dir", help="write TensorBoard scalars here")
    out.add_argument("--timing-breakdown", action="store_true", default=None,
                     help="also time forward / backward / optimizer separately")
    out.add_argument("--no-stop-on-nan", dest="stop_on_nan", action="store_false", default=None,
                     help="keep training when the loss becomes NaN or infinite (by default the run stops at the "
                          "next step line or checkpoint, with exit code 1)")
    out.add_argument("--validate-setup", action="store_true", default=None,
                     help="check the environment (device, libraries, a tiny step) before running")

    par = parser.add_argument_group(
        "data parallel (start with: torchrun --nproc-per-node N SCRIPT ...; see README, Scaling out)")
    par.add_argument("--dist-backend", choices=["auto", "nccl", "gloo"],
                     help="communication library: nccl (RCCL on ROCm) between GPUs, gloo between CPU processes "
                          "[auto]")
    par.add_argument("--deepspeed", action="store_true", default=None,
                     help="train through DeepSpeed's engine instead of DistributedDataParallel")
    par.add_argument("--zero-stage", type=non_negative_int,
                     help="DeepSpeed ZeRO stage: 0 none, 1 partition the optimizer state, 2 and the gradients "
                          "[0]; 3 is not supported")
    par.add_argument("--grad-reduce-dtype", choices=list(GRAD_REDUCE_DTYPES),
                     help="dtype the ranks' gradients are summed in: bfloat16 halves the bytes of every all-reduce, "
                          "rounding each sum to bfloat16 (DDP through a communication hook, version 4's own "
                          "all-reduces likewise) [float32]")
    par.add_argument("--deepspeed-config", metavar="FILE.json",
                     help="a DeepSpeed configuration file (implies --deepspeed); batch, optimizer, schedule and "
                          "precision still come from the flags")
    # The deepspeed launcher appends --local_rank=N to the script's arguments; the same number is in the
    # LOCAL_RANK environment variable, which is what we read. Accepted here so that argparse does not refuse it.
    par.add_argument("--local-rank", "--local_rank", dest="launcher_local_rank", type=int, help=argparse.SUPPRESS)

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
    # What the user chose, as opposed to defaults: whether --checkpoint-dir was given decides whether a stopped
    # run writes a checkpoint, and a resumed run recomputes a default warm-up (checkpoint/manager.given_explicitly).
    # Not a dataclass field: it stays out of the metrics JSON and the checkpoints.
    train.given_settings = frozenset(train_settings)
    if "warmup_steps" not in train_settings:
        from .training.timing import default_warmup_steps
        train.warmup_steps = default_warmup_steps(train.num_steps)
    # A config file may set max_seq_len below a requested --seq-len; a flag --seq-len alone above the
    # default max is an error, reported by check_compatible with the fix to apply.
    check_compatible(model, train)
    return model, train


def run(spec: VersionSpec, argv=None) -> int:
    """Parse, configure, train, report. Returns the process exit code."""
    parser = build_parser(spec)
    args = parser.parse_args(argv)
    from .training.trainer import Trainer  # after parsing: --help stays fast
    from .training.divergence import EXIT_DIVERGED, Diverged
    trainer = None
    try:
        model_config, train_config = resolve_configs(args)
        trainer = Trainer(spec, model_config, train_config, args, argv=given_arguments(argv))
        if train_config.validate_setup:
            from .validate import validate_setup
            if not validate_setup(trainer):
                return 1
        result = trainer.run()
        finish_together()   # under data parallel: every rank done before any leaves the process group
        if result.exit_code:   # stopped early by SIGTERM (143; a Ctrl-C stop exits with 0)
            return result.exit_code
        if train_config.validate_setup:
            from .validate import check_outputs
            return 0 if check_outputs(trainer) else 1
    except ConfigError as error:
        if is_main_process():   # every rank finds the same error; one line is enough
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        let_rank_zero_report()
        return EXIT_BAD_INPUT
    except Diverged as error:
        if is_main_process():
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        let_rank_zero_report()
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (e.g. `... | head`): stop quietly, as command-line tools do.
        return silence_closed_pipe()
    except torch_oom_errors() as error:
        print(f"{parser.prog}: error: out of GPU memory ({str(error).splitlines()[0][:120]}); "
              f"reduce --batch-size or --seq-len", file=sys.stderr)
        return 1
    finally:
        # A data-parallel run (or one that failed half-way) leaves its process group. The trainer goes first: its
        # DistributedDataParallel wrapper holds the group, and a group destroyed while the interpreter shuts down
        # (instead of here) can abort the process with "terminate called without an active exception".
        trainer = None
        gc.collect()
        leave_process_group()
    return 0


def torch_oom_errors() -> tuple:
    import torch
    return (torch.cuda.OutOfMemoryError,)
