"""Every script's --help shows each default once: the harness's flags default to None and state their default
as [value] in the help text, which argparse's ArgumentDefaultsHelpFormatter followed with "(default: None)"."""
import contextlib
import importlib
import io
import runpy
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


SCRIPTS = sorted(p for p in REPO_ROOT.rglob("*.py")
                 if p.relative_to(REPO_ROOT).parts[0] not in ("tests", ".git")
                 and 'if __name__ == "__main__"' in p.read_text())


def help_text(script: Path) -> str:
    """`python SCRIPT --help`, run in this process (a child process per script would cost seconds each)."""
    out, argv, path = io.StringIO(), sys.argv, list(sys.path)
    sys.argv = [str(script), "--help"]
    sys.path.insert(0, str(script.parent))   # as `python SCRIPT` does
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            parts = script.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[0] == "tinytransformer":   # `python -m tinytransformer.PACKAGE.NAME` calls its main()
                importlib.import_module(".".join(parts)).main(["--help"])
            else:
                runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    assert exit_.value.code in (0, None)
    return out.getvalue()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_help_shows_each_default_once(script):
    text = help_text(script)
    assert "usage:" in text
    assert "(default: None)" not in text
    # One entry per option: a line that starts with "  -", and its continuation lines.
    entries, current = [], []
    for line in text.splitlines():
        if line.startswith("  -") and current:
            entries.append(" ".join(current))
            current = []
        current.append(line.strip())
    entries.append(" ".join(current))
    for entry in entries:
        assert entry.count("(default") <= 1, entry
        assert not ("(default:" in entry and "] (default" in entry), entry   # [value] and argparse's both


def test_the_help_lists_every_script():
    names = {str(p.relative_to(REPO_ROOT)) for p in SCRIPTS}
    assert {"sample.py", "version4_triton_ultra/tiny_llama_v4.py", "benchmarks/compare_versions.py",
            "version1_pytorch_baseline/run_pytorch_profiler.py"} <= names
