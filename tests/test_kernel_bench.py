"""The kernel microbenchmark scripts of versions 3 and 4 and their shared code, tinytransformer/kernel_bench/.

On CPU: --check in Triton's interpreter at tiny sizes, the byte models against hand-computed numbers, the
--kernel filter, bad input (one line, exit 2), the no-GPU message, and the whole timing path with do_bench
replaced by a stand-in that calls the timed function a few times (the interpreter cannot time a GPU).
The gpu-marked tests run the real scripts at the seed config.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.kernel_bench import timing as bench_timing
from tinytransformer.kernel_bench.cli import EXIT_CHECK_FAILED, build_parser, resolve_shape, select_ops, shape_record
from tinytransformer.kernel_bench.cli import main as benchmark_main
from tinytransformer.kernel_bench.correctness import relative_error, tolerance_for
from tinytransformer.kernel_bench.ops import BenchShape, torch_rms_norm
from tinytransformer.precision import tf32_enabled, tf32_setting
from version3_triton import run_triton_profiling as v3
from version4_triton_ultra import run_kernel_benchmarks as v4

REPO_ROOT = Path(__file__).resolve().parent.parent
HAS_GPU = torch.cuda.is_available()
# Head dim 16 (the smallest the flash kernel takes); sequence, FFN and vocabulary not powers of two.
TINY = ["--batch-size", "1", "--seq-len", "24", "--hidden-dim", "32", "--num-heads", "2",
        "--intermediate-size", "40", "--vocab-size", "50"]
SEED = BenchShape(batch_size=8, seq_len=128, hidden_dim=256, num_heads=8, intermediate_size=512,
                  vocab_size=1000, dtype=torch.float32)
SEED_BF16 = dataclasses.replace(SEED, dtype=torch.bfloat16)
CPU_ONLY = pytest.mark.skipif(HAS_GPU, reason="exercises the no-GPU (interpreter) behaviour")
# The scripts pick the machine's device themselves (the GPU, else the interpreter), as the `device` fixture does.
ON_THE_MACHINES_DEVICE = pytest.mark.usefixtures("device")
EXPECTED_TENSORS = {
    "rmsnorm": ["y", "grad x", "grad weight"],
    "rope": ["q_rot", "k_rot", "grad q", "grad k"],
    "swiglu": ["out", "grad gate_up"],
    "flash_attention": ["out", "grad q", "grad k", "grad v"],
    "add_rmsnorm": ["h", "normed", "grad residual", "grad delta", "grad weight"],
    "linear_cross_entropy": ["loss", "grad hidden", "grad weight"],
    "embedding": ["rows", "grad weight"],
    "embedding_rmsnorm": ["h", "normed", "grad table", "grad weight"],
}


def run_json(main, tmp_path, *flags):
    path = tmp_path / "out.json"
    code = main([*flags, "--output-json", str(path)])
    return code, json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------
# --check
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("script", [v3, v4], ids=["v3", "v4"])
@ON_THE_MACHINES_DEVICE
def test_check_passes_at_tiny_size(script, dtype, tmp_path, capsys):
    code, report = run_json(script.main, tmp_path, "--check", "--dtype", dtype, *TINY)
    assert code == 0, capsys.readouterr().out
    assert report["shape"]["dtype"] == dtype and report["shape"]["head_dim"] == 16
    seen = {}
    for row in report["checks"]:
        seen.setdefault(row["op"], []).append(row["tensor"])
        assert row["ok"] and row["triton_error"] <= row["tolerance"] and row["pytorch_error"] is not None
    assert seen == {op.name: EXPECTED_TENSORS[op.name] for op in script.OPS}
    out = capsys.readouterr().out
    assert "Triton err" in out and "Check: all within tolerance." in out


@CPU_ONLY
@pytest.mark.interpreter
def test_bfloat16_flash_attention_is_skipped_loudly_in_the_interpreter(tmp_path, capsys):
    code, report = run_json(v3.main, tmp_path, "--check", "--dtype", "bfloat16", "--kernel",
                            "flash_attention,rmsnorm", *TINY)
    assert code == 0
    flash = [row for row in report["checks"] if row["op"] == "flash_attention"]
    assert len(flash) == 1 and "SKIPPED" in flash[0]["skipped"]
    assert all(row["ok"] for row in report["checks"] if row["op"] == "rmsnorm")
    out = capsys.readouterr().out
    assert "SKIPPED" in out and "1 op skipped" in out


@pytest.mark.parametrize("wrong", ["off by 1%", "nan"])
def test_a_wrong_kernel_fails_the_check_with_exit_1(wrong, tmp_path, capsys):
    def broken(x, weight):
        y = torch_rms_norm(x, weight, v3.EPS)
        return y * 1.01 if wrong == "off by 1%" else y + float("nan")

    ops = [dataclasses.replace(v3.RMSNORM, triton=broken)]
    path = tmp_path / "out.json"
    code = benchmark_main(ops, prog="bench", description="", argv=["--check", "--output-json", str(path), *TINY])
    assert code == EXIT_CHECK_FAILED
    out = capsys.readouterr().out
    assert "FAIL" in out and "not timing a wrong kernel" in out
    report = json.loads(path.read_text())   # strict JSON: a non-finite error is written as null
    y_row = report["checks"][0]
    assert y_row["tensor"] == "y" and not y_row["ok"]
    assert (y_row["triton_error"] is None) == (wrong == "nan")


def test_the_check_runs_torch_matmuls_in_float32_whatever_the_process_chose(monkeypatch, tmp_path, capsys):
    """A process that turned TF32 on (version 4 does, for its run) must not fail float32 checks whose PyTorch
    code multiplies matrices; the setting is restored afterwards."""
    seen = []

    def recording(x, weight):
        seen.append(tf32_enabled())
        return torch_rms_norm(x, weight, v3.EPS)

    monkeypatch.setattr(bench_timing, "timing_available", lambda: False)   # the check only: timing keeps the setting
    ops = [dataclasses.replace(v3.RMSNORM, triton=recording)]
    with tf32_setting(True):   # put back by the block (and by conftest's fixture), not by monkeypatch
        code = benchmark_main(ops, prog="bench", description="",
                              argv=["--check", "--output-json", str(tmp_path / "o.json"), *TINY])
        assert code == 0 and seen and not any(seen)
        assert tf32_enabled()


def test_relative_error_never_passes_nan_or_a_wrong_shape():
    ref = torch.randn(5, 3)
    assert relative_error(ref.clone(), ref) == 0.0
    assert math.isinf(relative_error(torch.full_like(ref, float("nan")), ref))
    assert math.isinf(relative_error(ref[:4], ref))
    assert relative_error(ref * 1.5, ref) == pytest.approx(0.5)


def test_tf32_tolerance_only_for_float32_dots_on_an_nvidia_gpu():
    cpu = torch.device("cpu")
    assert tolerance_for(v3.FLASH_ATTENTION, torch.float32, cpu) == 1e-5
    assert tolerance_for(v3.RMSNORM, torch.bfloat16, cpu) == 2e-2
    assert tolerance_for(v3.FLASH_ATTENTION, torch.float16, cpu) == 5e-3


# ----------------------------------------------------------------------------------------------------------
# Byte models: hand-computed at the seed config (N = 8*128 = 1024 tokens, D = 256, F = 512, V = 1000, S = 128,
# Dh = 32, H = 8), e = 4 bytes (float32) or 2 (bfloat16)
# ----------------------------------------------------------------------------------------------------------
def test_rmsnorm_byte_model():
    # fwd: x 1024*256*4 = 1,048,576 read + y the same written + weight 1,024 + rstd 4,096
    assert v3.RMSNORM.bytes_moved(SEED, "fwd") == 2_097_152 + 1_024 + 4_096
    # bwd: dy, x read, dx written (3 * 1,048,576) + weight, dweight (2 * 1,024) + rstd 4,096
    assert v3.RMSNORM.bytes_moved(SEED, "bwd") == 3_145_728 + 2_048 + 4_096
    assert v3.RMSNORM.bytes_moved(SEED_BF16, "fwd") == 1_048_576 + 512 + 4_096


def test_rope_byte_model():
    # q, k read and q_rot, k_rot written: 4 * 1,048,576; cos and sin tables: 2 * 128 * 32 * 4 = 32,768
    assert v3.ROPE.bytes_moved(SEED, "fwd") == 4_194_304 + 32_768
    assert v3.ROPE.bytes_moved(SEED, "bwd") == 4_194_304 + 32_768
    assert v3.ROPE.bytes_moved(SEED_BF16, "fwd") == 2_097_152 + 32_768   # the tables stay float32


def test_swiglu_byte_model():
    # one [N, F] tensor: 1024 * 512 * 4 = 2,097,152 bytes; fwd moves 3 of them (gate, up, out), bwd 5
    assert v3.SWIGLU.bytes_moved(SEED, "fwd") == 6_291_456
    assert v3.SWIGLU.bytes_moved(SEED, "bwd") == 10_485_760


def test_flash_attention_byte_model():
    # q, k, v, out: 4 * 1,048,576 (B*H*S*Dh = N*D); lse: 8 * 8 * 128 * 4 = 32,768
    assert v3.FLASH_ATTENTION.bytes_moved(SEED, "fwd") == 4_194_304 + 32_768
    # q, k, v, out, dout read + dq, dk, dv written: 8 * 1,048,576; lse 32,768
    assert v3.FLASH_ATTENTION.bytes_moved(SEED, "bwd") == 8_388_608 + 32_768


def test_add_rmsnorm_byte_model():
    # fwd: residual, delta read, h, normed written (4 * 1,048,576) + weight 1,024 + rstd 4,096
    assert v4.ADD_RMSNORM.bytes_moved(SEED, "fwd") == 4_194_304 + 1_024 + 4_096
    # bwd: h, dh, dnormed read, grad_h written (4 * 1,048,576) + weight, grad_weight 2,048 + rstd 4,096
    assert v4.ADD_RMSNORM.bytes_moved(SEED, "bwd") == 4_194_304 + 2_048 + 4_096


def test_linear_cross_entropy_byte_model():
    # hidden and grad_hidden 2 * 1,048,576; weight 1000 * 256 * 4 = 1,024,000; float32 grad_weight 1,024,000;
    # targets 1024 * 8 = 8,192; loss 4
    assert v4.LINEAR_CROSS_ENTROPY.bytes_moved(SEED, "fwd") == 2_097_152 + 1_024_000 + 1_024_000 + 8_192 + 4
    assert v4.LINEAR_CROSS_ENTROPY.bytes_moved(SEED, "bwd") == 2_097_152 + 1_024_000 + 1_024_000
    # bfloat16: hidden 524,288, weight 512,000, the float32 grad_weight still 1,024,000
    assert v4.LINEAR_CROSS_ENTROPY.bytes_moved(SEED_BF16, "fwd") == 1_048_576 + 512_000 + 1_024_000 + 8_196
    assert v4.LINEAR_CROSS_ENTROPY.bytes_moved(SEED_BF16, "bwd") == 1_048_576 + 1_024_000 + 512_000
    assert v4.LINEAR_CROSS_ENTROPY.bytes_moved(SEED_BF16, "fwd+bwd") == 1_048_576 + 1_024_000 + 8_196


def test_every_direction_has_a_formula_naming_its_tensors():
    for op in v3.OPS + v4.OPS:
        assert set(op.directions) >= {"fwd", "bwd"}
        for formula, _ in op.byte_model.values():
            assert "read" in formula and "write" in formula


# ----------------------------------------------------------------------------------------------------------
# Timing machinery (do_bench replaced: the interpreter has no GPU to time)
# ----------------------------------------------------------------------------------------------------------
def test_input_set_count():
    mb = 2 ** 20
    assert bench_timing.input_set_count(60 * mb, 50 * mb) == 1          # larger than L2: one set
    assert bench_timing.input_set_count(30 * mb, 50 * mb) == 4          # 2 * 50 / 30 rounded up
    assert bench_timing.input_set_count(3 * mb, 50 * mb) == 34
    assert bench_timing.input_set_count(1 * mb, 50 * mb) == bench_timing.MAX_INPUT_SETS
    assert bench_timing.input_set_count(1 * mb, 0) == 1                 # no cache size known (CPU)
    assert bench_timing.input_set_count(40 * mb, 50 * mb) == 3          # at least 2 whenever one call fits


def test_rotating_cycles_through_the_calls():
    seen = []
    fn = bench_timing.rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        fn()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_runs_take_turns_each_round_starting_one_later():
    """rounds_in_turns: every run once a round, the first of a round one later each round (no run always first),
    each run's times in round order; time_interleaved is their median."""
    from tinytransformer.kernel_bench.graph_timing import rounds_in_turns, time_interleaved
    order, clock = [], iter(range(100))
    runs = {name: (lambda name=name: order.append(name) or float(next(clock))) for name in "abc"}
    times = rounds_in_turns(runs, rounds=4)
    assert order == list("abc" "bca" "cab" "abc")
    assert times == {"a": [0.0, 5.0, 7.0, 9.0], "b": [1.0, 3.0, 8.0, 10.0], "c": [2.0, 4.0, 6.0, 11.0]}
    assert list(times) == ["a", "b", "c"]
    order.clear()
    assert time_interleaved(runs, rounds=3) == {"a": 17.0, "b": 15.0, "c": 16.0}


