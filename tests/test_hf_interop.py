"""python -m tinytransformer.hf export / import: a checkpoint becomes a Hugging Face model directory that
LlamaForCausalLM.from_pretrained loads with the same logits, and comes back as a checkpoint every version resumes.
Skipped where transformers or safetensors is not installed (CI installs both)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.config import ModelConfig
from tinytransformer.equivalence import canonical, random_batch
from tinytransformer.hf.__main__ import main as hf_main
from tinytransformer.training.checkpoint.files import checkpoint_path, list_checkpoints, save_atomically
from tinytransformer.training.checkpoint.loading import read_checkpoint

from .test_versions import model_class

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
REPO = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=97, hidden_dim=64, num_layers=2, num_heads=4, intermediate_size=96, max_seq_len=32)


@pytest.fixture
def checkpoint_dir(tmp_path):
    """A directory with one real checkpoint: written by version 1's training loop (two CPU steps)."""
    directory = tmp_path / "run"
    flags = ["--vocab-size", "97", "--hidden-dim", "64", "--num-layers", "2", "--num-heads", "4",
             "--intermediate-size", "96", "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "2",
             "--num-steps", "2", "--device", "cpu", "--save-every", "2", "--checkpoint-dir", str(directory)]
    result = subprocess.run([sys.executable, str(REPO / "version1_pytorch_baseline/tiny_llama_v1.py"), *flags],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return directory


def main(argv) -> int:
    """The command's exit code, whether it returns it or argparse ends it (--help, a bad flag)."""
    try:
        return hf_main(argv)
    except SystemExit as stop:
        return stop.code


def v1_logits(weights, inputs):
    model = model_class("v1")(CONFIG)
    model.load_canonical(weights)
    with torch.no_grad():
        return model(inputs)[0]


def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(checkpoint_dir, tmp_path, capsys):
    assert main(["export", "--checkpoint", str(checkpoint_dir), "--out", str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    weights = read_checkpoint(list_checkpoints(checkpoint_dir)[-1][1])["model"]
    inputs, _ = random_batch(CONFIG, batch=2, seq=16, device="cpu", seed=4)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=inputs).logits
    assert torch.allclose(hf_logits, v1_logits(weights, inputs), rtol=1e-5, atol=1e-5)

    assert main(["import", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = read_checkpoint(checkpoint_path(tmp_path / "back", 0))
    assert back["step"] == 0 and back["model"].keys() == weights.keys()
    assert all(torch.equal(back["model"][name], weights[name]) for name in weights)
    assert "train from it with any version" in capsys.readouterr().out


def test_an_imported_checkpoint_resumes_in_a_triton_version(tmp_path):
    """Any version trains from an imported model: version 4 (Triton interpreter) runs one step from it."""
    weights = canonical(CONFIG, seed=2)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    from tinytransformer.hf.convert import import_model, step_zero_checkpoint
    save_atomically(step_zero_checkpoint(CONFIG, weights), checkpoint_path(tmp_path / "ckpt", 0))
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(hf_dir)]) == 0
    import_model(hf_dir, tmp_path / "imported")
    flags = ["--vocab-size", "97", "--hidden-dim", "64", "--num-layers", "2", "--num-heads", "4",
             "--intermediate-size", "96", "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "2",
             "--num-steps", "1", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "imported"),
             "--resume", "auto"]
    # A CPU run of version 4 asks for Triton's interpreter: on a GPU machine the kernels would be compiled for the
    # GPU and the script would refuse --device cpu.
    result = subprocess.run([sys.executable, str(REPO / "version4_triton_ultra/tiny_llama_v4.py"), *flags],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    assert "resumed     : from" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["export", "--checkpoint", "no/such/dir", "--out", "x"], "no such file or directory"),
    (["import", "--model", ".", "--out", "x"], "no config.json"),
    (["export"], "the following arguments are required"),
    (["nonsense"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_an_existing_output_is_never_overwritten(checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(checkpoint_dir), "--out", str(out)]) == 2
    assert (out / "keep.txt").read_text() == "mine" and "already exists" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".taken")], "no staging directory left behind"
