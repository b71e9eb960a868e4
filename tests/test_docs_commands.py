"""Every shell command shown in the repository's markdown files runs (on the CPU, at a tiny size), every block of
commands says whether it is meant for a CPU or a GPU, and every CPU block runs as written in the time it states.

Labels: where a block is meant to run
  The first line of every fenced block whose commands run one of the workshop's scripts (a .py or .sh file of
  the repository outside tests/, started by python, bash, sh, source, directly, or by torchrun and the like) is a
  comment in one of two forms:
      # CPU (2 cores: about 40 s)    the block runs as written, from its document's directory, on a machine with
                                     2 CPU cores and no GPU, in about that long in all ("about N s" or
                                     "about N min"); each command in it takes about a minute at most
      # GPU                          the block is meant for a GPU (NVIDIA or AMD): on a CPU it would take far
      # GPU (H100: about 30 s)       longer, or measure nothing; a measured GPU time may follow in parentheses
  A document that shows a version only at GPU sizes shows a CPU block beside it (small sizes, few steps; for
  versions 3 and 4, head dims of 16 to 128, the sizes their Triton kernels accept). A reader without a GPU runs
  the CPU blocks only, so a CPU block never depends on what a GPU block writes.
  test_workshop_commands_are_labelled checks the labels (fast, in the default run);
  test_cpu_block_runs_as_written (-m slow) runs every CPU block as written (no smoke-size substitution,
  CUDA_VISIBLE_DEVICES="", in document order in one copy of the repository), each command within
  CPU_COMMAND_LIMIT_S and the block within CPU_TIME_FACTOR times its stated time, and prints the times.

What is a command
  Each fenced block tagged bash, sh, shell or zsh is read line by line: lines ending in a backslash are joined,
  blank lines and whole-line comments are dropped, a leading "$ " prompt is removed, and lines are gathered
  until they form one complete shell command (bash -n decides for loops, if-blocks, here-documents and open
  quotes). In a block with any other tag (console, text, ...), only lines that start with "$ " are commands.
  Blocks inside HTML comments (<!-- ... -->) are ignored. Files: every *.md of the repository, found with
  git's file list (tracked plus untracked-but-not-ignored, so reports written into ignored output
  directories are left out) or, without git, by walking the tree; hidden directories and tests/fixtures/ are
  left out. Documents are discovered, not listed: a new README is tested as soon as it exists.

Where a command runs
  In a temporary copy of the repository (the same file list), from the directory of its markdown file.
  A copy rather than the working tree, because (1) the outputs of one command are the inputs of the next
  ("profile, then analyse the profile"), which rewriting output flags cannot follow; (2) scripts that find
  their output directory from their own location (committed benchmark results, for instance) would
  overwrite files of the real tree; (3) other people edit the tree while tests run. Commands of one block run
  one after another; the block's earlier state-changing commands (cd, export, pushd, VAR=value, ...) are
  replayed before each command, so "cd version2_pytorch_fused" followed by "bash run_all_profilers.sh"
  works. Each block starts again from the markdown file's directory. A command whose document's earlier
  commands have not run in this process (`pytest -k` chose it alone; pytest-xdist gave them to another worker)
  runs them first, since it may read what they wrote. A command passes when it exits with 0
  (diff: 0 or 1) under `set -o pipefail`, within DOCS_COMMAND_TIMEOUT seconds (default 300).

The smoke-size substitution (what makes a 100-step GPU command a 3-second CPU command; test_doc_command)
  The environment of every command has WORKSHOP_SMOKE=1, TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES=""
  (so even on a GPU machine everything runs on the CPU; under pytest-xdist also OMP_NUM_THREADS, each worker's
  share of the cores), and `python`, `python3`, `python3.X` and $PYTHON
  are a small shim placed first on PATH. When the shim is asked to run a script named tiny_llama_v*.py or
  run_*.py (also when a shell wrapper such as run_all_profilers.sh starts it), it rewrites the script's flags with
  `smoke_argv` below: the values of the flags in SMOKE_FLAGS that are present are replaced, the missing
  ones are added (only those the script's --help lists), and a few flags that must stay consistent with
  them (REPLACE_ONLY_FLAGS, e.g. --warmup-steps) are replaced when present. A --help run is left alone.
  Every other program runs unchanged.

What is skipped (each skip appears in `pytest -rs` with its file, line and reason)
  - commands that need a GPU vendor tool (rocprofv3, rocprof-sys-run, rocprof-compute, nsys, ncu,
    rocm-smi, nvidia-smi, ...), directly or through our wrapper scripts named after them (their --help
    runs);
  - long-running servers (tensorboard, jupyter, watch, python -m http.server);
  - installation (pip, conda, apt, .ci/run), exercised by CI's .ci/run instead, and anything run with sudo;
  - the whole test suite (pytest without explicit test files, or naming this file): it contains this test;
    .ci/run runs it;
  - commands that need the network (git clone, curl, wget);
  - blocks preceded by the marker <!-- doc-test: skip REASON --> (say why in REASON).
  test_few_commands_are_skipped prints the list and requires that fewer than 10% of all commands are skipped
  for reasons other than installation and the whole test suite (those two run in CI's .ci/run): a document
  should mostly show commands that a student can run anywhere. Show the exact command line of a
  vendor tool that a wrapper issues in a ```text block ("what the wrapper runs"), not in a bash block.
"""
from __future__ import annotations

