"""The performance-debugging exercise (version3_triton/exercises/performance_debugging/: stages.py, run_stage.py).

Each stage's defect must be real and detectable:
  1  the loss starts and stays far above stage 5's after the same steps; the loader copies nothing;
  2  the stride-aware SwiGLU kernel computes the right values on any layout (slower on the transposed one: GPU
     test); a kernel that ignores strides reads the wrong elements, shown precisely;
  3  the host-clock timer measures only the queueing of asynchronous work (CPU demonstration), and on a GPU
     reports a step time that disagrees with the device events;
  4  the naive Triton matmul computes the right values, forward and backward (slower than BLAS: GPU test);
  5  stage 2 and 4 models compute what stage 5 (version 3) computes.
Plus run_stage.py's --stage flag and run_all_stages.sh (a quick run here; the whole script with profiling is
marked slow).
"""
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tinytransformer.config import ModelConfig
from tinytransformer.precision import set_tf32
from tinytransformer.training.step import EagerStep

from .equivalence import canonical, compare, forward_backward, random_batch, rel_err

from version3_triton import tiny_llama_v3  # noqa: E402  (after conftest has chosen the Triton interpreter)
from version3_triton.exercises.performance_debugging import run_stage, stages  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_ALL_STAGES = REPO_ROOT / "version3_triton" / "exercises" / "performance_debugging" / "run_all_stages.sh"
HAS_GPU = torch.cuda.is_available()

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SMALL = ModelConfig(vocab_size=101, hidden_dim=64, num_layers=2, num_heads=2, intermediate_size=96, max_seq_len=48)
# Training runs through the command line: as small as Triton's interpreter allows (head dim 16).
TINY_RUN = ["--device", "cpu", "--vocab-size", "64", "--hidden-dim", "32", "--num-layers", "1", "--num-heads", "2",
            "--intermediate-size", "48", "--max-seq-len", "16", "--batch-size", "2", "--seq-len", "16"]


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer the stage wrappers allocate for a kernel starts as NaN: unwritten elements cannot pass."""
    monkeypatch.setattr(stages, "FILL_NEW_BUFFERS_WITH_NAN", True)


def nan_like(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def run_cli(argv, tmp_path, name):
    """One training run of run_stage.py (version 3 with --stage) in this process; returns its metrics JSON."""
    path = tmp_path / f"{name}.json"
    assert run_stage.main(argv + ["--output-json", str(path)]) == 0
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------
# Stage 2: the stride-aware SwiGLU kernel
# ----------------------------------------------------------------------------------------------------------
def make_gate_up(rows, n_cols, layout, dtype, device, seed=0):
    """A [rows, 2F] gate_up with random values in the requested memory layout."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        data = torch.randn(rows, 2 * n_cols, generator=generator)
    elif layout == "transposed":      # what stage 2's FFN produces: strides (1, rows)
        data = torch.randn(2 * n_cols, rows, generator=generator).t()
    elif layout == "every_other_column":   # column stride 2: non-contiguous but not transposed
        data = torch.randn(rows, 4 * n_cols, generator=generator)[:, ::2]
    else:
        raise ValueError(layout)
    return data.to(device=device, dtype=dtype)