@pytest.fixture
def fake_timing(monkeypatch):
    """Timing "available" on CPU; do_bench replaced by three calls of the timed function and a fixed 2 us;
    an L2 of 8 KB, so the smaller input sets rotate. Returns the list of timed functions."""
    calls = []

    def fake_median_ms(fn):
        for _ in range(3):   # a backward must survive being repeated on one retained graph
            fn()
        calls.append(fn)
        return 0.002

    monkeypatch.setattr(bench_timing, "timing_available", lambda: True)
    monkeypatch.setattr(bench_timing, "median_ms", fake_median_ms)
    monkeypatch.setattr(bench_timing, "l2_cache_bytes", lambda device: 8 * 1024)
    monkeypatch.setattr(bench_timing, "allocated_bytes", lambda device: 0)   # the same set counts on a GPU machine
    return calls


@pytest.mark.parametrize("script", [v3, v4], ids=["v3", "v4"])
@ON_THE_MACHINES_DEVICE
def test_timing_path_rows_table_footnote_and_json(script, fake_timing, tmp_path, capsys):
    flags = [*TINY, "--kernel", "rmsnorm,swiglu,flash_attention"] if script is v3 else TINY
    code, report = run_json(script.main, tmp_path, *flags)
    assert code == 0
    out = capsys.readouterr().out
    ops = [op for op in script.OPS if script is v4 or op.name != "rope"]
    shape = BenchShape(batch_size=1, seq_len=24, hidden_dim=32, num_heads=2, intermediate_size=40,
                       vocab_size=50, dtype=torch.float32)
    expected = [(op.name, d, label) for op in ops for d in op.directions for label in op.pytorch]
    assert [(r["op"], r["direction"], r["pytorch"]) for r in report["timings"]] == expected
    assert len(fake_timing) == sum(len(op.directions) * (1 + len(op.pytorch)) for op in ops)
    for row in report["timings"]:
        op = next(op for op in ops if op.name == row["op"])
        assert row["pytorch_us"] == row["triton_us"] == pytest.approx(2.0) and row["speedup"] == pytest.approx(1)
        assert row["bytes"] == op.bytes_moved(shape, row["direction"])
        assert row["triton_gbps"] == pytest.approx(row["bytes"] / 2.0 / 1e3)   # bytes per microsecond / 1000
    assert report["do_bench"] == {"warmup_ms": bench_timing.WARMUP_MS, "rep_ms": bench_timing.REP_MS,
                                  "return_mode": "median"}
    # Calls whose data fits the fake 8 KB L2 rotate through enough sets to fill 16 KB. rmsnorm's forward
    # reads x and weight (3,200 bytes): 6 sets; its backward also dy (3,072 more; no GPU memory to measure
    # for saved tensors on CPU): 3 sets. swiglu fwd reads gate_up (7,680 bytes): 3 sets; flash attention's
    # q, k, v (9,216 bytes) exceed 8 KB: 1 set.
    if script is v3:
        assert report["input_sets"] == {"rmsnorm": 6, "swiglu": 3, "flash_attention": 1}
        sets = {(r["op"], r["direction"]): (r["triton_input_sets"], r["pytorch_input_sets"])
                for r in report["timings"]}
        assert sets[("rmsnorm", "fwd")] == (6, 6) and sets[("rmsnorm", "bwd")] == (3, 3)
        assert sets[("swiglu", "bwd")] == (1, 1) and sets[("flash_attention", "fwd")] == (1, 1)
        assert "v1 matmul-softmax-matmul" in out and "F.sdpa (is_causal)" in out
    else:
        assert "fwd+bwd" in out
    assert "speed-up" in out and "Triton GB/s" in out and "retain_graph=True" in out
    for op in ops:
        for direction, (formula, _) in op.byte_model.items():
            assert f"{op.name} {direction}: {formula}" in out
            assert report["byte_models"][f"{op.name} {direction}"] == formula


