"""Running one of version 4's scripts as a user would, to check how it refuses what it cannot do."""
import subprocess
import sys
from pathlib import Path

VERSION4 = Path(__file__).resolve().parent.parent / "version4_triton_ultra"


def assert_refused_in_one_line(script: str, flags: list) -> str:
    """`python version4_triton_ultra/<script> <flags>` exits with status 2 and one line on stderr, which starts
    with "<script>: error:" (argparse's form). Returns that line."""
    result = subprocess.run([sys.executable, str(VERSION4 / script), *flags], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{script}: error:"), result.stderr
    return result.stderr
