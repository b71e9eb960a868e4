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
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 42
    device: str = "auto"             # auto | cuda | cpu
    use_amp: bool = False
    amp_dtype: str = "bfloat16"      # bfloat16 | float16
    data: str = "markov"             # markov | random | text:PATH
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
    extra: dict = field(default_factory=dict)  # version-specific options (fusion switches, ...)

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "num_steps", "log_every", "profile_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= self.num_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be smaller than num_steps "
                              f"({self.num_steps}): no step would be left to time")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.amp_dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"amp_dtype must be bfloat16 or float16, got {self.amp_dtype!r}")
        if not (self.data in ("markov", "random") or self.data.startswith("text:")):
            raise ConfigError(f"unknown --data {self.data!r}: use markov, random or text:PATH")
        if self.data == "text:":
            raise ConfigError("--data text:PATH needs a file path after 'text:'")


def check_compatible(model: ModelConfig, train: TrainConfig) -> None:
    """Checks that involve both configs."""
    model.validate()
    train.validate()
    if train.seq_len > model.max_seq_len:
        raise ConfigError(f"seq_len ({train.seq_len}) exceeds max_seq_len ({model.max_seq_len}); "
                          f"raise --max-seq-len")


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
