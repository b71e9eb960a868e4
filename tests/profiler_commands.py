"""What the tests of run_pytorch_profiler.py and run_deepspeed_flops.py share: a one-layer model of width 32 (a
whole profiled training run takes a second or two), their main functions run in-process, one-line errors."""
import contextlib
import io
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = dict(batch=2, seq=16, hidden=32, heads=2, layers=1, ffn=64, vocab=64)
MODEL_FLAGS = ["--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--hidden-dim", "32",
               "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64", "--vocab-size", "64"]
TRAIN_FLAGS = MODEL_FLAGS + ["--num-steps", "4"]
FLOPS_FLAGS = MODEL_FLAGS + ["--timing-steps", "2", "--warmup-steps", "1"]


def run_main(main, spec, argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one in-process run."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(spec, [str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}, stderr {err!r}"
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def mkdir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path