@ON_THE_MACHINES_DEVICE
def test_timing_path_bfloat16_runs_every_direction(fake_timing, capsys):
    """Timing (not checking) in bfloat16 under the interpreter: the autograd plumbing works for every op."""
    assert v4.main(["--dtype", "bfloat16", *TINY]) == 0
    assert "linear_cross_entropy  fwd+bwd" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
@ON_THE_MACHINES_DEVICE
def test_kernel_filter_keeps_the_order_given_and_drops_repeats(tmp_path):
    code, report = run_json(v3.main, tmp_path, "--check", "--kernel", "rope,rmsnorm,rope", *TINY)
    assert code == 0
    assert list(dict.fromkeys(row["op"] for row in report["checks"])) == ["rope", "rmsnorm"]


@ON_THE_MACHINES_DEVICE
def test_shape_validation_only_for_the_selected_kernels(tmp_path):
    # head dim 48 is not a flash attention size, but rmsnorm does not care
    code, report = run_json(v3.main, tmp_path, "--check", "--kernel", "rmsnorm", "--hidden-dim", "96",
                            "--num-heads", "2", "--batch-size", "1", "--seq-len", "8")
    assert code == 0 and report["shape"]["head_dim"] == 48


@pytest.mark.parametrize("preset, expected", [
    ("medium", dict(batch_size=16, seq_len=512, hidden_dim=1024, num_heads=16, intermediate_size=2816,
                    vocab_size=32000, dtype="bfloat16")),
    ("large", dict(batch_size=8, seq_len=1024, hidden_dim=2048, num_heads=16, intermediate_size=5632,
                   vocab_size=32000, dtype="bfloat16")),
])
def test_a_preset_gives_its_model_and_batch_and_bfloat16(preset, expected):
    """--preset takes the sizes from configs/ (timed only on a GPU: here the shape is all that is recorded)."""
    shape = resolved_shape("--preset", preset)
    assert {key: shape[key] for key in expected} == expected


