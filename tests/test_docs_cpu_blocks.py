"""Every block of documented commands says where it is meant to run (a 2-core CPU, and in about how long, or a
GPU), and every CPU block runs as written in the time it states (-m slow). The labels and the rules are described
in test_docs_commands.py's docstring ("Labels")."""
from __future__ import annotations

import json
import os
import time

import pytest

from .doc_commands import (CPU_BLOCKS, CPU_COMMAND_LIMIT_S, CPU_TIME_FACTOR, CPU_TIME_SLACK_S, DOC_BLOCKS, LABEL_FORMS,
                           copy_repository, failure_of, label_of, python_shims, workshop_scripts)


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
    repo = copy_repository(root)
    bin_dir = python_shims(root)
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
        failure = failure_of(command, repo, env, timeout=CPU_COMMAND_LIMIT_S)
        seconds = time.perf_counter() - started
        if failure:
            pytest.fail(failure, pytrace=False)
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
