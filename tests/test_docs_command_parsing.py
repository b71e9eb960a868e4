"""The machinery of the documentation tests (test_docs_commands.py): the smoke-size substitution, reading the
commands out of markdown, and the reasons a command is skipped. Fast."""
import textwrap

import pytest

from .doc_blocks import block_commands, fenced_blocks
from .doc_commands import is_state_change, skip_reason
from .doc_shim import SMOKE_FLAGS, smoke_argv, split_python_argv, target_name


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
