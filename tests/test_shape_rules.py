"""Sizes that the Triton kernels of versions 3 and 4 cannot take are refused before anything is built or printed:
one line on stderr, no traceback, exit code 2, from every script that builds those kernels' inputs from a user's
sizes. Each rule lives in the kernel module that enforces it (a `shape_problem` function the kernel itself
raises); the scripts ask the same functions (tiny_llama_v3/v4.shape_problem and the kernel benches' validate
hooks).

The table: impossible shapes x the scripts that take them, run in-process (fast); the user's own case (version 1's
CPU sizes, head dim 8) also as real processes.
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.config import ModelConfig
from version3_triton import run_triton_profiling, tune_flash_attention
from version3_triton import tiny_llama_v3 as v3
from version3_triton.exercises.performance_debugging import run_stage
from version3_triton.kernels import flash_attention as fa
from version3_triton.kernels import rmsnorm as v3_rmsnorm
from version4_triton_ultra import profile_graphed_step, run_kernel_benchmarks, run_ultra_profiling
from version4_triton_ultra import tiny_llama_v4 as v4
from version4_triton_ultra.kernels import add_rmsnorm as arn
from version4_triton_ultra.kernels import qkv_rope_gemm as qr
from version4_triton_ultra.kernels import swiglu_gemm as sg

REPO = Path(__file__).resolve().parent.parent
CPU = ["--device", "cpu"]


def load_script(relative: str):
    """A script outside any package (benchmarks/) as a module; its own directory first on sys.path."""
    path = REPO / relative
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_versions = load_script("benchmarks/compare_versions.py")
scaling = load_script("benchmarks/scaling.py")
validate = load_script("benchmarks/validate_numerical_accuracy.py")


# ----------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------
# name -> (model and batch flags of the training scripts, a fragment of the message, versions it is impossible for)
SHAPES = {
    "head dim 8 (version 1's old CPU sizes)": (["--hidden-dim", "64", "--num-layers", "2", "--seq-len", "32"],
                                               "head dim 8 not supported", ("v3", "v4")),
    "head dim 24": (["--hidden-dim", "96", "--num-heads", "4"], "head dim 24 not supported", ("v3", "v4")),
    "head dim 256": (["--hidden-dim", "512", "--num-heads", "2"], "head dim 256 not supported", ("v3", "v4")),
    "row wider than a norm program holds": (["--hidden-dim", "16384", "--num-heads", "128"], "8192", ("v3", "v4")),
    "batch x heads beyond the grid": (["--batch-size", "16384", "--num-heads", "4", "--hidden-dim", "64",
                                       "--seq-len", "2"], "grid's second axis", ("v3", "v4")),
    "32-bit offsets within a head": (["--hidden-dim", "256", "--num-heads", "8", "--batch-size", "1",
                                      "--seq-len", "3000000", "--max-seq-len", "3000000"], "below 2**31",
                                     ("v3", "v4")),
    # Only the Triton GEMM with SwiGLU in its epilogue has this limit, and the size rule never picks it for a
    # weight this large (the vendor GEMMs take it): the case forces that form.
    "gate/up weight beyond 32-bit offsets": (["--hidden-dim", "8192", "--num-heads", "64",
                                              "--intermediate-size", "200000", "--swiglu-in-gemms"],
                                             "2**31 elements", ("v4",)),
    # The QKV GEMM with RoPE in its epilogue has this limit; the size rule picks the separate RoPE kernel at this
    # many rows, so the case forces the GEMM.
    "rows beyond the GEMMs' row blocks": (["--hidden-dim", "64", "--num-heads", "1", "--batch-size", "65535",
                                           "--seq-len", "129", "--max-seq-len", "129", "--rope-in-gemm"],
                                          "row blocks", ("v4",)),
}


def training_script(module):
    return lambda flags: module.main(flags + CPU)


def after_double_dash(main, *before):
    return lambda flags: main([*before, "--", *flags, *CPU])


def validate_flags(flags):
    """validate_numerical_accuracy.py takes the model and batch flags, and sets max_seq_len itself."""
    kept, i = [], 0
    while i < len(flags):
        if flags[i] != "--max-seq-len":
            kept += flags[i:i + 2]
        i += 2
    return kept


# script name -> (version whose kernels it runs, how it takes the training flags)
SCRIPTS = {
    "tiny_llama_v3.py": ("v3", training_script(v3)),
    "tiny_llama_v4.py": ("v4", training_script(v4)),
    "tiny_llama_v4.py --rope-in-attention": ("v4", lambda flags: v4.main(flags + CPU + ["--rope-in-attention"])),
    "run_stage.py --stage 4": ("v3", lambda flags: run_stage.main(flags + CPU + ["--stage", "4"])),
    "run_ultra_profiling.py (v3)": ("v3", after_double_dash(run_ultra_profiling.main, "--versions", "v1,v3")),
    "run_ultra_profiling.py (v4)": ("v4", after_double_dash(run_ultra_profiling.main, "--versions", "v4")),
    "compare_versions.py (v3)": ("v3", after_double_dash(compare_versions.main, "--variants", "v1,v3",
                                                          "--device", "cpu")),
    "compare_versions.py (v4)": ("v4", after_double_dash(compare_versions.main, "--variants", "v4",
                                                          "--device", "cpu")),
    "scaling.py (v3)": ("v3", after_double_dash(scaling.main, "--device", "cpu", "--versions", "v1", "v3",
                                                "--presets", "tiny")),
    "scaling.py (v4)": ("v4", after_double_dash(scaling.main, "--device", "cpu", "--versions", "v4",
                                                "--presets", "tiny")),
    "validate_numerical_accuracy.py (v3)": ("v3", lambda flags: validate.main(
        ["--optimized", "v3", *validate_flags(flags), *CPU])),
    "validate_numerical_accuracy.py (v4)": ("v4", lambda flags: validate.main(
        ["--baseline", "v4", "--optimized", "v1", *validate_flags(flags), *CPU])),
}

CASES = [pytest.param(SCRIPTS[script][1], flags, fragment, id=f"{script}: {shape}")
         for shape, (flags, fragment, versions) in SHAPES.items()
         for script in SCRIPTS if SCRIPTS[script][0] in versions
         # the interpreter refuses the stage-4 and --rope-in-attention paths with the same rules; a few suffice
         and ("--" not in script.split(".py")[1] or "head dim 8" in shape)
         # validate_numerical_accuracy.py takes sizes only, not version 4's own switches
         and not ("validate" in script and {"--swiglu-in-gemms", "--rope-in-gemm"} & set(flags))]

# Scripts that take sizes in their own flags: the kernel benches, the graphed-step profiler, the tuner.
OWN_FLAG_CASES = [
    pytest.param(run_triton_profiling.main, ["--hidden-dim", "64", "--num-heads", "8"], "head dim 8",
                 id="run_triton_profiling.py: flash attention head dim 8"),
    pytest.param(run_triton_profiling.main, ["--kernel", "flash_attention", "--batch-size", "16384",
                                             "--num-heads", "4", "--hidden-dim", "64"], "grid's second axis",
                 id="run_triton_profiling.py: batch x heads beyond the grid"),
    pytest.param(run_triton_profiling.main, ["--kernel", "rmsnorm", "--hidden-dim", "16384", "--num-heads", "128"],
                 "8192", id="run_triton_profiling.py: row wider than a norm program holds"),
    pytest.param(run_triton_profiling.main, ["--kernel", "rope", "--hidden-dim", "36", "--num-heads", "4"],
                 "must be even", id="run_triton_profiling.py: odd head dim for RoPE"),
    pytest.param(run_kernel_benchmarks.main, ["--hidden-dim", "16384", "--num-heads", "128"], "MAX_FEATURES",
                 id="run_kernel_benchmarks.py: row wider than a norm program holds"),
    pytest.param(profile_graphed_step.main, ["--batch-size", "16384", "--seq-len", "2"], "grid's second axis",
                 id="profile_graphed_step.py: batch x heads beyond the grid"),
    pytest.param(profile_graphed_step.main, ["--batch-size", "1", "--seq-len", "3000000"], "below 2**31",
                 id="profile_graphed_step.py: 32-bit offsets within a head"),
    pytest.param(tune_flash_attention.main, ["--shapes", "8x8x128,8192x8x128"], "grid's second axis",
                 id="tune_flash_attention.py: batch x heads beyond the grid"),
    pytest.param(tune_flash_attention.main, ["--head-dim", "8"], "invalid choice",
                 id="tune_flash_attention.py: head dim 8"),
]


@pytest.fixture
def nothing_may_run(monkeypatch):
    """A script that let an impossible shape through would start training (in-process: Trainer.build; the model
    comparison: its build; the benchmark drivers: subprocess.run): each of these fails the test instead."""
    from tinytransformer.training.trainer import Trainer

    def refuse(*args, **kwargs):
        raise AssertionError("the shape was not refused before the run started")
    monkeypatch.setattr(Trainer, "build", refuse)
    monkeypatch.setattr(validate, "build", refuse)
    # compare_versions.py and scaling.py start their runs through benchmarks/training_runs.py.
    for module in (sys.modules["training_runs"], run_ultra_profiling):
        monkeypatch.setattr(module.subprocess, "run", refuse)


def one_line_exit_2(main, argv, capsys) -> str:
    """Run main(argv); assert exit 2, one line on stderr, no traceback, nothing on stdout. Returns the line."""
    try:
        code = main(argv)
    except SystemExit as stop:   # argparse's error() and parser.exit() leave through SystemExit
        code = stop.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}; stderr {captured.err!r}"
    assert len(lines) == 1 and "error" in lines[0], f"expected one error line, got {lines}"
    assert "Traceback" not in captured.err
    assert captured.out == "", f"printed before the error: {captured.out!r}"
    return lines[0]


@pytest.mark.usefixtures("nothing_may_run")
@pytest.mark.parametrize("main, flags, fragment", CASES)
def test_impossible_shape_is_one_line_before_anything_runs(main, flags, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # a script that got past its checks would write here, not into the repository
    line = one_line_exit_2(main, flags, capsys)
    assert fragment in line, line


@pytest.mark.usefixtures("nothing_may_run")
@pytest.mark.parametrize("main, argv, fragment", OWN_FLAG_CASES)
def test_impossible_shape_in_a_scripts_own_flags(main, argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_exit_2(main, argv, capsys)
    assert fragment in line, line


@pytest.mark.parametrize("script", ["version3_triton/tiny_llama_v3.py", "version4_triton_ultra/tiny_llama_v4.py"])
def test_the_reported_case_in_a_real_process(script):
    """Version 1's README gave these CPU sizes; versions 3 and 4 printed their configuration, then a traceback."""
    result = subprocess.run([sys.executable, script, "--hidden-dim", "64", "--num-layers", "2", "--seq-len", "32"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "head dim 8 not supported" in lines[0] and "--num-heads 4, 2 or 1" in lines[0], lines[0]


def test_sample_refuses_a_checkpoint_the_triton_kernels_cannot_run(tmp_path, capsys):
    """A version 1 checkpoint of head dim 8, sampled with --version v3: one line, before any model is built."""
    from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main
    sample = load_script("sample.py")
    assert v1_main(["--hidden-dim", "32", "--num-heads", "4", "--num-layers", "1", "--intermediate-size", "32",
                    "--vocab-size", "64", "--batch-size", "2", "--seq-len", "8", "--num-steps", "1",
                    "--save-every", "1", "--checkpoint-dir", str(tmp_path), "--device", "cpu"]) == 0
    capsys.readouterr()
    line = one_line_exit_2(sample.main, ["--checkpoint", str(tmp_path), "--version", "v3", "--device", "cpu"],
                           capsys)
    assert "head dim 8 not supported" in line


# ----------------------------------------------------------------------------------------------------------
# One source per rule: the kernels raise what the checks report
# ----------------------------------------------------------------------------------------------------------
def test_the_kernels_raise_the_rules_the_checks_ask(device):
    qkv = torch.randn(1, 4, 3 * 64, device=device)
    with pytest.raises(ValueError, match="head dim 8 not supported"):
        fa.flash_attention_packed(qkv, 8)
    assert fa.shape_problem(2, 4, 8, 3 * 64).startswith("head dim 8 not supported")
    with pytest.raises(ValueError, match="8192"):
        v3_rmsnorm.rms_norm(torch.ones(1, 8200, device=device), torch.ones(8200, device=device))
    assert "8192" in v3_rmsnorm.shape_problem(8200)
    assert "MAX_FEATURES" in arn.shape_problem(arn.MAX_FEATURES + 1) and arn.shape_problem(arn.MAX_FEATURES) is None
    assert "2**31" in sg.shape_problem(16, 8192, 200000, torch.float32)
    assert "2**31" in qr.shape_problem(16, 30000, 30000, 32, torch.float32)
    assert fa.shape_problem(65536, 8, 32, 96).startswith("batch x heads = 65536")
    assert fa.shape_problem(65535, 8, 32, 96) is None


@pytest.mark.parametrize("version", [v3, v4], ids=["v3", "v4"])
def test_the_seed_and_the_documented_cpu_sizes_are_accepted(version):
    assert version.shape_problem(ModelConfig(), 8, 128) is None
    small = ModelConfig(hidden_dim=64, num_heads=4, num_layers=2, intermediate_size=128)
    assert version.shape_problem(small, 4, 32) is None
    assert version.shape_problem(ModelConfig(hidden_dim=32, num_heads=2), 2, 16) is None   # the smoke size


def test_head_dim_advice_names_the_num_heads_that_work():
    from tinytransformer.config import head_dim_advice
    assert head_dim_advice(ModelConfig(hidden_dim=64, num_heads=8), fa.SUPPORTED_HEAD_DIMS).endswith(
        "--num-heads 4, 2 or 1 give 16, 32 or 64")
    assert "use a multiple of 16" in head_dim_advice(ModelConfig(hidden_dim=100, num_heads=4), (16, 32))
