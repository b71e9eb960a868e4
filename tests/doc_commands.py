"""The documented commands of the whole repository, classified (run, or skip with a reason), grouped into
labelled blocks, and the way each one runs (see test_docs_commands.py's docstring)."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from .doc_blocks import Block, block_commands, fenced_blocks, markdown_files, repository_files, shell_tokens
from .doc_shim import split_python_argv

REPO = Path(__file__).resolve().parent.parent
# The test files that run documented commands: a documented pytest command naming one of them would run the
# documents' commands again from inside a documented command.
DOC_TEST_FILES = ("test_docs_commands.py", "test_docs_cpu_blocks.py", "test_docs_gpu_blocks.py")
TIMEOUT_S = int(os.environ.get("DOCS_COMMAND_TIMEOUT", "300"))
MAX_SKIPPED_FRACTION = 0.10


# ------------------------------------------------------------------------------------------------------
# Classification: run, or skip with a reason
# ------------------------------------------------------------------------------------------------------
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")", "{", "}", "\n", ";;", "!", "do", "then", "else", "elif"}
PREFIX_WORDS = {"time", "nohup", "exec", "command", "builtin"}
GPU_TOOLS = {"rocprofv3", "rocprofv2", "rocprof", "rocprof-sys-run", "rocprof-sys-instrument",
             "rocprof-sys-sample", "rocprof-sys-avail", "rocprof-sys-causal", "rocprof-compute", "omniperf",
             "omnitrace", "nsys", "ncu", "nsight-sys", "ncu-ui", "nvidia-smi", "rocm-smi", "amd-smi",
             "rocminfo", "rocprofiler-compute"}
WRAPPER_TOOLS = {"run_rocprofv3.sh": "rocprofv3", "run_rocprof_triton.sh": "rocprofv3",
                 "run_rocprof_sys.sh": "rocprof-sys-run", "run_rocprof_compute.sh": "rocprof-compute",
                 "run_nsys.sh": "nsys", "run_ncu.sh": "ncu"}
SERVERS = {"tensorboard", "jupyter", "jupyter-lab", "watch", "top", "htop", "nvtop"}
SERVER_MODULES = {"tensorboard", "tensorboard.main", "http.server", "jupyter", "notebook", "jupyterlab"}
# Skip reasons of commands that .ci/run exercises: not counted against MAX_SKIPPED_FRACTION.
COVERED_BY_CI = ("installation", "runs the whole test suite")
INSTALLERS = {"pip", "pip3", "conda", "mamba", "apt", "apt-get", "yum", "dnf", "brew", "uv"}
NETWORK = {"curl", "wget"}
STATE_WORDS = {"cd", "pushd", "popd", "export", "unset", "source", ".", "set", "shopt", "alias"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def simple_commands(tokens: list[str]) -> list[list[str]]:
    """The simple commands of a token list: [command word, arguments...], prefixes and VAR=x removed."""
    commands, current = [], []
    for token in tokens:
        if token in SEPARATORS or (not current and token in PREFIX_WORDS):
            if current:
                commands.append(current)
            current = []
            continue
        if not current and ASSIGNMENT.match(token):
            continue
        if not current and token == "env":
            continue
        current.append(token)
    if current:
        commands.append(current)
    return commands


def is_pytest(words: list[str]) -> bool:
    name = os.path.basename(words[0])
    if name in ("pytest", "py.test"):
        return True
    return name.startswith("python") and "-m" in words and words[words.index("-m") + 1:][:1] == ["pytest"]


def pytest_targets(words: list[str]) -> list[str]:
    start = words.index("pytest") + 1 if "pytest" in words else 1
    targets, skip_next = [], False
    for word in words[start:]:
        if skip_next:
            skip_next = False
            continue
        if word in ("-m", "-k", "-p", "-c", "--rootdir", "--timeout", "--maxfail", "-n"):
            skip_next = True
            continue
        if not word.startswith("-"):
            targets.append(word)
    return targets


def skip_reason(text: str) -> str | None:
    """Why a command cannot run in this test, or None when it can."""
    try:
        tokens = shell_tokens(text)
    except ValueError:
        return None   # an unbalanced quote: let bash report it
    for words in simple_commands(tokens):
        name = os.path.basename(words[0])
        if name == "sudo":
            return "needs root (sudo)"
        wants_help = "--help" in words or "-h" in words
        if name in GPU_TOOLS and not wants_help:
            return f"needs the GPU vendor tool {name}"
        if name in SERVERS:
            return f"long-running server or monitor ({name})"
        if name in INSTALLERS or (name.startswith("python") and words[1:3] == ["-m", "pip"]):
            return "installation (exercised by CI: .ci/run)"
        if name in NETWORK or (name == "git" and words[1:2] == ["clone"]):
            return "needs the network"
        if name.startswith("python") and "-m" in words and words[words.index("-m") + 1:][:1]:
            module = words[words.index("-m") + 1]
            if module in SERVER_MODULES:
                return f"long-running server ({module})"
        if is_pytest(words):
            targets = pytest_targets(words)
            if not targets or any(any(f in t for f in DOC_TEST_FILES) or not t.endswith(".py") and "::" not in t
                                  for t in targets):
                return "runs the whole test suite, which contains this test (CI runs it: .ci/run)"
        scripts = [w for w in words[1:] if not w.startswith("-")][:1] if name in ("bash", "sh", "source", ".") \
            else [words[0]]
        for script in scripts:
            base = os.path.basename(script)
            if base == "run" and script.rstrip("/").endswith(".ci/run"):
                return "installation (exercised by CI: .ci/run)"
            if base in WRAPPER_TOOLS and not wants_help:
                return f"needs the GPU vendor tool {WRAPPER_TOOLS[base]} (through {base})"
    return None


def is_state_change(text: str) -> bool:
    """cd, export, VAR=value, ...: replayed before the later commands of the same block."""
    try:
        tokens = shell_tokens(text)
    except ValueError:
        return False
    if not tokens or any(t in ("|", "&&", "||", "&") for t in tokens):
        return False
    words = simple_commands(tokens)
    if not words:   # only VAR=value assignments
        return any(ASSIGNMENT.match(t) for t in tokens)
    return all(w[0] in STATE_WORDS for w in words)


@dataclasses.dataclass
class DocCommand:
    path: str           # markdown file, relative to the repository
    line: int
    text: str
    prelude: list       # state-changing commands of the same block that come before this one
    skip: str | None
    block: Block | None = None   # the fenced block it comes from

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def short(self, width: int = 100) -> str:
        one_line = " ".join(self.text.split())
        return one_line if len(one_line) <= width else one_line[: width - 3] + "..."


def collect_commands() -> list[DocCommand]:
    commands = []
    for path in markdown_files():
        text = (REPO / path).read_text(encoding="utf-8", errors="replace")
        for block in fenced_blocks(path, text):
            prelude = []
            for line, command in block_commands(block):
                reason = f"marked in the document: {block.skip_reason}" if block.skip_reason else skip_reason(command)
                commands.append(DocCommand(path, line, command, list(prelude), reason, block))
                if is_state_change(command):
                    prelude.append(command)
    return commands


DOC_COMMANDS = collect_commands()



# ------------------------------------------------------------------------------------------------------
# Labels: where a block of commands is meant to run
# ------------------------------------------------------------------------------------------------------
CPU_LABEL = re.compile(r"^# CPU \(2 cores: about (\d+(?:\.\d+)?) (s|min)\)$")
GPU_LABEL = re.compile(r"^# GPU(?: \([^()]*\))?$")
GPU_TIMED_LABEL = re.compile(r"^# GPU \(H100: about (\d+(?:\.\d+)?) (s|min)\)$")   # measured: test_docs_gpu_blocks.py
LABEL_FORMS = "'# CPU (2 cores: about N s)', '# CPU (2 cores: about N min)', '# GPU' or '# GPU (...)'"
CPU_COMMAND_LIMIT_S = 90   # one command of a CPU block, as written, on a 2-core machine
CPU_TIME_FACTOR = 2        # a CPU block may take up to this multiple of the time its label states ...
CPU_TIME_SLACK_S = 5       # ... plus this (start-up times of a few seconds vary the most)
LAUNCHERS = {"torchrun", "deepspeed", "sbatch", "srun", "mpirun"}


def workshop_file_names() -> dict[str, str]:
    """{file name: path} of the workshop's scripts: the repository's .py and .sh files outside tests/."""
    return {Path(name).name: name for name in repository_files()
            if name.endswith((".py", ".sh")) and not name.startswith("tests/")}


WORKSHOP_FILES = workshop_file_names()


def workshop_scripts(text: str) -> list[str]:
    """The workshop's scripts that a command runs: a repository .py file run by python (as a file or with -m),
    a repository .sh file run by bash / sh / source or directly, or either started by torchrun and the like."""
    try:
        commands = simple_commands(shell_tokens(text))
    except ValueError:
        return []
    found = []
    for words in commands:
        name = os.path.basename(words[0])
        candidates = []
        if name.startswith("python"):
            _, target, _ = split_python_argv(words[1:])
            if target is not None:
                candidates = [target[1].replace(".", "/") + ".py"] if target[0] == "-m" else [target[0]]
        elif name in ("bash", "sh", "source", "."):
            candidates = [w for w in words[1:] if not w.startswith("-")][:1]
        elif name in LAUNCHERS:
            candidates = [w for w in words[1:] if w.endswith((".py", ".sh"))][:1]
        else:
            candidates = [words[0]]
        found += [os.path.basename(c) for c in candidates if os.path.basename(c) in WORKSHOP_FILES
                  and c.endswith((".py", ".sh"))]
    return found


def label_of(block: Block) -> tuple[str | None, float | None]:
    """("cpu", seconds the label states) or ("gpu", None) from the block's first line; (None, None) without."""
    first = block.lines[0][1].strip() if block.lines else ""
    cpu = CPU_LABEL.match(first)
    if cpu:
        return "cpu", float(cpu.group(1)) * (60 if cpu.group(2) == "min" else 1)
    if GPU_LABEL.match(first):
        return "gpu", None
    return None, None


