"""Finding the repository's markdown documents and the shell commands in their fenced blocks (see
test_docs_commands.py's docstring: "What is a command")."""
from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXCLUDED_DIRS = ("tests/fixtures",)


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
