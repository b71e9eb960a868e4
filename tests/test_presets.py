"""Size presets (configs/*.yaml): parameter counts as documented, valid settings, and a run that reports them."""
import json
import re

import pytest
import torch

from tinytransformer.config import (CONFIG_DIR, ModelConfig, TrainConfig, available_presets, check_compatible,
                                    load_yaml, preset_path, split_settings)
from tinytransformer.weights import parameter_count
from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

# The sizes the workshop talks about (README, "Scaling out"): a model of each order of magnitude.
NOMINAL_PARAMETERS = {"tiny": 3.1e6, "small": 20e6, "medium": 200e6, "large": 1e9}
NOMINAL_RTOL = 0.2      # "~20M" is a name, not a measurement
COMMENT_RTOL = 0.02     # the "~X parameters" comment at the top of each file IS a measurement


def preset_configs(name: str) -> tuple[ModelConfig, TrainConfig]:
    model, train = split_settings(load_yaml(preset_path(name)))
    return ModelConfig(**model), TrainConfig(**train)


def documented_count(name: str) -> float:
    """The '~23M parameters' of the preset file's first comment line, as a number."""
    first_line = (CONFIG_DIR / f"{name}.yaml").read_text().splitlines()[0]
    match = re.search(r"~\s*([\d.]+)\s*([MB])", first_line)
    assert match, f"{name}.yaml should start with a comment giving its size (~NM parameters): {first_line!r}"
    return float(match.group(1)) * {"M": 1e6, "B": 1e9}[match.group(2)]


def test_the_four_presets_exist():
    assert set(NOMINAL_PARAMETERS) <= set(available_presets())


@pytest.mark.parametrize("name", sorted(NOMINAL_PARAMETERS))
def test_parameter_count_matches_the_nominal_size_and_the_comment(name):
    model, train = preset_configs(name)
    check_compatible(model, train)   # valid: heads divide the width, even head dim, seq_len <= max_seq_len
    count = parameter_count(model)
    assert abs(count - NOMINAL_PARAMETERS[name]) < NOMINAL_RTOL * NOMINAL_PARAMETERS[name], f"{name}: {count:,}"
    assert abs(count - documented_count(name)) < COMMENT_RTOL * count, f"{name}: {count:,}"


def test_the_tiny_preset_is_the_default_configuration():
    model, train = preset_configs("tiny")
    assert model == ModelConfig()
    assert (train.batch_size, train.seq_len) == (TrainConfig().batch_size, TrainConfig().seq_len)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_analytic_count_equals_the_model_built(name):
    """Medium and large are counted analytically only: building them needs GBs of host memory."""
    model, _ = preset_configs(name)
    assert sum(p.numel() for p in TinyLlama(model).parameters()) == parameter_count(model)


def test_a_preset_run_prints_its_parameter_count(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    code = v1_main(["--preset", "small", "--batch-size", "1", "--seq-len", "16", "--num-steps", "2",
                    "--device", "cpu", "--output-json", str(out)])
    assert code == 0
    model, _ = preset_configs("small")
    assert f"{parameter_count(model):,} parameters" in capsys.readouterr().out
    metrics = json.loads(out.read_text())
    assert metrics["parameters"] == parameter_count(model) and metrics["model_config"]["hidden_dim"] == 512
    assert metrics["throughput"]["mfu"] is None   # no MFU on a CPU: no peak to compare with


def test_unknown_preset_names_the_available_ones(capsys):
    assert v1_main(["--preset", "huge", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tiny" in err and "large" in err


@pytest.mark.gpu
def test_mfu_is_reported_on_a_known_gpu(tmp_path, capsys):
    from tinytransformer.device import peak_tflops
    out = tmp_path / "medium.json"
    assert v1_main(["--preset", "medium", "--num-steps", "8", "--batch-size", "4", "--use-amp",
                    "--output-json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    if peak_tflops(torch.cuda.get_device_name(), "bfloat16") is None:
        pytest.skip("this GPU is not in the peak-FLOPs table")
    assert 0 < metrics["throughput"]["mfu"] < 1 and "MFU         :" in capsys.readouterr().out
