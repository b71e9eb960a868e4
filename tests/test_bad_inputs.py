"""Bad input: one clear line on stderr and exit code 2, never a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY = ["--num-steps", "2", "--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1",
        "--intermediate-size", "64", "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16",
        "--device", "cpu"]


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


BAD_INPUTS = {
    "heads do not divide hidden": lambda t: ["--num-heads", "7"],
    "seq-len above max": lambda t: ["--seq-len", "256"],
    "zero batch": lambda t: ["--batch-size", "0"],
    "negative batch": lambda t: ["--batch-size", "-3"],
    "zero hidden": lambda t: ["--hidden-dim", "0"],
    "negative layers": lambda t: ["--num-layers", "-1"],
    "non-integer steps": lambda t: ["--num-steps", "abc"],
    "negative learning rate": lambda t: ["--learning-rate", "-1"],
    "odd head dim": lambda t: ["--hidden-dim", "250", "--num-heads", "2"],
    "warm-up longer than run": lambda t: ["--num-steps", "5", "--warmup-steps", "10"],
    "unknown --data": lambda t: ["--data", "bogus"],
    "empty text path": lambda t: ["--data", "text:"],
    "missing text file": lambda t: ["--data", "text:/no/such/file.txt"],
    "text path is a directory": lambda t: ["--data", f"text:{t}"],
    "text file too short": lambda t: ["--data", "text:" + write(t, "short.txt", "hello"), "--vocab-size", "256"],
    "text with vocab below 256": lambda t: ["--data", "text:" + write(t, "a.txt", "x" * 5000), "--vocab-size", "100"],
    "unreadable --config": lambda t: ["--config", "/no/such/config.yaml"],
    "--config not YAML": lambda t: ["--config", write(t, "bad.yaml", "model: [unclosed")],
    "--config unknown key": lambda t: ["--config", write(t, "k.yaml", "model:\n  hidden_size: 12\n")],
    "--config not a mapping": lambda t: ["--config", write(t, "l.yaml", "- 1\n- 2\n")],
    "--config binary junk": lambda t: ["--config", write(t, "junk.yaml", bytes(range(256)))],
    "unknown preset": lambda t: ["--preset", "gigantic"],
    "unknown flag": lambda t: ["--frobnicate"],
    "bad amp dtype": lambda t: ["--amp-dtype", "float8"],
    "bad device": lambda t: ["--device", "tpu"],
    "bad sort key": lambda t: ["--sort-by", "speed"],
    "float16 autocast on CPU": lambda t: ["--use-amp", "--amp-dtype", "float16", "--device", "cpu"],
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_and_exit_2(case, tmp_path, capsys):
    argv = TINY + BAD_INPUTS[case](tmp_path)
    try:
        code = v1_main(argv)
    except SystemExit as exit_:   # argparse errors leave through SystemExit
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{case}: exit code {code}, stderr {err!r}"
    assert len(lines) == 1, f"{case}: expected one line on stderr, got {lines}"
    assert "error" in lines[0] and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_gpu_is_one_line(capsys):
    code = v1_main(TINY + ["--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no GPU" in err[0]


def test_bad_input_in_a_real_process():
    """The same contract end to end: the script as a user starts it."""
    script = REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"
    result = subprocess.run([sys.executable, str(script), "--num-heads", "7"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "num_heads (7) must divide hidden_dim (256)" in result.stderr