def test_flags_override_a_preset():
    shape = resolved_shape("--preset", "medium", "--batch-size", "2", "--dtype", "float32")
    assert (shape["batch_size"], shape["hidden_dim"], shape["dtype"]) == (2, 1024, "float32")


def resolved_shape(*flags) -> dict:
    """The sizes version 4's script would run add_rmsnorm at (as its JSON records them), without running it."""
    args = build_parser("run_kernel_benchmarks.py", "", v4.OPS).parse_args([*flags, "--kernel", "add_rmsnorm"])
    return shape_record(resolve_shape(args, use_interpreter_defaults=False, ops=select_ops(v4.OPS, args.kernel)))


BAD_INPUTS = {
    "unknown kernel": ["--kernel", "layernorm"],
    "empty kernel list": ["--kernel", ","],
    "v4 kernel in v3": ["--kernel", "add_rmsnorm"],
    "bad dtype": ["--dtype", "float8"],
    "zero batch": ["--batch-size", "0"],
    "negative seq": ["--seq-len", "-4"],
    "not a number": ["--vocab-size", "lots"],
    "heads do not divide hidden": ["--hidden-dim", "64", "--num-heads", "3"],
    "odd head dim for rope": ["--hidden-dim", "36", "--num-heads", "4", "--kernel", "rope"],
    "unsupported flash head dim": ["--hidden-dim", "96", "--num-heads", "2"],
    "rows too wide for rmsnorm": ["--hidden-dim", "16384", "--num-heads", "128", "--kernel", "rmsnorm"],
    "json into a missing directory": ["--output-json", "/no/such/dir/out.json"],
    "unknown preset": ["--preset", "huge"],
    "unknown flag": ["--frobnicate"],
}


