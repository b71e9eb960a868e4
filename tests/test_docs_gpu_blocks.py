"""Every block of documented commands labelled `# GPU` runs as written on a GPU (-m "gpu and slow"), and once it has
been measured its label states the time it took there: `# GPU (H100: about N s)`.

The times are measured with this file on one H100 and committed in benchmarks/results/docs/gpu_block_times.json
(machine, command, seconds per block):

    TT_DOCS_GPU_TIMES=gpu_times.jsonl python -m pytest -q -m "gpu and slow" tests/test_docs_gpu_blocks.py -s

which appends one JSON line per block (block, seconds) to the file it names. With TT_DOCS_GPU_DONE=FILE, the
blocks already listed in FILE (a times file of an earlier, interrupted run, or the committed measurements) are
skipped, so a long measurement can be finished in several sittings.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from .doc_commands import (DOC_BLOCKS, GPU_TIMED_LABEL, REPO, copy_repository, failure_of, label_of,
                           python_shims)

GPU_BLOCKS = [(block, commands) for block, commands in DOC_BLOCKS if label_of(block)[0] == "gpu"]
MEASURED = REPO / "benchmarks" / "results" / "docs" / "gpu_block_times.json"
GPU_COMMAND_LIMIT_S = 600   # one command of a GPU block (the profiler scripts run several training runs)


def label_time(seconds: float) -> str:
    """How a measured time is written in a label: to the nearest 5 seconds (at least 5)."""
    return f"about {max(5, int(round(seconds / 5)) * 5)} s"


def test_gpu_labels_state_the_measured_times():
    """A GPU block measured on the H100 (benchmarks/results/docs/gpu_block_times.json) states that time in its
    label, and a label states no time that was not measured. Blocks not measured yet keep the plain `# GPU`."""
    measured = json.loads(MEASURED.read_text())["blocks"]
    problems = []
    for block, _ in GPU_BLOCKS:
        label = block.lines[0][1].strip()
        timed = GPU_TIMED_LABEL.match(label)
        if block.where in measured:
            expected = f"# GPU (H100: {label_time(measured[block.where]['seconds'])})"
            if label != expected:
                problems.append(f"{block.where}: {label!r}, measured {measured[block.where]['seconds']} s: "
                                f"write {expected!r}")
        elif timed:
            problems.append(f"{block.where}: {label!r} states a time that {MEASURED.name} does not hold")
    unknown = sorted(set(measured) - {block.where for block, _ in GPU_BLOCKS})
    problems += [f"{where}: measured, but no GPU block starts there any more (measure it again)" for where in unknown]
    assert not problems, "; ".join(problems)


def blocks_done_before() -> set[str]:
    """Blocks (path:line of the fence) already measured, to skip: those of TT_DOCS_GPU_DONE, a times file of an
    earlier, interrupted run (one JSON line per block) or the committed measurements (MEASURED's format)."""
    done_file = os.environ.get("TT_DOCS_GPU_DONE")
    if not done_file or not os.path.exists(done_file):
        return set()
    with open(done_file) as records:
        text = records.read()
    try:
        return set(json.loads(text)["blocks"])
    except (ValueError, KeyError, TypeError):
        return {json.loads(line)["block"] for line in text.splitlines() if line.strip()}


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
    if block.where in blocks_done_before():
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
            record.write(json.dumps({"block": block.where, "seconds": round(total, 1),
                                     "commands": len(commands)}) + "\n")