import os

import pytest

from .doc_commands import (COVERED_BY_CI, DOC_COMMANDS, MAX_SKIPPED_FRACTION, REPO, DocCommand, copy_repository,
                           failure_of, is_pytest, shell_tokens, simple_commands)
from .doc_shim import write_python_shim


@pytest.fixture(scope="session")
def docs_sandbox(tmp_path_factory):
    """(a copy of the repository, the environment the commands run with)."""
    root = tmp_path_factory.mktemp("docs_commands")
    repo = copy_repository(root)
    shims = write_python_shim(root / "bin")
    env = dict(os.environ)
    for name in ("TT_NVTX", "PYTHONPATH"):
        env.pop(name, None)
    env.update({
        "PATH": f"{shims}{os.pathsep}{env.get('PATH', '')}",
        "PYTHON": str(shims / "python3"),
        "WORKSHOP_SMOKE": "1",
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HIP_VISIBLE_DEVICES": "",
        "MPLBACKEND": "Agg",
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    env.update(thread_share_of_one_worker())
    return repo, env


def thread_share_of_one_worker() -> dict:
    """Under pytest-xdist (`-n N`), each worker's commands get an even share of the machine's cores for torch's CPU
    threads. Otherwise every command of N workers starts a thread per core, and N times more threads than cores
    can slow a block of many short runs past DOCS_COMMAND_TIMEOUT. A single process (CI), or a thread count
    set by the caller, is left alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}


def as_param(command: DocCommand):
    """Commands of the exercises (about two thirds of all, mostly the guides' commands at more sizes) are marked
    slow, so the default test run stays short on a 2-core CI machine; `pytest -m slow` runs them."""
    marks = [pytest.mark.slow] if "/exercises/" in command.where else []
    return pytest.param(command, marks=marks, id=command.where)


@pytest.fixture(scope="session")
def ran_in_sandbox() -> set:
    """The commands (their `where`) this process has run in its docs_sandbox, passed or not."""
    return set()


@pytest.mark.parametrize("command", [as_param(c) for c in DOC_COMMANDS])
def test_doc_command(command: DocCommand, docs_sandbox, ran_in_sandbox):
    if command.skip:
        pytest.skip(f"{command.where}: {command.skip}: {command.short(80)}")
    repo, env = docs_sandbox
    run_the_earlier_commands_of_its_document(command, repo, env, ran_in_sandbox)
    ran_in_sandbox.add(command.where)
    failure = failure_of(command, repo, env)
    if failure:
        pytest.fail(failure, pytrace=False)


def run_the_earlier_commands_of_its_document(command: DocCommand, repo, env, ran: set,
                                             in_order: list = DOC_COMMANDS) -> None:
    """A command may read what an earlier command of its document wrote (train, then sample from the checkpoint).
    In a whole run, in order, those have already run here; when they have not (`pytest -k` chose this command alone,
    or pytest-xdist gave them to another worker, whose copy of the repository this one does not see), they run
    first, and this command's test fails if one of them does."""
    for earlier in in_order:
        if earlier is command:
            return
        if earlier.path != command.path or earlier.skip or earlier.where in ran:
            continue
        ran.add(earlier.where)
        failure = failure_of(earlier, repo, env)
        if failure:
            pytest.fail(f"{earlier.where}, run first because {command.where} may need what it writes, failed:\n"
                        + failure, pytrace=False)


def test_a_command_alone_first_runs_the_earlier_commands_of_its_document_and_fails_with_them(tmp_path):
    write = DocCommand("guide.md", 3, "echo trained > model.txt", [], None)
    other_document = DocCommand("other.md", 3, "exit 1", [], None)
    skipped = DocCommand("guide.md", 5, "nvidia-smi", [], "needs a GPU tool")
    read = DocCommand("guide.md", 7, "grep -q trained model.txt", [], None)
    in_order = [write, other_document, skipped, read]
    ran = set()
    run_the_earlier_commands_of_its_document(read, tmp_path, dict(os.environ), ran, in_order)
    assert ran == {"guide.md:3"} and (tmp_path / "model.txt").read_text() == "trained\n"
    (tmp_path / "model.txt").unlink()
    run_the_earlier_commands_of_its_document(read, tmp_path, dict(os.environ), ran, in_order)
    assert not (tmp_path / "model.txt").exists(), "a command that already ran here ran again"

    broken = DocCommand("guide.md", 3, "exit 3", [], None)
    with pytest.raises(pytest.fail.Exception, match="guide.md:3, run first because guide.md:7"):
        run_the_earlier_commands_of_its_document(read, tmp_path, dict(os.environ), set(), [broken, read])


def test_xdist_workers_share_the_cores_and_a_single_process_is_left_alone(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert thread_share_of_one_worker() == {}
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
    assert thread_share_of_one_worker() == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "32")
    assert thread_share_of_one_worker() == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert thread_share_of_one_worker() == {}


def test_few_commands_are_skipped():
    """Documents should show commands that run anywhere; fewer than 10% may need a GPU tool, a server, ...

    Installation and whole-test-suite commands are skipped here but run by CI (.ci/run), so they are listed
    and not counted against the 10%.
    """
    assert DOC_COMMANDS, "no shell commands found in any markdown file"
    skipped = [c for c in DOC_COMMANDS if c.skip]
    by_ci = [c for c in skipped if c.skip.startswith(COVERED_BY_CI)]
    uncovered = [c for c in skipped if c not in by_ci]
    print(f"\n{len(DOC_COMMANDS)} commands in {len({c.path for c in DOC_COMMANDS})} markdown files; "
          f"{len(by_ci)} skipped here but run by CI, {len(uncovered)} not run anywhere automatically:")
    for c in by_ci + uncovered:
        print(f"  {c.where}: {c.skip}: {c.short(70)}")
    fraction = len(uncovered) / len(DOC_COMMANDS)
    assert fraction < MAX_SKIPPED_FRACTION, (
        f"{len(uncovered)} of {len(DOC_COMMANDS)} documented commands ({fraction:.0%}) cannot run in this test; "
        f"keep it under {MAX_SKIPPED_FRACTION:.0%}: show vendor-tool command lines in ```text blocks, or add "
        "commands that run anywhere")


def test_readme_test_command_is_what_ci_runs():
    """The README's test command and the one .ci/run executes are the same (python or python3)."""
    readme, ci = REPO / "README.md", REPO / ".ci" / "run"
    if not readme.is_file() or not ci.is_file():
        pytest.skip("README.md or .ci/run is missing")
    normalise = lambda s: " ".join(s.replace("python3 ", "python ").split())  # noqa: E731
    readme_tests = [normalise(c.text) for c in DOC_COMMANDS
                    if c.path == "README.md" and any(is_pytest(w) for w in simple_commands(shell_tokens(c.text)))]
    assert readme_tests, "README.md shows no pytest command in a ```bash block"
    ci_lines = {normalise(line) for line in ci.read_text().splitlines() if not line.lstrip().startswith("#")}
    missing = [t for t in readme_tests if t not in ci_lines]
    assert not missing, f".ci/run does not run the README's test command(s) {missing}"
