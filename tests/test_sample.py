"""sample.py: text from a trained checkpoint, deterministic for a fixed seed, loadable into any version."""
import subprocess
import sys
from pathlib import Path

import pytest

import sample
from tinytransformer.training.checkpoint.files import checkpoint_path
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--batch-size", "8", "--seq-len", "32", "--device", "cpu", "--learning-rate", "1e-2"]
TEXT = b"the cat sat on the mat. the dog sat on the log. " * 60


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory) -> Path:
    """A tiny byte-level model trained long enough on a small text to continue its pattern."""
    tmp = tmp_path_factory.mktemp("text")
    corpus = tmp / "cats.txt"
    corpus.write_bytes(TEXT)
    assert v1_main(TINY + ["--vocab-size", "256", "--data", f"text:{corpus}", "--num-steps", "150",
                           "--save-every", "150", "--checkpoint-dir", str(tmp / "c")]) == 0
    return checkpoint_path(tmp / "c", 150)


@pytest.fixture(scope="module")
def markov_checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("markov")
    assert v1_main(TINY + ["--vocab-size", "300", "--num-steps", "5", "--save-every", "5",
                           "--checkpoint-dir", str(tmp / "c")]) == 0
    return checkpoint_path(tmp / "c", 5)


def sample_bytes(capsysbinary, *argv) -> bytes:
    code = sample.main([str(a) for a in argv])
    captured = capsysbinary.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_sampling_is_deterministic_for_a_fixed_seed(text_checkpoint, capsysbinary):
    args = ["--checkpoint", text_checkpoint, "--prompt", "the ", "--max-new-tokens", "40", "--device", "cpu"]
    first = sample_bytes(capsysbinary, *args, "--seed", "7")
    again = sample_bytes(capsysbinary, *args, "--seed", "7")
    assert first == again
    # Two seeds must draw different bytes somewhere. The trained model is so sure of this tiny text that at
    # temperature 1 two seeds can write the same 40 bytes; at temperature 2 its distribution is flat enough.
    hot = [*args, "--temperature", "2.0"]
    assert sample_bytes(capsysbinary, *hot, "--seed", "7") != sample_bytes(capsysbinary, *hot, "--seed", "8")
    assert first.startswith(b"the ") and len(first) == len(b"the ") + 40 + 1   # prompt, 40 bytes, newline
    assert sample_bytes(capsysbinary, *args, "--top-k", "3", "--temperature", "0.5", "--seed", "1") == \
        sample_bytes(capsysbinary, *args, "--top-k", "3", "--temperature", "0.5", "--seed", "1")


def test_greedy_sampling_continues_the_training_text(text_checkpoint, capsysbinary):
    out = sample_bytes(capsysbinary, "--checkpoint", text_checkpoint, "--prompt", "the cat sat on the ",
                       "--max-new-tokens", "20", "--temperature", "0", "--device", "cpu")
    generated = out[len(b"the cat sat on the "):-1]
    words = set(TEXT.split())
    produced = generated.split()
    assert produced and sum(w in words for w in produced) >= len(produced) - 1, out   # the corpus's words


def test_any_version_samples_the_same_greedy_text(text_checkpoint, capsysbinary):
    args = ["--checkpoint", text_checkpoint, "--prompt", "the dog ", "--max-new-tokens", "30",
            "--temperature", "0", "--device", "cpu"]
    assert sample_bytes(capsysbinary, *args) == sample_bytes(capsysbinary, *args, "--version", "v2")


def test_a_directory_means_its_newest_checkpoint(text_checkpoint, tmp_path, capsysbinary):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / text_checkpoint.name).write_bytes(text_checkpoint.read_bytes())
    (tmp_path / "c" / "ckpt_step99999999.pt").write_bytes(b"damaged")   # newer, but unreadable: skipped
    args = ["--prompt", "the ", "--max-new-tokens", "12", "--seed", "2", "--device", "cpu"]
    assert sample_bytes(capsysbinary, "--checkpoint", tmp_path / "c", *args) == \
        sample_bytes(capsysbinary, "--checkpoint", text_checkpoint, *args)


def test_markov_checkpoint_prints_token_ids(markov_checkpoint, capsysbinary):
    out = sample_bytes(capsysbinary, "--checkpoint", markov_checkpoint, "--prompt", "3 17",
                       "--max-new-tokens", "10", "--device", "cpu").decode()
    ids = [int(token) for token in out.split()]
    assert ids[:2] == [3, 17] and len(ids) == 12 and all(0 <= i < 300 for i in ids)


@pytest.mark.parametrize("argv", [
    ["--checkpoint", "/no/such/checkpoint.pt"],
    ["--checkpoint", "{tmp}/junk.pt"],
    ["--checkpoint", "{tmp}"],
    ["--checkpoint", "{markov}", "--prompt", "not ids"],
    ["--checkpoint", "{markov}", "--prompt", "5 300"],
    ["--checkpoint", "{markov}", "--temperature", "-1"],
])
def test_bad_input_is_one_line_and_exit_2(argv, markov_checkpoint, tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"\x00" * 100)
    argv = [a.format(tmp=tmp_path, markov=markov_checkpoint) for a in argv]
    try:
        code = sample.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "error" in err[0] and "Traceback" not in err[0]


def test_sample_script_in_a_real_process(text_checkpoint):
    command = [sys.executable, "sample.py", "--checkpoint", str(text_checkpoint), "--prompt", "the ",
               "--max-new-tokens", "16", "--seed", "3", "--device", "cpu"]
    runs = [subprocess.run(command, cwd=REPO_ROOT, capture_output=True, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs)
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith(b"the ")
    assert b"sampled 16 tokens" in runs[0].stderr