@pytest.mark.parametrize("flags", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_and_exit_2(flags, capsys):
    assert v3.main(flags) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_triton_profiling.py: error:"), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_bad_input_v4(capsys):
    assert v4.main(["--kernel", "rope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("run_kernel_benchmarks.py: error:")
    assert "add_rmsnorm, linear_cross_entropy, embedding, embedding_rmsnorm" in err


@CPU_ONLY
@pytest.mark.parametrize("script", [v3, v4], ids=["v3", "v4"])
def test_no_gpu_prints_one_line_and_times_nothing(script, tmp_path, capsys):
    # Not an error: the documents' GPU commands run as written on a laptop, recording the shape and timing nothing.
    code, report = run_json(script.main, tmp_path)
    assert code == 0 and report["timings"] == [] and report["checks"] == []
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("Use --check to verify the kernels in Triton's CPU interpreter.")
    assert "timing needs a GPU" in lines[0] and lines[1:] == [f"Wrote {tmp_path / 'out.json'}"]


@pytest.mark.parametrize("script", [v3, v4], ids=["v3", "v4"])
def test_sizes_that_cannot_fit_are_refused_before_any_tensor(script, capsys):
    # 2^32 tokens: every op's [tokens, hidden] tensors alone are terabytes.
    code = script.main(["--check", "--kernel", script.OPS[0].name, "--batch-size", "65536", "--seq-len", "65536"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "GiB of" in err[0] and "is available" in err[0]


@CPU_ONLY
@pytest.mark.parametrize("script, cwd", [("version3_triton/run_triton_profiling.py", "version3_triton"),
                                         ("version4_triton_ultra/run_kernel_benchmarks.py", ".")])
def test_scripts_run_standalone_and_enable_the_interpreter_themselves(script, cwd):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = REPO_ROOT / script
    result = subprocess.run([sys.executable, str(path), "--check", "--dtype", "float16", *TINY],
                            cwd=REPO_ROOT / cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "timing needs a GPU" in result.stdout and "Check: all within tolerance." in result.stdout


# ----------------------------------------------------------------------------------------------------------
# GPU: the real thing at the seed config
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("script", [v3, v4], ids=["v3", "v4"])
def test_check_and_timing_at_the_seed_config_gpu(script, dtype, tmp_path):
    code, report = run_json(script.main, tmp_path, "--check", "--dtype", dtype)
    assert code == 0
    assert report["shape"]["batch_size"] == 8 and report["shape"]["vocab_size"] == 1000
    assert all(row.get("ok") for row in report["checks"])
    assert report["timings"] and all(row["triton_us"] > 0 and row["pytorch_us"] > 0
                                     for row in report["timings"])
    assert report["triton_version"] and report["device"]["type"] == "cuda"
