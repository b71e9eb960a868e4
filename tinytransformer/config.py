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

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """An invalid configuration; its message is one line meant for the user."""


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
        for name in ("vocab_size", "hidden_dim", "num_layers", "num_heads", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_dim % self.num_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must divide hidden_dim ({self.hidden_dim})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = hidden_dim / num_heads = {self.head_dim} must be even for RoPE")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")


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
    extra: dict = field(default_factory=dict)  # version-specific options (fusion switches, ...)

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "num_steps", "log_every", "profile_steps", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr_warmup_steps", "eval_every", "save_every", "keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= self.num_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be smaller than num_steps "
                              f"({self.num_steps}): no step would be left to time")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.lr_warmup_steps >= self.num_steps:
            raise ConfigError(f"lr_warmup_steps ({self.lr_warmup_steps}) must be smaller than num_steps "
                              f"({self.num_steps})")
        if not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir must not be empty")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.amp_dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"amp_dtype must be bfloat16 or float16, got {self.amp_dtype!r}")
        if not (self.data in ("markov", "random") or self.data.startswith("text:")):
            raise ConfigError(f"unknown --data {self.data!r}: use markov, random, text:PATH or text:stdlib")
        if self.data == "text:":
            raise ConfigError("--data text:PATH needs a file path after 'text:'")
        self.validate_data_parallel()

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
    if stage not in (0, 1, 2) or isinstance(stage, bool):
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


def load_yaml(path: str | Path) -> dict:
    """Read a config file: a mapping with optional 'model' and 'train' sections (or flat keys)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not a text (UTF-8) file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(f"config {path} is not valid YAML: {first_line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of settings, got {type(data).__name__}")
    flat = {}
    for key, value in data.items():
        if key in ("model", "train") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    unknown = sorted(set(flat) - MODEL_FIELDS - TRAIN_FIELDS)
    if unknown:
        raise ConfigError(f"config {path}: unknown setting(s) {', '.join(unknown)}")
    return flat


def split_settings(settings: dict) -> tuple[dict, dict]:
    """Split a flat mapping of settings into (model fields, train fields)."""
    model = {k: v for k, v in settings.items() if k in MODEL_FIELDS}
    train = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    return model, train