def swiglu_reference(gate_up, dout):
    """Forward and the gradient of gate_up in float64."""
    x = gate_up.detach().double().requires_grad_()
    n_cols = x.shape[1] // 2
    out = F.silu(x[:, :n_cols]) * x[:, n_cols:]
    out.backward(dout.double())
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every_other_column"])
@pytest.mark.parametrize("rows, n_cols", [(3, 5), (37, 45), (64, 130), (2, 1100)])
def test_strided_swiglu_matches_float64_reference(rows, n_cols, layout, dtype, device, nan_buffers):
    gate_up = make_gate_up(rows, n_cols, layout, dtype, device)
    dout = torch.randn(rows, n_cols, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    ref_out, ref_grad = swiglu_reference(gate_up, dout)

    out = stages.strided_swiglu_forward(gate_up, out=nan_like((rows, n_cols), dtype, device))
    grad = stages.strided_swiglu_backward(dout, gate_up)   # a NaN-filled buffer, via the fixture
    assert rel_err(out, ref_out) < TOLERANCE[dtype]
    assert rel_err(grad, ref_grad) < TOLERANCE[dtype]
    if layout == "transposed":   # the gradient comes back in the layout of the input
        assert grad.stride() == gate_up.stride()


@pytest.mark.interpreter
def test_strided_swiglu_autograd_through_a_transposed_product():
    """The stage-2 path end to end: W @ x^T, transposed view, strided SwiGLU; gradients of x and W."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randn(23, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(2 * 24, 16, generator=generator, dtype=torch.float64)
    x32, w32 = tokens.float().requires_grad_(), weight.float().requires_grad_()
    out = stages.strided_swiglu((w32 @ x32.t()).t())
    out.backward(torch.ones_like(out))

    x64, w64 = tokens.clone().requires_grad_(), weight.clone().requires_grad_()
    gate_up = x64 @ w64.t()
    ref = F.silu(gate_up[:, :24]) * gate_up[:, 24:]
    ref.backward(torch.ones_like(ref))
    assert rel_err(out, ref) < 1e-5
    assert rel_err(x32.grad, x64.grad) < 1e-5 and rel_err(w32.grad, w64.grad) < 1e-5


def test_a_kernel_that_ignores_strides_reads_the_wrong_elements(device):
    """Show precisely how a non-contiguous tensor goes wrong in a kernel written for contiguous rows.

    A Triton kernel receives a tensor as its address alone. Version 3's SwiGLU kernel, handed the transposed
    gate_up's address, reads the memory as if it held a row-major [rows, 2F] matrix: it computes the SwiGLU of
    THAT matrix, a scrambled version of the right one. Version 3's launchers assert contiguity, and its
    autograd function makes the input contiguous first, which gives the right answer.
    """
    from version3_triton.kernels import swiglu as v3_swiglu

    rows, n_cols = 12, 20
    gate_up = make_gate_up(rows, n_cols, "transposed", torch.float32, device)
    right, _ = swiglu_reference(gate_up, torch.ones(rows, n_cols, device=device))
    storage = gate_up.t()                                # contiguous [2F, rows]: the memory behind the view
    as_row_major = storage.view(rows, 2 * n_cols)        # the same memory, read as row-major [rows, 2F]
    assert as_row_major.data_ptr() == gate_up.data_ptr()
    scrambled, _ = swiglu_reference(as_row_major, torch.ones(rows, n_cols, device=device))

    out = nan_like((rows, n_cols), torch.float32, device)
    grid, block_size = v3_swiglu._launch_config(rows, n_cols)
    # gate: the view's own address; up: where the kernel's layout puts it, F elements further on.
    v3_swiglu._swiglu_forward_kernel[grid](gate_up, storage.view(-1)[n_cols:], out, n_cols, 2 * n_cols, 0,
                                           BLOCK_SIZE=block_size)
    assert rel_err(out, scrambled) < 1e-6            # exactly the SwiGLU of the misread matrix
    assert rel_err(out, right) > 0.5                 # and nothing like the right answer

    with pytest.raises(AssertionError):              # version 3's launcher refuses the view ...
        v3_swiglu.swiglu_fused_forward(gate_up)
    assert rel_err(v3_swiglu.swiglu_fused(gate_up), right) < 1e-6   # ... its autograd path copies it first


# ----------------------------------------------------------------------------------------------------------
# Stage 4: the naive Triton matmul
# ----------------------------------------------------------------------------------------------------------
def make_matrix(rows, cols, transposed, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(cols, rows, generator=generator).to(device=device, dtype=dtype).t()
    return torch.randn(rows, cols, generator=generator).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_transposed, b_transposed", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (37, 53, 29), (64, 96, 130), (3, 0, 4)])
def test_naive_matmul_matches_float64_reference(m, k, n, a_transposed, b_transposed, dtype, device):
    a = make_matrix(m, k, a_transposed, dtype, device, seed=3)
    b = make_matrix(k, n, b_transposed, dtype, device, seed=4)
    out = stages.naive_matmul(a, b, out=nan_like((m, n), dtype, device))
    ref = a.double() @ b.double()
    if k == 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, out_features", [((2, 19, 64), 96), ((45, 33), 7)])
def test_naive_linear_forward_and_backward(shape, out_features, dtype, device, nan_buffers):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    weight = (torch.randn(out_features, shape[-1], generator=generator) / 8).to(device=device, dtype=dtype)
    grad_out = torch.randn(*shape[:-1], out_features, generator=generator).to(device=device, dtype=dtype)

    x_t, w_t = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = stages.naive_linear(x_t, w_t)
    out.backward(grad_out)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    ref = x64 @ w64.t()
    ref.backward(grad_out.double())

    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(x_t.grad, x64.grad) < TOLERANCE[dtype]
    assert rel_err(w_t.grad, w64.grad) < TOLERANCE[dtype]


# ----------------------------------------------------------------------------------------------------------
# Stages 2 and 4 compute what stage 5 (version 3) computes
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 4])
@pytest.mark.interpreter
def test_stage_model_matches_version3(stage):
    weights = canonical(SMALL, seed=1)
    inputs, targets = random_batch(SMALL, batch=1, seq=19, device="cpu", seed=2)
    reference = forward_backward(tiny_llama_v3.TinyLlama(SMALL), weights, inputs, targets)
    model = stages.build_model(stage, SMALL)
    expected = {2: stages.TransposedGateUpFeedForward, 4: stages.NaiveMatmulFeedForward}[stage]
    assert all(type(layer.feed_forward) is expected for layer in model.layers)
    assert compare(reference, forward_backward(model, weights, inputs, targets), 1e-5) == []


# ----------------------------------------------------------------------------------------------------------
# Stage 1: the weights are never initialised
# ----------------------------------------------------------------------------------------------------------
def test_stage1_loader_copies_nothing_and_the_one_line_fix_does():
    weights = canonical(SMALL, seed=1)
    model = stages.build_model(1, SMALL)
    model.load_canonical(weights)
    for name, actual, intended in stages.weight_statistics(model, SMALL, seed=1):
        if name.endswith("norm.weight"):
            assert actual == pytest.approx(1.0) and intended == pytest.approx(1.0)
        else:   # std-1 placeholders where 0.02 (or less) was loaded
            assert 0.8 < actual < 1.2 and intended < 0.03, name
    tiny_llama_v3.TinyLlama.load_canonical(model, weights)   # the loader with tensor.copy_(...)
    loaded = model.canonical_state_dict()
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # the interpreter's sigmoid of huge gates
@pytest.mark.interpreter
def test_stage1_loss_starts_absurdly_high_and_stays_far_above_stage5(tmp_path):
    steps = ["--num-steps", "4", "--warmup-steps", "1"]
    broken = run_cli(TINY_RUN + steps + ["--stage", "1"], tmp_path, "stage1")
    fixed = run_cli(TINY_RUN + steps + ["--stage", "5"], tmp_path, "stage5")
    ln_vocab = math.log(64)
    assert fixed["loss"]["first"] == pytest.approx(ln_vocab, rel=0.1)   # a fresh model: about ln(V)
    assert broken["loss"]["first"] > 2.5 * ln_vocab                      # absurd for a fresh model
    assert broken["loss"]["final"] > fixed["loss"]["final"] + ln_vocab   # and it stays far above
    assert broken["variant"]["stage"].startswith("1 of 5")


def test_weight_diagnostic_flags_every_placeholder(capsys):
    assert stages.main(["weights", "--stage", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    flagged = [line for line in lines if "not what was loaded" in line]
    norms = [line for line in lines if "norm.weight" in line]
    assert len(flagged) + len(norms) == len(lines) - 2 and flagged and all("not what" not in n for n in norms)


# ----------------------------------------------------------------------------------------------------------
# Stage 3: timing without synchronisation
# ----------------------------------------------------------------------------------------------------------
class _QueuedLoss:
    """A loss whose value is produced by work still running elsewhere, like a GPU kernel in flight."""

    def __init__(self, worker: threading.Thread):
        self.worker = worker

    def item(self) -> float:   # like tensor.item(): wait for the work, then read the value
        self.worker.join()
        return 1.0


def test_host_clock_timer_measures_only_the_queueing(monkeypatch):
    """A step that queues 0.2 s of work and returns at once, as a GPU step does: the timer sees ~0 s."""
    def queue_the_work(self, inputs, targets):
        worker = threading.Thread(target=time.sleep, args=(0.2,))
        worker.start()
        return _QueuedLoss(worker)

    monkeypatch.setattr(EagerStep, "__call__", queue_the_work)
    train = SimpleNamespace(num_steps=3, warmup_steps=0, batch_size=4, use_amp=False)
    printed = io.StringIO()
    step = stages.HostClockTimedStep(model=None, optimizer=None, device=torch.device("cuda"), train=train,
                                     out=printed)
    started = time.perf_counter()
    for _ in range(3):
        step(None, None)
    wall_ms = (time.perf_counter() - started) * 1e3
    summary = step.summary()
    assert wall_ms > 3 * 190                    # the work really took 0.2 s per step ...
    assert summary["median_ms"] < 50            # ... the unsynchronised clock saw almost none of it
    assert summary["samples_per_s"] > 4 / 0.05
    assert "stage 3 timer: median" in printed.getvalue()


@pytest.mark.interpreter
def test_stage3_reports_its_host_timer_next_to_the_harness_timing(tmp_path, capsys):
    metrics = run_cli(TINY_RUN + ["--num-steps", "4", "--warmup-steps", "1", "--stage", "3"], tmp_path, "stage3")
    printed = capsys.readouterr().out
    assert "stage 3 timer: median" in printed and "host clock" in printed
    host = metrics["variant"]["host_clock_timer"]
    assert host["count"] == 3 and host["median_ms"] > 0 and host["samples_per_s"] > 0
    # On the CPU nothing is asynchronous: the host clock and the harness's clock time the same steps.
    assert host["median_ms"] == pytest.approx(metrics["timing"]["median_ms"], rel=0.25)


# ----------------------------------------------------------------------------------------------------------
# The --stage flag (run_stage.py; version 3's own command line has none)
# ----------------------------------------------------------------------------------------------------------
def test_stage_flag_rejects_an_unknown_stage(capsys):
    with pytest.raises(SystemExit) as stopped:
        run_stage.main(TINY_RUN + ["--stage", "6"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--stage" in error


def test_describe_names_the_stage_and_leaves_stage5_unchanged():
    assert set(run_stage.describe(SimpleNamespace(stage=5))) == {"kernels"}
    for stage in (1, 2, 3, 4):
        info = run_stage.describe(SimpleNamespace(stage=stage))
        assert info["stage"].startswith(f"{stage} of 5") and info["defect"] == stages.STAGES[stage][1]


@pytest.mark.parametrize("stage", [2, 4])
@pytest.mark.interpreter
def test_stage_trains_through_the_command_line(stage, tmp_path):
    metrics = run_cli(TINY_RUN + ["--num-steps", "2", "--stage", str(stage)], tmp_path, f"stage{stage}")
    assert all(math.isfinite(v) for v in metrics["loss"]["history"])
    assert metrics["variant"]["defect"] == stages.STAGES[stage][1]


# ----------------------------------------------------------------------------------------------------------
# run_all_stages.sh
# ----------------------------------------------------------------------------------------------------------
def run_script(*args, timeout=600):
    # The runs here are CPU runs of version 3 (TINY_RUN: --device cpu), so Triton's interpreter is asked for: on a
    # GPU machine the stages would otherwise compile their kernels for the GPU and refuse a CPU run.
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    return subprocess.run(["bash", str(RUN_ALL_STAGES), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO_ROOT)


def results_dir(root: Path) -> Path:
    (found,) = [p for p in root.iterdir() if p.is_dir()]
    return found


def test_script_help_and_usage_errors():
    shown = run_script("--help")
    assert shown.returncode == 0 and "Usage:" in shown.stdout and "--stages" in shown.stdout
    for bad in (["--bogus"], ["--stages", "1,7"], ["--profile-num-steps", "0"], ["--output-dir"]):
        result = run_script(*bad)
        assert result.returncode == 2, bad
        assert len(result.stderr.strip().splitlines()) == 1, bad


def test_script_quick_run_writes_logs_metrics_and_the_table(tmp_path):
    result = run_script("-o", str(tmp_path), "--stages", "3", "--skip-baseline", "--no-profile", "--",
                        *TINY_RUN, "--num-steps", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = results_dir(tmp_path)
    assert (out / "stage3_output.log").read_text().count("stage 3 timer") == 1
    assert json.loads((out / "stage3_metrics.json").read_text())["variant"]["host_clock_timer"]
    summary = (out / "summary.md").read_text()
    assert "| Stage | Loss (first -> final) | Samples/s | vs v1 | Peak memory | Key issue |" in summary
    (row,) = [line for line in summary.splitlines() if line.startswith("| 3 |")]
    assert row.split("|")[4].strip() == "n/a"   # no baseline run: no "vs v1"
    assert "own timer (host clock, no synchronisation)" in summary


@pytest.mark.slow
def test_script_runs_every_stage_profiles_them_and_compares(tmp_path):
    result = run_script("-o", str(tmp_path), "--profile-num-steps", "4", "--", *TINY_RUN, "--num-steps", "4",
                        timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = results_dir(tmp_path)
    summary = (out / "summary.md").read_text()
    for row in ["| v1 baseline |"] + [f"| {stage} |" for stage in range(1, 6)]:
        assert row in summary
    for stage in range(1, 6):
        assert (out / f"stage{stage}_output.log").exists()
        assert f"| stage {stage} | pytorch_profile | ok |" in summary
        assert list((out / f"stage{stage}_pytorch_profile").rglob("*.json*")), f"no trace for stage {stage}"
        if not HAS_GPU:
            assert f"| stage {stage} | rocprofv3 | skipped |" in summary
    loss = {s: json.loads((out / f"stage{s}_metrics.json").read_text())["loss"]["final"] for s in (1, 5)}
    assert loss[1] > loss[5] + 1.0


# ----------------------------------------------------------------------------------------------------------
# GPU: bfloat16 values, and the speed parts of stages 2, 3 and 4
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_stage_kernels_in_bfloat16_on_gpu(nan_buffers):
    device = torch.device("cuda")
    gate_up = make_gate_up(300, 700, "transposed", torch.bfloat16, device)
    dout = torch.randn(300, 700, device=device, dtype=torch.bfloat16)
    ref_out, ref_grad = swiglu_reference(gate_up, dout)
    assert rel_err(stages.strided_swiglu_forward(gate_up), ref_out) < 2e-2
    assert rel_err(stages.strided_swiglu_backward(dout, gate_up), ref_grad) < 2e-2
    a = make_matrix(300, 257, True, torch.bfloat16, device, seed=6)
    b = make_matrix(257, 190, False, torch.bfloat16, device, seed=7)
    assert rel_err(stages.naive_matmul(a, b), a.double() @ b.double()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_dtype, tolerance", [(None, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("stage", [2, 4])
def test_stage_model_matches_version3_on_gpu(stage, autocast_dtype, tolerance):
    set_tf32(False)
    weights = canonical(SMALL, seed=1)
    inputs, targets = random_batch(SMALL, batch=2, seq=37, device="cuda", seed=2)
    models = [tiny_llama_v3.TinyLlama(SMALL).cuda(), stages.build_model(stage, SMALL).cuda()]
    for model in models:
        model.use_exact_float32(True)
    reference, candidate = (forward_backward(m, weights, inputs, targets, autocast_dtype) for m in models)
    assert compare(reference, candidate, tolerance) == []


def gpu_time_ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_swiglu_is_slower_on_the_transposed_layout(dtype):
    """Same kernel, same values; only the layout differs. Large enough that the data does not sit in L2."""
    from version3_triton.kernels.swiglu import swiglu_fused_forward
    rows, n_cols = 16384, 4096
    transposed = torch.randn(2 * n_cols, rows, device="cuda", dtype=dtype).t()
    contiguous = transposed.contiguous()
    dout = torch.randn(rows, n_cols, device="cuda", dtype=dtype)
    slow = gpu_time_ms(lambda: stages.strided_swiglu_forward(transposed))
    fast = gpu_time_ms(lambda: stages.strided_swiglu_forward(contiguous))
    version3 = gpu_time_ms(lambda: swiglu_fused_forward(contiguous))
    slow_backward = gpu_time_ms(lambda: stages.strided_swiglu_backward(dout, transposed))
    fast_backward = gpu_time_ms(lambda: stages.strided_swiglu_backward(dout, contiguous))
    print(f"\n{dtype}: forward transposed {slow:.3f} ms, contiguous {fast:.3f} ms (version 3 {version3:.3f} ms); "
          f"backward transposed {slow_backward:.3f} ms, contiguous {fast_backward:.3f} ms")
    assert slow > 1.5 * fast
    assert slow_backward > 1.5 * fast_backward


@pytest.mark.gpu
def test_naive_matmul_is_much_slower_than_blas():
    size = 4096
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    naive = gpu_time_ms(lambda: stages.naive_matmul(a, b))
    blas = gpu_time_ms(lambda: a @ b)
    tflops = lambda ms: 2 * size ** 3 / (ms * 1e-3) / 1e12  # noqa: E731
    print(f"\nbfloat16 {size}^3: naive Triton {naive:.2f} ms ({tflops(naive):.1f} TFLOP/s), "
          f"BLAS {blas:.2f} ms ({tflops(blas):.1f} TFLOP/s)")
    assert naive > 3 * blas


@pytest.mark.gpu
def test_stage3_timer_disagrees_with_device_events_on_gpu():
    """A GPU-bound step (big matrices, few kernels): the host clock sees the queueing, the events the work."""
    set_tf32(False)
    config = ModelConfig(vocab_size=32000, hidden_dim=2048, num_layers=2, num_heads=16, intermediate_size=5632,
                         max_seq_len=1024)
    model = tiny_llama_v3.TinyLlama(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train = SimpleNamespace(num_steps=100, warmup_steps=0, batch_size=8, use_amp=False)
    step = stages.HostClockTimedStep(model, optimizer, torch.device("cuda"), train)
    inputs, targets = random_batch(config, batch=8, seq=1024, device="cuda")
    event_ms = []
    for index in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(inputs, targets)
        end.record()
        end.synchronize()
        if index >= 2:   # after compilation and the first allocations
            event_ms.append(start.elapsed_time(end))
    host_ms = step.host_ms[2:]
    print(f"\nhost clock {host_ms} ms, device events {event_ms} ms")
    assert max(host_ms) < 0.5 * min(event_ms)
