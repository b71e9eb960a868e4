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
  works. Each block starts again from the markdown file's directory. A command passes when it exits with 0
  (diff: 0 or 1) under `set -o pipefail`, within DOCS_COMMAND_TIMEOUT seconds (default 300).

The smoke-size substitution (what makes a 100-step GPU command a 3-second CPU command; test_doc_command)
  The environment of every command has WORKSHOP_SMOKE=1, TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES=""
  (so even on a GPU machine everything runs on the CPU), and `python`, `python3`, `python3.X` and $PYTHON
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

import dataclasses
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).name
TIMEOUT_S = int(os.environ.get("DOCS_COMMAND_TIMEOUT", "300"))
MAX_SKIPPED_FRACTION = 0.10
EXCLUDED_DIRS = ("tests/fixtures",)

# ------------------------------------------------------------------------------------------------------
# The smoke-size substitution (copied into the python shim, so it must use only the standard library)
# ------------------------------------------------------------------------------------------------------
SMOKE_FLAGS = {
    "--num-steps": "2", "--batch-size": "2", "--seq-len": "16", "--hidden-dim": "32", "--num-heads": "2",
    "--num-layers": "1", "--intermediate-size": "64", "--vocab-size": "300", "--device": "cpu",
}
# Replaced when present, never added: values that would contradict the smoke flags above.
REPLACE_ONLY_FLAGS = {"--warmup-steps": "1", "--max-seq-len": "16", "--lr-warmup-steps": "0"}
SMOKE_SCRIPT = re.compile(r"^(tiny_llama_v\d+|run_\w+)\.py$")


def smoke_argv(args, accepted=None):
    """The flags of a training/profiling script rewritten to the smoke size.

    args: the script's arguments (after the script name). accepted: the flags the script's --help lists, or
    None when unknown (then every missing smoke flag is added). Returns a new list.
    """
    if "--help" in args or "-h" in args:
        return list(args)
    replacements = {**SMOKE_FLAGS, **REPLACE_ONLY_FLAGS}
    out, present, i = [], set(), 0
    while i < len(args):
        arg = args[i]
        flag, has_equals, _ = arg.partition("=")
        if flag in replacements and has_equals:
            out.append(f"{flag}={replacements[flag]}")
            present.add(flag)
        elif arg in replacements and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out += [arg, replacements[arg]]
            present.add(arg)
            i += 1
        else:
            out.append(arg)
        i += 1
    for flag, value in SMOKE_FLAGS.items():
        if flag not in present and (accepted is None or flag in accepted):
            out += [flag, value]
    return out


def split_python_argv(argv):
    """python's own options, the script (or '-m module'), and the script's arguments.

    Returns (interpreter_options, target, script_args) where target is None for `python -c ...`,
    `python -` and an interactive python: those are passed through untouched.
    """
    options, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "-"):
            return argv, None, []
        if arg == "-m" and i + 1 < len(argv):
            return options, ["-m", argv[i + 1]], argv[i + 2:]
        if arg in ("-W", "-X") and i + 1 < len(argv):
            options += argv[i:i + 2]
            i += 2
            continue
        if arg.startswith("-"):
            options.append(arg)
            i += 1
            continue
        return options, [arg], argv[i + 1:]
    return argv, None, []


def target_name(target):
    """tiny_llama_v1.py for ['path/to/tiny_llama_v1.py'] and for ['-m', 'version1_pytorch_baseline.tiny_llama_v1']."""
    if target[0] == "-m":
        return target[1].rsplit(".", 1)[-1] + ".py"
    return os.path.basename(target[0])


