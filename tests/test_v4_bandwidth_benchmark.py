"""Version 4's bandwidth benchmark (run_bandwidth_benchmarks.py, its kernels in bandwidth_kernels.py): its check
passes on the real kernels and fails on a wrong one, its byte models count what the kernels move, and bad input is
one line and exit 2. The timing itself runs on a GPU only (the last test)."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.triton_support import interpreter_active
from version4_triton_ultra import bandwidth_kernels as kernels
from version4_triton_ultra import run_bandwidth_benchmarks as bench

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "version4_triton_ultra/run_bandwidth_benchmarks.py"
SMALL = kernels.Width(rows=48, hidden=96, seq_len=16)   # 96: not a power of two, so the kernels' masks are used


@pytest.mark.parametrize("kernel", kernels.KERNELS, ids=kernels.KERNEL_NAMES)
def test_every_kernel_passes_its_check(kernel, device):
    error, tolerance = bench.worst_error(kernel, SMALL, device)
    assert error <= tolerance


@pytest.mark.parametrize("kernel", kernels.KERNELS, ids=kernels.KERNEL_NAMES)
def test_a_wrong_kernel_fails_its_check(kernel, device):
    """The same kernel with the last column of its first output zeroed, as a mask one column short would leave
    it: the check must see it."""
    def wrong_outputs(inputs):
        outputs = list(kernel.outputs(inputs) if kernel.outputs else last_run[0])
        outputs[0] = outputs[0].clone()
        outputs[0][..., -1] = 0
        return tuple(outputs)

    last_run = []

    def run_and_keep(inputs):
        last_run[:] = [kernel.run(inputs)]

    broken = dataclasses.replace(kernel, run=run_and_keep, outputs=wrong_outputs)
    error, tolerance = bench.worst_error(broken, SMALL, device)
    assert error > tolerance


def test_byte_models_count_the_tensors_each_kernel_reads_and_writes():
    width = kernels.Width(rows=8192, hidden=1024, seq_len=1024)
    by_name = {k.name: k.bytes_moved(width) for k in kernels.KERNELS}
    n, d, f = 8192, 1024, 2816
    assert width.ffn == f and width.head_dim == 64
    assert by_name["norm_forward"] == n * d * (4 + 2 + 4 + 2) + 4 * n + 4 * d
    assert by_name["norm_backward"] == n * d * (4 + 2 + 4 + 4 + 2) + 4 * n + 8 * d
    assert by_name["swiglu_forward"] == n * f * (2 * 2 + 2)
    assert by_name["swiglu_backward"] == n * f * (2 + 2 * 2 + 2 * 2)
    assert by_name["rope"] == 2 * (2 * n * d * 2) + 2 * 1024 * 64 * 4
    parameters = 3 * d * d + d * d + 2 * f * d + d * f + 2 * d
    assert by_name["adamw"] == 28 * parameters + 2 * (parameters - 2 * d)


def test_widths_take_the_presets_shapes():
    assert (kernels.Width(8192, 2048, 1024).ffn, kernels.Width(8192, 2048, 1024).head_dim) == (5632, 128)
    assert (kernels.Width(8192, 4096, 1024).ffn, kernels.Width(8192, 4096, 1024).head_dim) == (11264, 128)
    assert kernels.sequence_length(8192, 1024) == 1024 and kernels.sequence_length(48, 1024) == 48
    assert kernels.sequence_length(1000, 64) == 50   # the longest that cuts the rows into whole sequences


@pytest.mark.parametrize("flags", [["--kernel", "normm"], ["--kernel", ","], ["--hidden-sizes", "64,x"],
                                   ["--hidden-sizes", "40"], ["--rows", "0"], ["--rounds", "-1"],
                                   ["--output-json", "/proc/version/x.json"]])
def test_bad_input_is_one_line_and_exit_2(flags):
    result = subprocess.run([sys.executable, SCRIPT, *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "error:" in result.stderr


@pytest.mark.skipif(not interpreter_active(), reason="the CPU run checks in Triton's interpreter")
def test_interpreter_run_refuses_sizes_that_would_take_hours_and_checks_small_ones(tmp_path):
    big = subprocess.run([sys.executable, SCRIPT, "--hidden-sizes", "1024"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert big.returncode == 2 and "interpreter" in big.stderr
    out = tmp_path / "bandwidth.json"
    small = subprocess.run([sys.executable, SCRIPT, "--kernel", "rope,swiglu_forward", "--hidden-sizes", "64",
                            "--output-json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert small.returncode == 0, small.stderr
    report = json.loads(out.read_text())
    assert [c["kernel"] for c in report["checks"]] == ["swiglu_forward", "rope"]
    assert all(c["ok"] for c in report["checks"]) and report["results"] == []


def test_timed_graph_takes_turns_on_its_input_sets_and_finishes_each_capture(monkeypatch, device):
    """What the graph records, without a GPU: the launches cycle through the input sets, and every set's
    after-capture hook (AdamW's finish_capture) runs once the capture is done."""
    made, seen, finished = [], [], []

    def make_inputs(width, device):
        made.append({"id": len(made)})
        return made[-1]
    kernel = dataclasses.replace(kernels.KERNELS[0], make_inputs=make_inputs, run=lambda x: seen.append(x["id"]),
                                 after_capture=lambda x: finished.append(x["id"]))

    def capture(run, launches):
        for _ in range(launches):
            run()
        return "graph"
    monkeypatch.setattr(bench, "captured_launches", capture)
    monkeypatch.setattr(bench, "buffer_count", lambda bytes_read: 3)
    graph, sets = bench.timed_graph(kernel, SMALL, device)
    assert graph == "graph" and [s["id"] for s in sets] == [0, 1, 2]
    assert seen == [i % 3 for i in range(bench.LAUNCHES_PER_GRAPH)]
    assert finished == [0, 1, 2]


def test_out_of_gpu_memory_is_one_line_and_exit_2(monkeypatch, capsys):
    def out_of_memory(args, argv):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(bench, "run_checks_and_timings", out_of_memory)
    assert bench.main(["--hidden-sizes", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of GPU memory" in err and "--rows" in err


@pytest.mark.gpu
def test_gpu_timing_gives_a_bandwidth_for_every_kernel(tmp_path):
    out = tmp_path / "bandwidth.json"
    assert bench.main(["--hidden-sizes", "1024", "--rows", "2048", "--rounds", "2", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["kernel"] for r in report["results"]] == kernels.KERNEL_NAMES
    for row in report["results"]:
        assert row["us"] > 0 and row["input_sets"] >= 2
        if report["peak_bandwidth_tbs"]:   # a kernel timed faster than the memory allows would be a timing bug
            assert 0 < row["share_of_peak"] < 1.0
