"""The peer rows and the per-preset runs of benchmarks/compare_versions.py (CPU, tiny sizes)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import comparison_rows  # noqa: E402
import make_readme_table  # noqa: E402
import variants  # noqa: E402

TINY_MODEL = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
              "--vocab-size", "300"]


def row(variant, first_loss, samples_per_s=100.0, preset="small"):
    return {"variant": variant, "preset": preset, "batch_size": 16, "seq_len": 256, "first_loss": first_loss,
            "final_loss": first_loss, "samples_per_s": samples_per_s}


def test_a_peer_that_computes_another_function_is_refused_and_a_version_is_reported():
    rows = [row("v1", 6.90), row("hf", 6.90), row("hf+liger", 7.50), row("v2", 7.50)]
    problems = comparison_rows.check_agreement(rows, "bfloat16")
    assert "error" not in rows[1]
    assert rows[2]["error"].startswith("refused: not the same function as v1 (first_loss 7.5000 vs v1 6.9000")
    assert len(problems) == 2 and problems[0].startswith("v2 small b16 s256: first_loss")


def test_rows_of_different_presets_are_never_compared():
    rows = [row("v1", 6.9, preset="tiny"), row("v1", 5.0, preset="small"), row("hf", 5.0, preset="small")]
    assert comparison_rows.check_agreement(rows, "bfloat16") == [] and "error" not in rows[2]


def test_default_variants():
    assert "v2+max-autotune" not in variants.default_variants(on_gpu=True)
    assert {"hf", "hf+compile", "hf+liger", "hf+liger+compile"} <= set(variants.default_variants(on_gpu=True))
    on_cpu = variants.default_variants(on_gpu=False)
    assert "hf" in on_cpu and not [v for v in on_cpu if "compile" in v or "liger" in v]


def test_the_preset_table_compares_each_row_with_the_fastest_other_one():
    results = {"environment": {"gpu": "G", "backend": "B", "torch": "t", "triton": "x"}, "dtype": "bfloat16",
               "num_steps": 30, "warmup_steps": 10, "repeats": 3, "command": "python benchmarks/compare_versions.py",
               "rows": [dict(row("v4", 6.9, 300.0), parameters=23e6, mfu=0.25, median_step_ms=1.0,
                             peak_memory_mib=10, kernels_per_step=90),
                        dict(row("hf+compile", 6.9, 200.0), mfu=0.2, median_step_ms=1.5, peak_memory_mib=12,
                             kernels_per_step=None),
                        {"variant": "hf+liger", "preset": "small", "batch_size": 16, "seq_len": 256,
                         "error": "not installed"}]}
    text = make_readme_table.render_presets(results, "x_presets_bfloat16.json")
    assert "`small` (23M parameters, batch 16, seq 256)" in text
    assert "| v4 | 300 | 1.00 | 25.0% | 1.50x | 10 | 90 |" in text
    assert "| hf+compile | 200 | 1.50 | 20.0% | 0.67x | 12 | n/a |" in text
    assert "| hf+liger | failed: not installed |" in text


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "small", "--batch-size", "4"], "--preset sets the batch size and sequence length itself"),
    (["--variants", "v1,hf+nothing"], "unknown variant(s) hf+nothing"),
    (["--variants", ","], "nothing to run"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = subprocess.run([sys.executable, "benchmarks/compare_versions.py", *argv], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_the_hf_script_without_transformers_says_how_to_install(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("hf_llama", REPO / "benchmarks" / "hf_llama.py")
    hf_llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_llama)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert hf_llama.main([*TINY_MODEL, "--num-steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -r requirements-peers.txt" in err[0]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_preset_run_with_the_hf_peer_on_cpu(tmp_path):
    out = tmp_path / "presets.json"
    command = [sys.executable, "benchmarks/compare_versions.py", "--preset", "tiny", "--variants", "v1,hf,hf+liger",
               "--num-steps", "3", "--warmup-steps", "1", "--device", "cpu", "--no-profile", "--output", str(out),
               "--", *TINY_MODEL, "--batch-size", "2", "--seq-len", "16"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr   # hf+liger cannot run on a CPU: a failed row
    saved = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in saved["rows"]}
    assert saved["preset"] == "tiny" and saved["dtype"] == "bfloat16"
    assert (by_variant["hf"]["batch_size"], by_variant["hf"]["seq_len"]) == (2, 16), "the shape that really ran"
    assert abs(by_variant["hf"]["first_loss"] - by_variant["v1"]["first_loss"]) < 2e-2 * by_variant["v1"]["first_loss"]
    assert "needs a GPU" in by_variant["hf+liger"]["error"]


def test_a_failed_row_says_the_exception_not_the_hint_printed_after_it():
    from benchmarks.training_runs import first_error_line
    output = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "torch._dynamo.exc.TorchRuntimeError: Dynamo failed to run FX node with fake tensors: addmm\n\n"
              "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're ...)\n")
    assert first_error_line(output, 1).startswith("torch._dynamo.exc.TorchRuntimeError: Dynamo failed")
    assert first_error_line("tiny_llama_v4.py: error: head dim 8 not supported\n", 2).endswith("not supported")
    assert first_error_line("", 137) == "exit code 137"
