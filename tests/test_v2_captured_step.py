"""Version 2's --cuda-graph: the whole step (forward, backward, fused AdamW) captured in one CUDA/HIP graph
(tinytransformer/training/captured_step.py). On the CPU: the flag's rules and its fallback; on a GPU: the captured
step trains exactly like the eager one, with and without torch.compile."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.variants import VARIANTS
from tinytransformer.training.captured_step import CapturedStep, _same_layout, captures_step, make_step
from version2_pytorch_fused.tiny_llama_v2 import main as v2_main

REPO = Path(__file__).resolve().parent.parent
V2 = REPO / "version2_pytorch_fused" / "tiny_llama_v2.py"
SMALL = ["--num-steps", "4", "--batch-size", "2", "--seq-len", "16", "--log-every", "4"]


def args_of(**overrides):
    return SimpleNamespace(**{"cuda_graph": True, "use_amp": False, "amp_dtype": "bfloat16",
                              "graph_warmup_steps": 3, **overrides})


def test_which_runs_capture_the_step():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert captures_step(args_of(), gpu)
    assert captures_step(args_of(use_amp=True, amp_dtype="bfloat16"), gpu)
    assert not captures_step(args_of(cuda_graph=False), gpu)
    assert not captures_step(args_of(), cpu)
    # float16 AMP's GradScaler decides on the host whether to skip each step: a replayed graph cannot.
    assert not captures_step(args_of(use_amp=True, amp_dtype="float16"), gpu)
    assert not captures_step(SimpleNamespace(), gpu)   # a version without the flag
    assert make_step(None, None, cpu, None, args_of()) is None   # None: the harness's eager step


def test_the_graphs_input_buffers_keep_the_batchs_strides():
    """The targets are the token stream shifted by one, a view with the strides of the [B, S + 1] block: a
    contiguous copy would change the strides torch.compile's code guards on, and it would recompile during the
    capture (which fails)."""
    tokens = torch.arange(3 * 9).view(3, 9)
    targets = tokens[:, 1:]
    copy = _same_layout(targets)
    assert copy.stride() == targets.stride() == (9, 1) and torch.equal(copy, targets)
    assert copy.data_ptr() != targets.data_ptr()


def test_a_captured_step_needs_an_eager_step_first():
    with pytest.raises(ValueError, match="at least one eager step"):
        CapturedStep(None, None, torch.device("cuda"), SimpleNamespace(use_amp=False), warmup_steps=0)


@pytest.mark.parametrize("flags, message", [
    (["--enable-torch-compile", "--torch-compile-mode", "reduce-overhead"], "use --torch-compile-mode default"),
    (["--enable-torch-compile", "--torch-compile-mode", "max-autotune"], "max-autotune mode records"),
    (["--compile-optimizer"], "drop --compile-optimizer"),
], ids=["reduce-overhead", "max-autotune", "compiled-optimizer"])
def test_combinations_that_cannot_work_are_one_line(flags, message):
    result = subprocess.run([sys.executable, str(V2), "--cuda-graph", *flags, "--device", "cpu"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_graph_warmup_steps_must_be_positive():
    result = subprocess.run([sys.executable, str(V2), "--graph-warmup-steps", "0", "--device", "cpu"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--graph-warmup-steps must be at least 1" in result.stderr


def test_on_the_cpu_the_flag_runs_the_eager_step_and_says_so(tmp_path, capsys):
    """No GPU, no graph: the same losses as without the flag, and the header says why."""
    histories = []
    for name, extra in (("graph", ["--cuda-graph"]), ("plain", [])):
        path = tmp_path / f"{name}.json"
        assert v2_main([*SMALL, "--device", "cpu", "--output-json", str(path), *extra]) == 0
        histories.append(json.loads(path.read_text())["loss"]["history"])
    assert histories[0] == histories[1]
    assert "no graph (--cuda-graph needs a GPU)" in capsys.readouterr().out


def test_the_benchmark_variant_passes_version_2s_checks():
    script, flags = VARIANTS["v2+compile+graph"]
    assert script == "v2" and "--cuda-graph" in flags
    assert flags[flags.index("--torch-compile-mode") + 1] == "default"   # the one mode a whole-step graph allows


# ----------------------------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------------------------
def losses_of(tmp_path, name, extra, steps=25):
    path = tmp_path / f"{name}.json"
    code = v2_main(["--num-steps", str(steps), "--warmup-steps", "5", "--log-every", str(steps), "--device",
                    "cuda", "--output-json", str(path), *extra])
    assert code == 0
    return json.loads(path.read_text())["loss"]["history"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [[], ["--use-amp", "--amp-dtype", "bfloat16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [[], ["--enable-torch-compile"]], ids=["eager-kernels", "compiled"])
def test_captured_and_eager_steps_train_alike(tmp_path, precision, compiled):
    """Same kernels in the same order, replayed: the losses agree step for step (the learning-rate schedule's
    warm-up changes the rate every step, which the graph must read from its tensor)."""
    schedule = ["--lr-schedule", "cosine", "--lr-warmup-steps", "10"]
    captured = losses_of(tmp_path, "graph", ["--cuda-graph", *precision, *compiled, *schedule])
    eager = losses_of(tmp_path, "eager", [*precision, *compiled, *schedule])
    assert len(captured) == len(eager) == 25
    for step, (c, e) in enumerate(zip(captured, eager)):
        assert c == pytest.approx(e, rel=2e-3), f"step {step}: graph {c} vs eager {e}"
    assert captured[-1] < captured[0] - 1.0              # and it trains
    assert len(set(round(v, 6) for v in captured[5:])) > 10   # each replay reads its own batch


@pytest.mark.gpu
def test_the_header_says_the_step_is_replayed(tmp_path, capsys):
    losses_of(tmp_path, "graph", ["--cuda-graph"], steps=6)
    assert "the whole step replayed from one CUDA/HIP graph" in capsys.readouterr().out
