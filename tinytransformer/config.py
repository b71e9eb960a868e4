"""Configuration: what the model is (ModelConfig) and how it is trained (TrainConfig).

Both are plain dataclasses. A YAML file (`--config configs/tiny.yaml` or `--preset tiny`) may set any field;
command-line flags override the file. `validate()` turns every impossible combination into a ConfigError with
one readable line, which the CLI prints before exiting with code 2.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .checks import (SEED_LIMIT, ConfigError, check_bool, check_choice, check_int, check_number,  # noqa: F401
                     check_text, read_settings_text)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MIN_VOCAB = 2   # one token: every target is that token, the loss is 0 by construction and nothing is learned
# The dtypes data parallel may sum gradients in: float32 (exact sums of the float32 gradients), or bfloat16 (half
# the bytes on the wire and in the collective's kernels; each sum rounded to bfloat16's 8-bit mantissa).
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


@dataclass
class ModelConfig:
    """The TinyLlama architecture. Defaults are the workshop's tiny model."""
    vocab_size: int = 1000
    hidden_dim: int = 256
    num_layers: int = 4
    num_heads: int = 8
    intermediate_size: int = 512
    max_seq_len: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    def validate(self) -> None:
        """Every field through checks.py (whatever its source: flag, YAML, checkpoint), then the combinations."""
        if check_int("vocab_size", self.vocab_size, 1) < MIN_VOCAB:
            raise ConfigError(f"vocab_size must be at least {MIN_VOCAB}, got {self.vocab_size}: with one token "
                              f"every target is that token and the loss is 0 by construction")
        for name in ("hidden_dim", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            check_int(name, getattr(self, name), 1)
        check_number("rms_norm_eps", self.rms_norm_eps, positive=True)
        check_number("rope_theta", self.rope_theta, positive=True)
        if self.hidden_dim % self.num_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must divide hidden_dim ({self.hidden_dim})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = hidden_dim / num_heads = {self.head_dim} must be even for RoPE")


@dataclass
class TrainConfig:
    """How one run trains and measures. Defaults are the workshop's seed configuration."""
    batch_size: int = 8              # per rank under data parallel
    seq_len: int = 128
    num_steps: int = 100             # total optimizer steps of the run
    warmup_steps: int = 5            # TIMING warm-up: these steps are excluded from throughput figures
    learning_rate: float = 1e-3      # the peak learning rate of the schedule
    lr_schedule: str = "constant"    # constant | cosine
    lr_warmup_steps: int = 0         # LEARNING-RATE warm-up: linear ramp to the peak (not the timing warm-up)
    weight_decay: float = 0.0
    seed: int = 42
    device: str = "auto"             # auto | cuda | cpu
    use_amp: bool = False
    amp_dtype: str = "bfloat16"      # bfloat16 | float16
    data: str = "markov"             # markov | random | text:PATH | text:stdlib
    eval_every: int = 0              # validation loss every N steps (0: never)
    eval_batches: int = 8            # batches per validation: the same fixed batches every time
    save_every: int = 0              # checkpoint every N steps and at the end; 0: none, except when a signal
                                     # stops a run that gave --checkpoint-dir or --resume
    checkpoint_dir: str = "checkpoints"
    keep_last: int = 3               # checkpoints kept in checkpoint_dir (0: all)
    resume: str | None = None        # a checkpoint file, or "auto": the newest valid one in checkpoint_dir
    log_every: int = 10
    output_json: str | None = None
    tensorboard_dir: str | None = None
    timing_breakdown: bool = False
    validate_setup: bool = False
    # profiling
    enable_pytorch_profiler: bool = False
    profile_memory: bool = False
    profile_dir: str = "pytorch_profiles"
    profile_operators: bool = False
    sort_by: str = "self_device_time_total"
    profile_steps: int = 3
    enable_deepspeed_flops: bool = False
    # data parallel (tinytransformer/distributed.py): active when started by torchrun / the deepspeed launcher
    dist_backend: str = "auto"       # auto (nccl on GPUs = RCCL on ROCm, gloo on CPU) | nccl | gloo
    deepspeed: bool = False          # DeepSpeed's engine instead of DistributedDataParallel
    zero_stage: int | None = None    # DeepSpeed ZeRO stage 0, 1 or 2 (None: the config file's, else 0)
    deepspeed_config: str | None = None   # a DeepSpeed JSON file (implies deepspeed)
    grad_reduce_dtype: str = "float32"    # float32 | bfloat16: the dtype the ranks' gradients are summed in
    stop_on_nan: bool = True         # a non-finite loss ends the run (--no-stop-on-nan: train on, as exercises show)
    extra: dict = field(default_factory=dict)  # version-specific options (fusion switches, ...)

    def validate(self) -> None:
        self.validate_values()
        if self.warmup_steps >= self.num_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be smaller than num_steps "
                              f"({self.num_steps}): no step would be left to time")
        if self.lr_warmup_steps >= self.num_steps:
            raise ConfigError(f"lr_warmup_steps ({self.lr_warmup_steps}) must be smaller than num_steps "
                              f"({self.num_steps})")
        if not (self.data in ("markov", "random") or self.data.startswith("text:")):
            raise ConfigError(f"unknown --data {self.data!r}: use markov, random, text:PATH or text:stdlib")
        if self.data == "text:":
            raise ConfigError("--data text:PATH needs a file path after 'text:'")
        self.validate_data_parallel()

    def validate_values(self) -> None:
        """Each field alone: its type and range (checks.py)."""
        for name in ("batch_size", "seq_len", "num_steps", "log_every", "profile_steps", "eval_batches"):
            check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "lr_warmup_steps", "eval_every", "save_every", "keep_last"):
            check_int(name, getattr(self, name), 0)
        check_int("seed", self.seed, 0, SEED_LIMIT)
        check_number("learning_rate", self.learning_rate, positive=True)
        check_number("weight_decay", self.weight_decay, minimum=0.0)
        check_choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        check_choice("device", self.device, ("auto", "cuda", "cpu"))
        check_choice("amp_dtype", self.amp_dtype, ("bfloat16", "float16"))
        check_choice("dist_backend", self.dist_backend, ("auto", "nccl", "gloo"))
        check_choice("grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        from .profiling.session import SORT_KEYS   # here: the profiling package imports this module
        check_choice("sort_by", self.sort_by, SORT_KEYS)
        for name in ("use_amp", "timing_breakdown", "validate_setup", "enable_pytorch_profiler", "profile_memory",
                     "profile_operators", "enable_deepspeed_flops", "deepspeed", "stop_on_nan"):
            check_bool(name, getattr(self, name))
        for name in ("data", "checkpoint_dir", "profile_dir"):
            check_text(name, getattr(self, name))
        for name in ("resume", "output_json", "tensorboard_dir", "deepspeed_config"):
            check_text(name, getattr(self, name), optional=True)
        if self.zero_stage is not None:
            check_int("zero_stage", self.zero_stage, 0)
        if not isinstance(self.extra, dict):
            raise ConfigError(f"extra must be a mapping, got {self.extra!r}")

    @property
    def uses_deepspeed(self) -> bool:
        return self.deepspeed or self.deepspeed_config is not None

    def validate_data_parallel(self) -> None:
        if self.dist_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"dist_backend must be auto, nccl or gloo, got {self.dist_backend!r}")
        if self.zero_stage is not None and not self.uses_deepspeed:
            raise ConfigError("--zero-stage is a DeepSpeed setting: add --deepspeed")
        if self.zero_stage is not None:
            check_zero_stage(self.zero_stage)
        if self.uses_deepspeed and self.grad_reduce_dtype != "float32":
            raise ConfigError("--grad-reduce-dtype is for torchrun without --deepspeed: DeepSpeed sums gradients in "
                              "its own communication_data_type (set it in --deepspeed-config)")
        if self.uses_deepspeed and (self.save_every or self.resume):
            raise ConfigError("checkpoints (--save-every, --resume) are not supported with --deepspeed: the optimizer "
                              "state lives inside DeepSpeed's engine (partitioned under ZeRO); use torchrun "
                              "without --deepspeed (DDP) for checkpointed runs")


