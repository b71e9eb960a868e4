"""tinytransformer/precision.py: one TF32 switch over PyTorch's two APIs, each simulated by a stand-in.

The stand-ins behave like the real modules: the old API is two booleans; the new one is a string per backend
("ieee" | "tf32" | "none" = follow the global setting), and the old one is absent. The last test runs the real
torch of this machine, whichever API it has.
"""
from types import SimpleNamespace

import pytest
import torch

from tinytransformer import precision


class LegacyMatmul:
    """torch <= 2.8: `allow_tf32` only; asking for `fp32_precision` is an AttributeError, as there."""

    def __init__(self):
        self.allow_tf32 = False

    def __getattr__(self, name):
        raise AttributeError("Unknown attribute " + name)


class NewMatmul:
    """torch >= 2.9: `fp32_precision`; reading the old name after using the new one is an error there."""

    def __init__(self):
        self.fp32_precision = "none"

    @property
    def allow_tf32(self):
        raise RuntimeError("mix of the legacy and new APIs")


def legacy_backends():
    return SimpleNamespace(cuda=SimpleNamespace(matmul=LegacyMatmul()), cudnn=SimpleNamespace(allow_tf32=True))


def new_backends(global_precision="none"):
    """torch >= 2.9, with its process-wide matmul precision: torch.set_float32_matmul_precision sets it together with
    the matmul's fp32_precision, while setting fp32_precision alone leaves it behind (and torch's own readers of
    it, such as TorchInductor's max-autotune, then fail)."""
    backends = SimpleNamespace(cuda=SimpleNamespace(matmul=NewMatmul()),
                               cudnn=SimpleNamespace(conv=SimpleNamespace(fp32_precision="tf32")),
                               fp32_precision=global_precision, process_wide="highest")

    def set_float32_matmul_precision(name):
        backends.process_wide = name
        backends.cuda.matmul.fp32_precision = {"high": "tf32", "highest": "ieee"}[name]
    backends.set_float32_matmul_precision = set_float32_matmul_precision
    return backends


def process_wide_agrees(backends) -> bool:
    return backends.process_wide == ("high" if precision.tf32_enabled(backends) else "highest")


def test_the_api_is_recognised():
    assert not precision.has_fp32_precision_api(legacy_backends())
    assert precision.has_fp32_precision_api(new_backends())


@pytest.mark.parametrize("make", [legacy_backends, new_backends], ids=["legacy", "fp32_precision"])
def test_set_and_read_back(make):
    backends = make()
    assert not precision.tf32_enabled(backends)
    precision.set_tf32(True, backends)
    assert precision.tf32_enabled(backends)
    precision.set_tf32(False, backends)
    assert not precision.tf32_enabled(backends)


def test_the_new_api_sets_both_backends_and_never_touches_the_old_names():
    backends = new_backends()
    precision.set_tf32(True, backends)
    assert backends.cuda.matmul.fp32_precision == "tf32" and backends.cudnn.conv.fp32_precision == "tf32"
    precision.set_tf32(False, backends)   # NewMatmul.allow_tf32 would raise if it were read
    assert backends.cuda.matmul.fp32_precision == "ieee" and backends.cudnn.conv.fp32_precision == "ieee"


@pytest.mark.parametrize("global_precision", ["none", "tf32"])
def test_the_new_api_keeps_the_process_wide_matmul_precision_with_the_switch(global_precision):
    backends = new_backends(global_precision)
    before = precision.saved_state(backends)
    for enabled in (True, False, True):
        precision.set_tf32(enabled, backends)
        assert precision.tf32_enabled(backends) is enabled and process_wide_agrees(backends)
    precision.restore_state(before, backends)
    assert precision.saved_state(backends) == before and process_wide_agrees(backends)


def test_the_legacy_api_sets_both_backends():
    backends = legacy_backends()
    precision.set_tf32(True, backends)
    assert backends.cuda.matmul.allow_tf32 and backends.cudnn.allow_tf32
    precision.set_tf32(False, backends)
    assert not backends.cuda.matmul.allow_tf32 and not backends.cudnn.allow_tf32