def blocks_of(commands: list[DocCommand]) -> list[tuple[Block, list[DocCommand]]]:
    """The blocks that hold commands, in document order, each with its commands."""
    grouped: dict[int, tuple[Block, list[DocCommand]]] = {}
    for command in commands:
        grouped.setdefault(id(command.block), (command.block, []))[1].append(command)
    return list(grouped.values())


DOC_BLOCKS = blocks_of(DOC_COMMANDS)
CPU_BLOCKS = [(block, commands) for block, commands in DOC_BLOCKS if label_of(block)[0] == "cpu"]



# ------------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------------
def allowed_exit_codes(text: str) -> set[int]:
    try:
        words = simple_commands(shell_tokens(text))
    except ValueError:
        return {0}
    if len(words) == 1 and os.path.basename(words[0][0]) == "diff":
        return {0, 1}   # diff exits 1 when the files differ, which is what a document usually shows
    return {0}


def run_command(command: DocCommand, repo: Path, env: dict,
                timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one command (after its block's earlier state changes) with bash, from its document's directory. On
    timeout the command's whole process group is stopped (not only bash: the scripts it started too), then
    subprocess.TimeoutExpired is raised."""
    script = "\n".join(["set -o pipefail", *command.prelude, command.text]) + "\n"
    cwd = repo / Path(command.path).parent
    with subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, stdin=subprocess.DEVNULL, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def failure_of(command: DocCommand, repo: Path, env: dict, timeout: float = TIMEOUT_S) -> str | None:
    """Runs the command: None when it passes, else the report of how it failed (its exit code and output, or
    that it was still running after timeout seconds)."""
    try:
        result = run_command(command, repo, env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{command.where}: still running after {timeout} s: {command.short()}"
    if result.returncode not in allowed_exit_codes(command.text):
        return failure_report(command, result)
    return None


def failure_report(command: DocCommand, result, tail: int = 40) -> str:
    output = (result.stdout + result.stderr).splitlines()
    return textwrap.dedent(f"""\
        {command.where}: exit code {result.returncode}
        command (run from {Path(command.path).parent.as_posix() or '.'}/ in a copy of the repository):
        {command.text}
        last {min(tail, len(output))} lines of its output:
        """) + "\n".join(output[-tail:])


def python_shims(root: Path) -> Path:
    """root/bin holding `python` and `python3` that start the interpreter running the tests (put it first on
    PATH): a documented command then runs with the packages the tests see."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def copy_repository(root: Path) -> Path:
    """root/repo: a copy of the repository's files (git's list: tracked, and untracked but not ignored)."""
    repo = root / "repo"
    for name in repository_files():
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return repo