def check_zero_stage(stage) -> None:
    """DeepSpeed ZeRO stages this harness supports: 0 (plain data parallel), 1 (optimizer state partitioned over
    the ranks) and 2 (gradients partitioned too)."""
    if stage == 3:
        raise ConfigError("ZeRO stage 3 is not supported here: it partitions the parameters themselves, and the "
                          "harness needs whole parameters on every rank (load_canonical, checkpoints, validation); "
                          "use --zero-stage 0, 1 or 2")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2):
        raise ConfigError(f"--zero-stage must be 0, 1 or 2, got {stage!r}")


def check_compatible(model: ModelConfig, train: TrainConfig) -> None:
    """Checks that involve both configs."""
    model.validate()
    train.validate()
    if train.seq_len > model.max_seq_len:
        raise ConfigError(f"seq_len ({train.seq_len}) exceeds max_seq_len ({model.max_seq_len}); "
                          f"raise --max-seq-len")


def head_dim_advice(model: ModelConfig, head_dims) -> str:
    """Where a model's head dim comes from and which --num-heads would give one of `head_dims` (the head dims a
    kernel supports), for an error message: "head dim = hidden_dim / num_heads = 64 / 8; --num-heads 4, 2 or 1
    give 16, 32 or 64"."""
    where = f"head dim = hidden_dim / num_heads = {model.hidden_dim} / {model.num_heads}"
    choices = [(model.hidden_dim // dim, dim) for dim in sorted(head_dims) if model.hidden_dim % dim == 0]
    if not choices:
        return (f"{where}; no --num-heads gives one for --hidden-dim {model.hidden_dim}: "
                f"use a multiple of {min(head_dims)}")

    def listed(items):
        items = [str(item) for item in items]
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
    return (f"{where}; --num-heads {listed(heads for heads, _ in choices)} "
            f"give{'s' if len(choices) == 1 else ''} {listed(dim for _, dim in choices)}")


MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}


def available_presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(available_presets())}")
    return path