@pytest.mark.parametrize("global_precision, expected", [("none", False), ("ieee", False), ("tf32", True)])
def test_none_follows_the_global_setting(global_precision, expected):
    assert precision.tf32_enabled(new_backends(global_precision)) is expected


@pytest.mark.parametrize("make", [legacy_backends, new_backends], ids=["legacy", "fp32_precision"])
def test_the_block_restores_the_exact_settings_even_after_an_error(make):
    backends = make()
    before = precision.saved_state(backends)
    with pytest.raises(ZeroDivisionError):
        with precision.tf32_setting(True, backends):
            assert precision.tf32_enabled(backends)
            1 / 0
    assert precision.saved_state(backends) == before
    with precision.exact_float32_matmuls(backends):
        assert not precision.tf32_enabled(backends)
    assert precision.saved_state(backends) == before


def test_this_machines_torch():
    before = precision.saved_state()
    with precision.tf32_setting(True):
        assert precision.tf32_enabled()
        with precision.exact_float32_matmuls():
            assert not precision.tf32_enabled()
        assert precision.tf32_enabled()
    assert precision.saved_state() == before
    if precision.has_fp32_precision_api():
        assert torch.backends.cuda.matmul.fp32_precision == before[1]


def test_this_machines_torch_reads_one_answer_through_every_api():
    """torch's own code reads the process-wide precision and the old `allow_tf32` (TorchInductor's max-autotune
    keys its GEMM choices by torch.get_float32_matmul_precision()); under the new API these reads raise once the
    matmul's fp32_precision was set alone. After the switch, every one of them answers, and they agree."""
    for enabled in (True, False):
        with precision.tf32_setting(enabled):
            assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
            assert torch.backends.cuda.matmul.allow_tf32 is enabled
            assert precision.tf32_enabled() is enabled
    assert torch.get_float32_matmul_precision() in ("highest", "high", "medium")



@pytest.mark.parametrize("module", ["version2_pytorch_fused.tiny_llama_v2", "version4_triton_ultra.tiny_llama_v4"])
@pytest.mark.parametrize("flags, expected", [([], True), (["--tf32"], True), (["--no-tf32"], False)])
def test_the_training_scripts_tf32_switch(module, flags, expected):
    """Versions 2 and 4 share one --tf32 / --no-tf32 switch (default on). It sets the process's float32 matmuls
    on a GPU only: a CPU run leaves them alone (they are exact there anyway). The conftest fixture puts the
    switches back afterwards."""
    import importlib

    from tinytransformer.cli import build_parser
    args = build_parser(importlib.import_module(module).SPEC).parse_args(flags)
    assert args.tf32 is expected
    with precision.tf32_setting(not expected):
        precision.apply_tf32_argument(args, torch.device("cpu"))
        assert precision.tf32_enabled() is (not expected)
        precision.apply_tf32_argument(args, torch.device("cuda"))
        assert precision.tf32_enabled() is expected
    assert precision.describe_float32_matmuls(args, on_gpu=False).startswith("exact float32")
    assert precision.describe_float32_matmuls(args, on_gpu=True) == (
        "TF32 tensor cores for float32" if expected else "exact float32")


def test_version2_applies_its_tf32_switch_and_says_which_matmuls_ran(monkeypatch):
    from tinytransformer.cli import build_parser
    from version2_pytorch_fused import tiny_llama_v2
    args = build_parser(tiny_llama_v2.SPEC).parse_args(["--device", "cpu"])
    # The harness calls check_arguments with the run's device; version 2's passes both on to the TF32 switch.
    seen = []
    monkeypatch.setattr(tiny_llama_v2, "apply_tf32_argument", lambda *call: seen.append(call))
    tiny_llama_v2.SPEC.check_arguments(args, torch.device("cuda"))
    assert seen == [(args, torch.device("cuda"))]
    monkeypatch.undo()
    assert tiny_llama_v2.describe(args)["matmuls"].startswith("exact float32")