def shim_main(real_python, cache_path):
    """The body of the python shim: rewrite the flags of smoke-target scripts, then exec the real python."""
    argv = sys.argv[1:]
    options, target, args = split_python_argv(argv)
    if target is not None and SMOKE_SCRIPT.match(target_name(target)):
        key = os.path.abspath(target[0]) if target[0] != "-m" else " ".join(target)
        try:
            with open(cache_path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
        if key not in cache:
            probe = subprocess.run([real_python, *options, *target, "--help"], capture_output=True, text=True)
            flags = sorted(set(re.findall(r"--[a-z][a-z0-9-]*", probe.stdout))) if probe.returncode == 0 else None
            cache[key] = flags
            with open(cache_path, "w") as f:
                json.dump(cache, f)
        accepted = None if cache[key] is None else set(cache[key])
        argv = options + target + smoke_argv(args, accepted)
    os.execv(real_python, [real_python] + argv)


def write_python_shim(directory: Path) -> Path:
    """Write `python` and `python3` shims into directory; returns the directory (put it first on PATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = [
        f"#!{sys.executable}",
        '"""Generated by tests/test_docs_commands.py: smoke-size flags for the workshop scripts."""',
        "import json, os, re, subprocess, sys",
        f"SMOKE_FLAGS = {SMOKE_FLAGS!r}",
        f"REPLACE_ONLY_FLAGS = {REPLACE_ONLY_FLAGS!r}",
        f"SMOKE_SCRIPT = re.compile({SMOKE_SCRIPT.pattern!r})",
    ]
    parts += [inspect.getsource(f) for f in (smoke_argv, split_python_argv, target_name, shim_main)]
    parts.append(f"shim_main({sys.executable!r}, {str(directory / 'help_cache.json')!r})")
    source = "\n".join(parts) + "\n"
    for name in ("python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        path = directory / name
        path.write_text(source)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


# ------------------------------------------------------------------------------------------------------
# Finding the documents and their commands
# ------------------------------------------------------------------------------------------------------
def ignored_directory_names() -> set[str]:
    """Directory names that .gitignore excludes (lines such as `runs/` or `/build/`), for use without git."""
    names = {"__pycache__"}
    gitignore = REPO / ".gitignore"
    if gitignore.is_file():
        for line in gitignore.read_text().splitlines():
            line = line.strip()
            if line.endswith("/") and not line.startswith("#") and "*" not in line:
                names.add(line.strip("/"))
    return names


def repository_files() -> list[str]:
    """Paths (relative, posix) of the repository's files: git's tracked + untracked-not-ignored, else a walk."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                cwd=REPO, capture_output=True, timeout=60, check=True).stdout
        names = [n for n in listed.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        ignored = ignored_directory_names()
        names = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if p.is_file()
                 and not any(part in ignored or part.endswith(".egg-info") for part in p.relative_to(REPO).parts)]
    keep = []
    for name in names:
        parts = name.split("/")
        if any(part.startswith(".") for part in parts[:-1]):
            continue
        if (REPO / name).is_file():
            keep.append(name)
    return sorted(set(keep))


def markdown_files() -> list[str]:
    return [n for n in repository_files() if n.endswith(".md")
            and not any(n.startswith(d + "/") for d in EXCLUDED_DIRS)]


SHELL_LANGUAGES = {"bash", "sh", "shell", "zsh"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
SKIP_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*skip\s+(.+?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    path: str           # markdown file, relative to the repository
    language: str
    lines: list         # [(line number, text)]
    skip_reason: str | None
    fence_line: int = 0   # the line of the opening fence

    @property
    def where(self) -> str:
        return f"{self.path}:{self.fence_line}"


def fenced_blocks(path: str, text: str) -> list[Block]:
    """The fenced code blocks of a markdown file, outside HTML comments."""
    blocks, in_comment, fence, current, pending_skip = [], False, None, None, None
    last_nonblank = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                blocks.append(current)
                fence, current, last_nonblank = None, None, ""
            else:
                current.lines.append((number, line))
            continue
        if in_comment:
            if "-->" in line:
                in_comment = False
            continue
        match = FENCE.match(line)
        if match:
            marker = SKIP_MARKER.match(last_nonblank)
            fence = match.group(1)
            current = Block(path, match.group(2).lower(), [], marker.group(1) if marker else None, number)
            continue
        opened = line.rfind("<!--")
        if opened != -1 and "-->" not in line[opened:]:
            in_comment = True
        if line.strip():
            last_nonblank = line
    return blocks


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """Backslash-continued lines joined; prompts handled as described in the module docstring."""
    shell = block.language in SHELL_LANGUAGES
    out, pending, start = [], None, 0
    for number, raw in block.lines:
        line = raw.rstrip()
        if pending is None:
            stripped = line.lstrip()
            if stripped.startswith("$ ") or stripped == "$":
                line = stripped[2:]
            elif not shell:
                continue
            start, pending = number, ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = None
    if pending is not None:
        out.append((start, pending))
    return out


OPENERS = {"for", "while", "until", "if", "case", "{", "(", "function", "do", "then", "select"}


def shell_tokens(text: str) -> list[str]:
    """Words and operators of a command; newlines outside quotes become separators."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="();<>|&\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def is_complete(text: str) -> bool:
    """Whether text is a whole shell command (not an open loop, quote or here-document)."""
    try:
        tokens = shell_tokens(text)
    except ValueError:   # an open quote
        tokens = None
    if tokens is not None and "<<" not in text:
        if not tokens:
            return True
        if tokens[-1] not in ("|", "&&", "||") and not OPENERS & set(tokens):
            return True
    check = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    message = check.stderr
    return not ("unexpected end of file" in message or "unexpected EOF" in message
                or "delimited by end-of-file" in message)


def block_commands(block: Block) -> list[tuple[int, str]]:
    commands, text, start = [], "", 0
    for number, line in logical_lines(block):
        if not text:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        text = f"{text}\n{line}" if text else line
        if is_complete(text):
            commands.append((start, text))
            text = ""
    if text:
        commands.append((start, text))
    return commands


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
            if not targets or any(THIS_FILE in t or not t.endswith(".py") and "::" not in t for t in targets):
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
@pytest.fixture(scope="session")
def docs_sandbox(tmp_path_factory):
    """(a copy of the repository, the environment the commands run with)."""
    root = tmp_path_factory.mktemp("docs_commands")
    repo = root / "repo"
    for name in repository_files():
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
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
    return repo, env


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


def failure_report(command: DocCommand, result, tail: int = 40) -> str:
    output = (result.stdout + result.stderr).splitlines()
    return textwrap.dedent(f"""\
        {command.where}: exit code {result.returncode}
        command (run from {Path(command.path).parent.as_posix() or '.'}/ in a copy of the repository):
        {command.text}
        last {min(tail, len(output))} lines of its output:
        """) + "\n".join(output[-tail:])


def as_param(command: DocCommand):
    """Commands of the exercises (about two thirds of all, mostly the guides' commands at more sizes) are marked
    slow, so the default test run stays short on a 2-core CI machine; `pytest -m slow` runs them."""
    marks = [pytest.mark.slow] if "/exercises/" in command.where else []
    return pytest.param(command, marks=marks, id=command.where)


@pytest.mark.parametrize("command", [as_param(c) for c in DOC_COMMANDS])
def test_doc_command(command: DocCommand, docs_sandbox):
    if command.skip:
        pytest.skip(f"{command.where}: {command.skip}: {command.short(80)}")
    repo, env = docs_sandbox
    try:
        result = run_command(command, repo, env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command.where}: still running after {TIMEOUT_S} s: {command.short()}", pytrace=False)
    if result.returncode not in allowed_exit_codes(command.text):
        pytest.fail(failure_report(command, result), pytrace=False)


def test_workshop_commands_are_labelled():
    """Every block that runs one of the workshop's scripts says on its first line where it is meant to run: on
    a 2-core CPU as written, and in about how long, or on a GPU (see the module docstring)."""
    unlabelled, wrong = [], []
    for block, commands in DOC_BLOCKS:
        scripts = sorted({script for c in commands for script in workshop_scripts(c.text)})
        first = block.lines[0][1].strip() if block.lines else ""
        if first.startswith(("# CPU", "# GPU")) and label_of(block)[0] is None:
            wrong.append(f"{block.where}: {first!r}")
        elif scripts and label_of(block)[0] is None:
            unlabelled.append(f"{block.where} ({', '.join(scripts)})")
    assert not wrong, f"labels not in one of the forms {LABEL_FORMS}: " + "; ".join(wrong)
    assert not unlabelled, (f"{len(unlabelled)} blocks run workshop scripts without a CPU or GPU label on their "
                            f"first line ({LABEL_FORMS}): " + "; ".join(unlabelled))


def test_cpu_blocks_hold_only_commands_that_run_here():
    """A CPU block is run as written by test_cpu_block_runs_as_written: nothing in it may need a GPU tool, a
    server, the network or an installation, and its label promises about a minute per command at most."""
    problems = [f"{c.where}: {c.skip}" for _, commands in CPU_BLOCKS for c in commands if c.skip]
    problems += [f"{block.where}: the label states {label_of(block)[1]:g} s for {len(commands)} command(s)"
                 for block, commands in CPU_BLOCKS
                 if label_of(block)[1] > CPU_COMMAND_LIMIT_S * len(commands)]
    assert CPU_BLOCKS, "no block of any document is labelled as a CPU block"
    assert not problems, "; ".join(problems)


@pytest.fixture(scope="session")
def cpu_sandbox(tmp_path_factory):
    """(a copy of the repository, the environment of a user's shell on a machine without a GPU): no smoke-size
    shim, no TRITON_INTERPRET (the scripts choose the interpreter themselves), CUDA_VISIBLE_DEVICES="" so that
    even a GPU machine runs everything on its CPU; `python` and `python3` start the interpreter running the tests."""
    root = tmp_path_factory.mktemp("docs_cpu_commands")
    repo = root / "repo"
    for name in repository_files():
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = dict(os.environ)
    for name in ("TT_NVTX", "PYTHONPATH", "TRITON_INTERPRET", "WORKSHOP_SMOKE", "PYTHON"):
        env.pop(name, None)
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "CUDA_VISIBLE_DEVICES": "",
                "HIP_VISIBLE_DEVICES": "", "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"})
    return repo, env


@pytest.mark.slow
@pytest.mark.parametrize("block, commands", [pytest.param(b, c, id=b.where) for b, c in CPU_BLOCKS])
def test_cpu_block_runs_as_written(block, commands, cpu_sandbox):
    """Every CPU block, as written (no smoke sizes), on the CPU: each command within CPU_COMMAND_LIMIT_S, the
    block within CPU_TIME_FACTOR times what its label states. The blocks run in document order in one copy of
    the repository, so a CPU block may read what an earlier CPU block wrote (never what a GPU block writes: a
    reader without a GPU runs only the CPU blocks). The times are printed (pytest -s or -rP shows them); with
    TT_DOCS_CPU_TIMES=FILE they are also appended to FILE, one JSON line per command."""
    repo, env = cpu_sandbox
    stated = label_of(block)[1]
    total, lines = 0.0, []
    for command in commands:
        started = time.perf_counter()
        try:
            result = run_command(command, repo, env, timeout=CPU_COMMAND_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command.where}: still running after {CPU_COMMAND_LIMIT_S} s on the CPU: "
                        f"{command.short()}", pytrace=False)
        seconds = time.perf_counter() - started
        if result.returncode not in allowed_exit_codes(command.text):
            pytest.fail(failure_report(command, result), pytrace=False)
        total += seconds
        lines.append(f"  {seconds:6.1f} s  {command.where}  {command.short(90)}")
        if os.environ.get("TT_DOCS_CPU_TIMES"):
            with open(os.environ["TT_DOCS_CPU_TIMES"], "a") as record:
                record.write(json.dumps({"file": command.path, "line": command.line, "command": command.text,
                                         "seconds": round(seconds, 1), "label_s": stated}) + "\n")
    print(f"\n{block.where}: {total:.1f} s as written (label: about {stated:g} s)\n" + "\n".join(lines))
    assert total <= CPU_TIME_FACTOR * stated + CPU_TIME_SLACK_S, (
        f"{block.where}: took {total:.0f} s on this CPU, more than {CPU_TIME_FACTOR}x the {stated:g} s its label "
        f"states: measure it again and correct the label (or the command)")


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


# ------------------------------------------------------------------------------------------------------
# The machinery itself (fast)
# ------------------------------------------------------------------------------------------------------
def test_smoke_argv_replaces_present_flags_and_adds_missing_ones():
    args = ["--batch-size", "8", "--num-steps=30", "--warmup-steps", "5", "--enable-pytorch-profiler"]
    out = smoke_argv(args)
    assert out[:6] == ["--batch-size", "2", "--num-steps=2", "--warmup-steps", "1", "--enable-pytorch-profiler"]
    for flag, value in SMOKE_FLAGS.items():
        assert any(o == f"{flag}={value}" for o in out) or out[out.index(flag) + 1] == value
    assert "--max-seq-len" not in out, "replace-only flags are never added"
    accepted_only = smoke_argv([], accepted={"--num-steps", "--device"})
    assert accepted_only == ["--num-steps", "2", "--device", "cpu"]
    assert smoke_argv(["--help", "--batch-size", "8"]) == ["--help", "--batch-size", "8"]


def test_split_python_argv():
    assert split_python_argv(["-u", "tiny_llama_v1.py", "--x"]) == (["-u"], ["tiny_llama_v1.py"], ["--x"])
    assert split_python_argv(["-m", "a.run_b", "--y"]) == ([], ["-m", "a.run_b"], ["--y"])
    assert split_python_argv(["-c", "print(1)"])[1] is None
    assert target_name(["-m", "version1_pytorch_baseline.tiny_llama_v1"]) == "tiny_llama_v1.py"


def test_command_extraction():
    text = textwrap.dedent("""\
        Intro
        ```bash
        # a comment
        cd version1_pytorch_baseline
        python tiny_llama_v1.py \\
            --batch-size 8
        for bs in 4 8; do
            python tiny_llama_v1.py --batch-size $bs
        done
        ```
        <!--
        ```bash
        rocprofv3 --hidden
        ```
        -->
        ```console
        $ nvidia-smi
        output line
        ```
        <!-- doc-test: skip needs a GPU-only file -->
        ```sh
        ls /dev/kfd
        ```
        """)
    blocks = fenced_blocks("x.md", text)
    assert [b.language for b in blocks] == ["bash", "console", "sh"]
    commands = block_commands(blocks[0])
    assert [line for line, _ in commands] == [4, 5, 7]
    assert commands[1][1].split() == ["python", "tiny_llama_v1.py", "--batch-size", "8"]
    assert commands[2][1].startswith("for bs in 4 8; do") and commands[2][1].endswith("done")
    assert is_state_change(commands[0][1]) and not is_state_change(commands[1][1])
    assert block_commands(blocks[1]) == [(17, "nvidia-smi")]
    assert blocks[2].skip_reason == "needs a GPU-only file"


@pytest.mark.parametrize("command, reason", [
    ("python tiny_llama_v1.py --num-steps 5", None),
    ("bash run_all_profilers.sh --skip ncu -- --num-steps 3", None),
    ("bash version2_pytorch_fused/run_nsys.sh -- --num-steps 3", "needs the GPU vendor tool nsys"),
    ("bash profilers/run_ncu.sh --help", None),
    ("rocprofv3 --kernel-trace -- python x.py", "needs the GPU vendor tool rocprofv3"),
    ("tensorboard --logdir runs", "long-running server or monitor (tensorboard)"),
    ("pip install -r requirements.txt", "installation"),
    ("python -m pytest -q", "runs the whole test suite"),
    ("python -m pytest tests/test_data.py -q", None),
    ("ROCR_VISIBLE_DEVICES=0 nsys profile python x.py", "needs the GPU vendor tool nsys"),
])
def test_skip_reasons(command, reason):
    got = skip_reason(command)
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got