class _RepeatedKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML's "the last one wins" would
    silently drop the first value (a flag overriding the file is different: that is the documented order)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
            except TypeError:   # an unhashable key; the base class reports it
                break
            if repeated:
                raise _RepeatedKey(f"key {key!r} is given twice (again on line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict:
    """Read a config file: a mapping with optional 'model' and 'train' sections (or flat keys)."""
    path = Path(path)
    data = _parse_yaml(read_settings_text(path, "config"), path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of settings, got {type(data).__name__}")
    flat = {}
    for key, value in data.items():
        _require_setting_name(key, path)
        section = value if key in ("model", "train") and isinstance(value, dict) else {key: value}
        for name, setting in section.items():
            _require_setting_name(name, path)
            if name in flat:   # e.g. hidden_dim in the model section and again at the top level
                raise ConfigError(f"config {path}: setting {name} is given twice")
            flat[name] = setting
    unknown = sorted(set(flat) - MODEL_FIELDS - TRAIN_FIELDS)
    if unknown:
        raise ConfigError(f"config {path}: unknown setting(s) {', '.join(unknown)}")
    return flat


def _parse_yaml(text: str, path: Path):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _RepeatedKey as error:
        raise ConfigError(f"config {path}: {error}") from None
    except yaml.YAMLError as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(f"config {path} is not valid YAML: {first_line}") from None
    except RecursionError:   # the parser recurses once per level of nesting; no setting nests like this
        raise ConfigError(f"config {path} is nested too deeply to be a config file") from None


def _require_setting_name(key, path: Path) -> None:
    """YAML allows keys of any type (`1: 2`, `[a]: b`); a setting's name is text."""
    if not isinstance(key, str):
        raise ConfigError(f"config {path}: setting names are text, got the key {key!r} ({type(key).__name__})")


def split_settings(settings: dict) -> tuple[dict, dict]:
    """Split a flat mapping of settings into (model fields, train fields)."""
    model = {k: v for k, v in settings.items() if k in MODEL_FIELDS}
    train = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    return model, train


def preset_settings(name: str) -> tuple[dict, dict]:
    """(model fields, train fields) of configs/NAME.yaml."""
    return split_settings(load_yaml(preset_path(name)))
