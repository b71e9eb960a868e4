"""Every block of documented commands labelled `# GPU` runs as written on a GPU (-m "gpu and slow"), and once it has
been measured its label states the time it took there: `# GPU (H100: about N s)`.

The times are measured with this file on one H100 and committed in benchmarks/results/docs/gpu_block_times.json
(machine, command, seconds per block):

    TT_DOCS_GPU_TIMES=gpu_times.jsonl python -m pytest -q -m "gpu and slow" tests/test_docs_gpu_blocks.py -s

which appends one JSON line per block (file, commands, seconds) to the file it names. With TT_DOCS_GPU_DONE=FILE,
the blocks already listed in FILE (a times file of an earlier, interrupted run, or the committed measurements) are
skipped, so a long measurement can be finished in several sittings.

A measurement belongs to a block by the block's file and the text of its commands, not by its line: prose edited
above a block leaves its measurement in place, while a changed command needs measuring again.
"""
from __future__ import annotations

import json
import os
import time
import types

import pytest

from .doc_commands import (DOC_BLOCKS, GPU_TIMED_LABEL, REPO, copy_repository, failure_of, label_of,
                           python_shims)

GPU_BLOCKS = [(block, commands) for block, commands in DOC_BLOCKS if label_of(block)[0] == "gpu"]
MEASURED = REPO / "benchmarks" / "results" / "docs" / "gpu_block_times.json"
GPU_COMMAND_LIMIT_S = 600   # one command of a GPU block (the profiler scripts run several training runs)


def label_time(seconds: float) -> str:
    """How a measured time is written in a label: to the nearest 5 seconds (at least 5)."""
    return f"about {max(5, int(round(seconds / 5)) * 5)} s"


def command_texts(commands) -> list[str]:
    """A block's commands as one line each, whitespace collapsed (re-wrapping a command changes nothing)."""
    return [" ".join(command.text.split()) for command in commands]


def identity(path: str, texts) -> tuple:
    """What a measurement is attached to: the markdown file and the commands the block runs."""
    return path, tuple(texts)


def identity_of(block, commands) -> tuple:
    return identity(block.path, command_texts(commands))


def measured_blocks(records) -> dict[tuple, dict]:
    """{identity: record} of measurement records, each {"file", "commands", "seconds", ...}."""
    return {identity(record["file"], record["commands"]): record for record in records}


def test_gpu_labels_state_the_measured_times():
    """A GPU block measured on the H100 (benchmarks/results/docs/gpu_block_times.json) states that time in its
    label, and a label states no time that was not measured. Blocks not measured yet keep the plain `# GPU`."""
    measured = measured_blocks(json.loads(MEASURED.read_text())["blocks"])
    problems = []
    for block, commands in GPU_BLOCKS:
        label = block.lines[0][1].strip()
        record = measured.get(identity_of(block, commands))
        if record is not None:
            expected = f"# GPU (H100: {label_time(record['seconds'])})"
            if label != expected:
                problems.append(f"{block.where}: {label!r}, measured {record['seconds']} s: write {expected!r}")
        elif GPU_TIMED_LABEL.match(label):
            problems.append(f"{block.where}: {label!r} states a time that {MEASURED.name} does not hold for these "
                            "commands (measure the block again, or write the plain '# GPU')")
    current = {identity_of(block, commands) for block, commands in GPU_BLOCKS}
    problems += [f"{path}: a measured block ({texts[0][:60]!r}...) is no longer a GPU block of that file with "
                 f"these commands: measure it again, or remove its entry from {MEASURED.name}"
                 for path, texts in sorted(set(measured) - current)]
    assert not problems, "; ".join(problems)


def test_measurements_are_attached_by_commands_not_lines():
    """The rule the check above relies on: a block moved down by prose edited above it, or with a command
    re-wrapped, is still the measured block; a block whose command changed, or in another file, is not."""
    def block_at(path, fence_line, *texts):
        block = types.SimpleNamespace(path=path, where=f"{path}:{fence_line}")
        return block, [types.SimpleNamespace(text=text) for text in texts]

    measured = measured_blocks([{"file": "README.md", "commands": ["cd v2 && python a.py --x 1"], "seconds": 12.0}])
    assert identity_of(*block_at("README.md", 80, "cd v2 && python a.py --x 1")) in measured
    assert identity_of(*block_at("README.md", 93, "cd v2 &&\n    python a.py --x 1")) in measured
    assert identity_of(*block_at("README.md", 80, "cd v2 && python a.py --x 2")) not in measured
    assert identity_of(*block_at("docs.md", 80, "cd v2 && python a.py --x 1")) not in measured


def blocks_done_before() -> set[tuple]:
    """Identities of the blocks already measured, to skip: those of TT_DOCS_GPU_DONE, a times file of an earlier,
    interrupted run (one JSON line per block) or the committed measurements (MEASURED's format)."""
    done_file = os.environ.get("TT_DOCS_GPU_DONE")
    if not done_file or not os.path.exists(done_file):
        return set()
    with open(done_file) as records:
        text = records.read()
    try:
        records = json.loads(text)["blocks"]
    except (ValueError, KeyError, TypeError):
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return set(measured_blocks(records))


@pytest.fixture(scope="session")
def gpu_sandbox(tmp_path_factory):
    """(a copy of the repository, the environment of a user's shell on a GPU machine): no smoke-size shim, no
    TRITON_INTERPRET; `python` and `python3` start the interpreter running the tests."""
    root = tmp_path_factory.mktemp("docs_gpu_commands")
    repo = copy_repository(root)
    bin_dir = python_shims(root)
    env = dict(os.environ)
    for name in ("TT_NVTX", "TRITON_INTERPRET", "WORKSHOP_SMOKE", "PYTHON"):
        env.pop(name, None)
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "MPLBACKEND": "Agg",
                "PYTHONDONTWRITEBYTECODE": "1"})
    return repo, env


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("block, commands", [pytest.param(b, c, id=b.where) for b, c in GPU_BLOCKS])
def test_gpu_block_runs_as_written(block, commands, gpu_sandbox):
    """Every GPU block, as written, in document order in one copy of the repository (a block may read what an
    earlier block of its document wrote). Commands that need a tool this machine lacks are skipped as the CPU
    test skips them (their reason is printed)."""
    if identity_of(block, commands) in blocks_done_before():
        pytest.skip("measured in the run TT_DOCS_GPU_DONE names")
    repo, env = gpu_sandbox
    total, lines = 0.0, []
    for command in commands:
        if command.skip:
            lines.append(f"  skipped  {command.where}  ({command.skip})")
            continue
        started = time.perf_counter()
        failure = failure_of(command, repo, env, timeout=GPU_COMMAND_LIMIT_S)
        seconds = time.perf_counter() - started
        if failure:
            pytest.fail(failure, pytrace=False)
        total += seconds
        lines.append(f"  {seconds:6.1f} s  {command.where}  {command.short(90)}")
    print(f"\n{block.where}: {total:.1f} s on the GPU\n" + "\n".join(lines))
    if os.environ.get("TT_DOCS_GPU_TIMES"):
        with open(os.environ["TT_DOCS_GPU_TIMES"], "a") as record:
            record.write(json.dumps({"file": block.path, "commands": command_texts(commands),
                                     "seconds": round(total, 1), "measured_at": block.where}) + "\n")
