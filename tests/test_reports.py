"""Tests of tinytransformer/reports.py: trace loading, kernels per step, operator/kernel tables, phase split.

Two kinds of input:
- a hand-made GPU-style trace with known numbers (below), in three flavours: CUDA, ROCm, and one where
  every launch is a driver call; every expected number is worked out by hand in the comments;
- tests/fixtures/cpu_trace.json.gz, recorded by tests/fixtures/make_cpu_trace.py with torch on CPU, and a
  fresh recording made by that script, so a change in torch's trace format shows up here.
"""
import gzip
import importlib.util
import json
import math
from pathlib import Path

import pytest

from tinytransformer import reports
from tinytransformer.reports import TraceError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CPU_TRACE = FIXTURES / "cpu_trace.json.gz"

# ----------------------------------------------------------------------------------------------------------
# A hand-made GPU trace
# ----------------------------------------------------------------------------------------------------------

HOST_PID, MAIN, AUTOGRAD = 4242, 4242, 4250  # process, main thread, autograd's device thread
GPU_PID, STREAM = 0, 7

# How each vendor names things. The analysis must only rely on categories and links, never on these names.
FLAVOURS = {
    "cuda": {
        "launch": ("cuda_runtime", "cudaLaunchKernel"),
        "driver_launch": ("cuda_driver", "cuLaunchKernel"),
        "memcpy": ("cuda_runtime", "cudaMemcpyAsync"),
        "memset": ("cuda_runtime", "cudaMemsetAsync"),
        "gemm": "ampere_sgemm_128x64_tn",
    },
    "rocm": {
        "launch": ("cuda_runtime", "hipLaunchKernel"),
        "driver_launch": ("cuda_runtime", "hipModuleLaunchKernel"),
        "memcpy": ("cuda_runtime", "hipMemcpyWithStream"),
        "memset": ("cuda_runtime", "hipMemsetAsync"),
        "gemm": "Cijk_Ailk_Bljk_SB_MT64x64x16_SN_1LDSB0",
    },
    "driver_only": {  # e.g. a fully Triton model: every launch is a driver call
        "launch": ("cuda_driver", "cuLaunchKernel"),
        "driver_launch": ("cuda_driver", "cuLaunchKernel"),
        "memcpy": ("cuda_driver", "cuMemcpyAsync"),
        "memset": ("cuda_driver", "cuMemsetD32Async"),
        "gemm": "matmul_kernel_0d1d2d3d",
    },
}


class TraceBuilder:
    """Writes events the way torch's exporter does (float us, args with correlation / External id)."""

    def __init__(self, flavour: dict):
        self.flavour = flavour
        self.events = [
            {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_name", "pid": GPU_PID, "tid": 0, "args": {"name": "GPU 0"}},
        ]
        self.external_id = 0

    def _x(self, cat, name, start, end, pid=HOST_PID, tid=MAIN, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": float(start), "dur": float(end - start), "args": args})

    def annotate(self, name, start, end, tid=MAIN):
        self.external_id += 1
        self._x("user_annotation", name, start, end, tid=tid, **{"External id": self.external_id})

    def op(self, name, start, end, tid=MAIN) -> int:
        self.external_id += 1
        self._x("cpu_op", name, start, end, tid=tid, **{"External id": self.external_id})
        return self.external_id

    def launch(self, correlation, start, tid=MAIN, which="launch", external_id=None):
        cat, name = self.flavour[which]
        args = {"correlation": correlation, "cbid": 211}
        if external_id is not None:
            args["External id"] = external_id
        self._x(cat, name, start, start + 5, tid=tid, **args)

    def memory(self, size, at, device=True, tid=MAIN):
        """An allocation (size > 0) or a free (size < 0), as profile_memory=True records them."""
        args = {"Bytes": size, "Device Type": 1 if device else 0, "Device Id": 0 if device else -1}
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                            "pid": HOST_PID, "tid": tid, "ts": float(at), "args": args})

    def kernel(self, name, correlation, dur, start, cat="kernel", external_id=None):
        name = self.flavour.get(name, name)
        args = {"device": 0, "stream": STREAM, "grid": [4, 1, 1], "block": [256, 1, 1]}
        if correlation is not None:
            args["correlation"] = correlation
        if external_id is not None:
            args["External id"] = external_id
        self._x(cat, name, start, start + dur, pid=GPU_PID, tid=STREAM, **args)
        # torch also writes a flow arrow from launch to kernel, and replays ranges on the GPU timeline
        self.events.append({"ph": "f", "id": correlation, "pid": GPU_PID, "tid": STREAM, "ts": float(start),
                            "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def launched_kernel(self, name, correlation, dur, at, tid=MAIN, which="launch", cat="kernel"):
        """A launch call at `at` on the host and its kernel 5 us later on the GPU."""
        self.launch(correlation, at, tid=tid, which=which)
        self.kernel(name, correlation, dur, start=at + 5, cat=cat)


def build_gpu_trace(flavour="cuda", with_backward_range=True, with_autograd_wrapper=True) -> dict:
    t = TraceBuilder(FLAVOURS[flavour])

    # ---- step 1: [0, 1000] --------------------------------------------------------------------------------
    t.annotate("ProfilerStep#1", 0, 1000)
    t.annotate("forward", 10, 400)
    t.op("aten::embedding", 12, 18)
    t.memory(64, at=12.5, device=False)  # CPU memory: aten::embedding +64 (before its launch call)
    t.launched_kernel("embedding_kernel", 1, dur=2, at=13)  # forward_other: 2
    t.annotate("rmsnorm", 20, 60)
    t.op("aten::mul", 25, 55)
    t.launched_kernel("mul_kernel", 2, dur=4, at=30)  # rmsnorm: 4
    t.annotate("rope", 70, 90)
    # A Triton kernel launched straight from Python: no op around it, the launch call owns it.
    t.launched_kernel("triton_rope_kernel", 14, dur=7, at=75, which="driver_launch")  # rope: 7
    t.annotate("attention", 100, 300)
    t.op("aten::mm", 110, 200)
    t.memory(4096, at=115)  # device memory: aten::mm +4096
    t.launched_kernel("gemm", 3, dur=50, at=120)  # attention: 50
    t.op("aten::softmax", 210, 290)
    t.op("aten::_softmax", 220, 280)
    t.memory(1024, at=225)  # aten::_softmax +1024 (self and total), aten::softmax +1024 (total)
    t.launched_kernel("softmax_kernel", 4, dur=10, at=230, which="driver_launch")  # attention: 10
    t.memory(-1024, at=285)  # after aten::_softmax ended: aten::softmax -1024 (self and total)
    t.annotate("ffn", 300, 390)
    t.op("aten::mm", 310, 380)
    t.launched_kernel("gemm", 5, dur=30, at=320)  # ffn: 30
    if with_backward_range:
        t.annotate("backward", 400, 800)
    # The autograd engine runs the backward pass on its own thread: the range above does not enclose it.
    if with_autograd_wrapper:
        t.op("autograd::engine::evaluate_function: MmBackward0", 410, 500, tid=AUTOGRAD)
    t.op("MmBackward0", 412, 498, tid=AUTOGRAD)
    t.op("aten::mm", 420, 490, tid=AUTOGRAD)
    t.launched_kernel("gemm", 6, dur=60, at=430, tid=AUTOGRAD)  # backward: 60
    t.annotate("optimizer", 800, 900)
    t.op("aten::_foreach_add_", 810, 850)
    t.launched_kernel("multi_tensor_apply_kernel", 7, dur=8, at=820)  # optimizer: 8
    t.op("aten::zero_", 860, 880)
    t.launched_kernel("Memset (Device)", 8, dur=1, at=865, which="memset", cat="gpu_memset")  # optimizer: 1
    t.op("aten::copy_", 950, 970)
    t.launched_kernel("Memcpy HtoD (Pageable -> Device)", 9, dur=3, at=955, which="memcpy",
                      cat="gpu_memcpy")  # other: 3
    t.launch(99, 980)  # a runtime call that launches nothing (think cudaDeviceSynchronize)

    # ---- step 2: [1000, 2000] -----------------------------------------------------------------------------
    t.annotate("ProfilerStep#2", 1000, 2000)
    t.annotate("forward", 1010, 1420)
    t.annotate("attention", 1100, 1300)
    mm_id = t.op("aten::mm", 1110, 1200)
    t.launched_kernel("gemm", 10, dur=50, at=1120)  # attention: 50
    # A kernel whose launch is missing from the trace: linked to its op through "External id".
    t.kernel("gemm", 11, dur=40, start=1190, external_id=mm_id)  # attention: 40
    t.annotate("rope", 1210, 1260)  # nested inside attention: the innermost range wins
    t.op("aten::mul", 1215, 1255)
    t.launched_kernel("mul_kernel", 17, dur=4, at=1220)  # rope: 4
    t.annotate("output_head", 1300, 1350)
    t.op("aten::mm", 1305, 1345)
    t.launched_kernel("gemm", 15, dur=20, at=1310)  # output_head: 20
    t.annotate("loss", 1350, 1400)
    t.op("aten::nll_loss", 1355, 1395)
    t.launched_kernel("nll_loss_kernel", 16, dur=3, at=1360)  # loss: 3
    # A kernel linked to nothing: it keeps its own start time (1500, inside step 2).
    t.kernel("mystery_kernel", 12, dur=5, start=1500)  # other: 5, charged to no operator

    # ---- after the last step ------------------------------------------------------------------------------
    t.op("aten::add", 2100, 2150)
    t.launched_kernel("add_kernel", 13, dur=6, at=2110)  # other: 6, in no step

    # ---- noise the analysis must ignore ------------------------------------------------------------------
    t.events += [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": GPU_PID, "tid": STREAM,
         "ts": 0.0, "dur": 1000.0, "args": {}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "attention", "pid": GPU_PID, "tid": STREAM,
         "ts": 120.0, "dur": 500.0, "args": {}},
        {"ph": "X", "cat": "python_function", "name": "train.py(10): step", "pid": HOST_PID, "tid": MAIN,
         "ts": 5.0, "dur": 990.0, "args": {"Python id": 1}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 0.0, "dur": 3000.0, "args": {"Op count": 0}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": HOST_PID, "tid": MAIN, "ts": 50.0,
         "s": "t", "args": {}},
        {"ph": "s", "id": 3, "pid": HOST_PID, "tid": MAIN, "ts": 120.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "X", "cat": "kernel", "name": "broken_kernel", "pid": GPU_PID, "tid": STREAM, "ts": "n/a",
         "dur": 1.0, "args": {}},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Test GPU"}], "displayTimeUnit": "ms",
            "traceEvents": t.events}


# Worked out by hand from the comments above.
EXPECTED_DEVICE_US = 303.0  # 2+4+7+50+10+30+60+8+1+3 (step 1) + 50+40+4+20+3+5 (step 2) + 6 (after)
EXPECTED_KERNELS_PER_STEP = 7.0  # step 1: 8 kernels (the memset and memcpy are not kernels), step 2: 6
EXPECTED_OPERATORS_PER_STEP = 6.5  # step 1: 9 top-level aten ops (aten::_softmax is nested), step 2: 4
EXPECTED_PHASE_US = {
    "attention": 150.0,  # 50 + 10 + 50 + 40
    "ffn": 30.0,
    "rmsnorm": 4.0,
    "rope": 11.0,  # 7 + 4
    "output_head": 20.0,
    "loss": 3.0,
    "forward_other": 2.0,
    "backward": 60.0,
    "optimizer": 9.0,  # 8 + 1 (memset)
    "other": 14.0,  # 3 (memcpy) + 5 (unlinked) + 6 (after the steps)
}
# operator -> (calls, self device us, total device us)
EXPECTED_OPERATORS = {
    "aten::mm": (5, 250.0, 250.0),  # 50 + 30 + 60 + 50 + 40 (via External id) + 20
    "aten::softmax": (1, 0.0, 10.0),
    "aten::_softmax": (1, 10.0, 10.0),
    "aten::mul": (2, 8.0, 8.0),
    "aten::embedding": (1, 2.0, 2.0),
    "MmBackward0": (1, 0.0, 60.0),
    "autograd::engine::evaluate_function: MmBackward0": (1, 0.0, 60.0),
    "aten::_foreach_add_": (1, 8.0, 8.0),
    "aten::zero_": (1, 1.0, 1.0),
    "aten::copy_": (1, 3.0, 3.0),
    "aten::nll_loss": (1, 3.0, 3.0),
    "aten::add": (1, 6.0, 6.0),
}
EXPECTED_UNATTRIBUTED_US = 5.0  # the mystery kernel
# operator -> (self device bytes, total device bytes); aten::mm's 4096 were allocated in step 1 only
EXPECTED_DEVICE_MEMORY = {
    "aten::mm": (4096, 4096),
    "aten::_softmax": (1024, 1024),
    "aten::softmax": (-1024, 0),
}


@pytest.fixture(params=sorted(FLAVOURS))
def flavour(request):
    return request.param


def rows_by_name(rows):
    return {row["name"]: row for row in rows}


# ----------------------------------------------------------------------------------------------------------
# GPU trace: exact numbers
# ----------------------------------------------------------------------------------------------------------


def test_profiler_steps_come_from_host_ranges_only(flavour):
    assert reports.profiler_steps(build_gpu_trace(flavour)) == [
        ("ProfilerStep#1", 0.0, 1000.0),
        ("ProfilerStep#2", 1000.0, 2000.0),
    ]


def test_kernels_per_step_counts_kernels_launched_inside_steps(flavour):
    trace = build_gpu_trace(flavour)
    assert reports.has_device_activity(trace)
    assert reports.kernels_per_step(trace) == EXPECTED_KERNELS_PER_STEP


def test_operators_per_step_counts_top_level_aten_ops(flavour):
    assert reports.operators_per_step(build_gpu_trace(flavour)) == EXPECTED_OPERATORS_PER_STEP


def test_top_kernels_totals(flavour):
    gemm_name = FLAVOURS[flavour]["gemm"]
    rows = reports.top_kernels(build_gpu_trace(flavour), limit=None)
    assert rows.meta["device_time_us"] == EXPECTED_DEVICE_US
    assert math.isclose(sum(row["pct_device_time"] for row in rows), 100.0)
    gemm = rows[0]  # the longest in total comes first
    assert gemm["name"] == gemm_name
    assert (gemm["calls"], gemm["total_us"], gemm["min_us"], gemm["max_us"]) == (6, 250.0, 20.0, 60.0)
    assert math.isclose(gemm["mean_us"], 250.0 / 6)
    assert math.isclose(gemm["pct_device_time"], 100.0 * 250.0 / EXPECTED_DEVICE_US)
    by_name = rows_by_name(rows)
    # No "broken_kernel" (no usable timestamp), no "ProfilerStep#1"/"attention" (gpu_user_annotation).
    assert set(by_name) == {
        gemm_name, "mul_kernel", "embedding_kernel", "triton_rope_kernel", "softmax_kernel",
        "multi_tensor_apply_kernel", "Memset (Device)", "Memcpy HtoD (Pageable -> Device)",
        "nll_loss_kernel", "mystery_kernel", "add_kernel",
    }
    assert (by_name["mul_kernel"]["calls"], by_name["mul_kernel"]["total_us"]) == (2, 8.0)
    assert by_name["Memset (Device)"]["category"] == "gpu_memset"
    assert by_name["Memcpy HtoD (Pageable -> Device)"]["category"] == "gpu_memcpy"
    assert by_name["triton_rope_kernel"]["category"] == "kernel"
    # Ties (mul_kernel and multi_tensor_apply_kernel, 8 us each) are broken by name.
    assert [row["name"] for row in reports.top_kernels(build_gpu_trace(flavour), limit=3)] == [
        gemm_name, "softmax_kernel", "mul_kernel"]


def test_phase_split_device_time(flavour):
    split = reports.phase_split(build_gpu_trace(flavour))
    assert split["basis"] == "device"
    assert split["us"] == EXPECTED_PHASE_US
    assert split["total_us"] == EXPECTED_DEVICE_US
    assert math.isclose(sum(split["pct"].values()), 100.0)
    assert math.isclose(split["pct"]["attention"], 100.0 * 150.0 / EXPECTED_DEVICE_US)
    assert [row["phase"] for row in split["rows"]] == list(reports.PHASES)
    assert split["rows"][0]["us_per_step"] == 75.0  # attention, 2 steps


@pytest.mark.parametrize("backward_range, autograd_wrapper", [(True, False), (False, True)])
def test_backward_found_by_either_rule(backward_range, autograd_wrapper):
    """Either the main thread's "backward" window or the autograd engine's wrapper op is enough."""
    trace = build_gpu_trace("cuda", with_backward_range=backward_range,
                            with_autograd_wrapper=autograd_wrapper)
    assert reports.phase_split(trace)["us"]["backward"] == 60.0


def test_backward_kernel_without_either_rule_is_other():
    trace = build_gpu_trace("cuda", with_backward_range=False, with_autograd_wrapper=False)
    assert reports.phase_split(trace)["us"]["backward"] == 0.0
    assert reports.phase_split(trace)["us"]["other"] == 14.0 + 60.0


def test_self_device_time_goes_to_innermost_operator(flavour):
    rows = reports.top_operators(build_gpu_trace(flavour), sort_by="self_device_time", limit=None)
    by_name = rows_by_name(rows)
    for name, (calls, self_us, total_us) in EXPECTED_OPERATORS.items():
        row = by_name[name]
        assert (row["calls"], row["self_device_us"], row["device_us"]) == (calls, self_us, total_us), name
    assert rows[0]["name"] == "aten::mm"
    assert rows.meta["unattributed_device_us"] == EXPECTED_UNATTRIBUTED_US
    assert rows.meta["note"] is None and rows.meta["sort_by"] == "self_device_time"
    # The Triton kernel launched straight from Python is owned by its launch call (7 us); the launch
    # calls made inside ops own nothing, so the launch rows hold exactly those 7 us.
    launch_names = {FLAVOURS[flavour][key][1] for key in ("launch", "driver_launch", "memcpy", "memset")}
    launch_rows = [row for row in rows if row["name"] in launch_names]
    assert sum(row["self_device_us"] for row in launch_rows) == 7.0
    assert sum(row["self_device_us"] for row in rows) + EXPECTED_UNATTRIBUTED_US == EXPECTED_DEVICE_US


def test_memory_goes_to_innermost_operator():
    rows = reports.top_operators(build_gpu_trace("cuda"), sort_by="self_cuda_memory_usage", limit=None)
    assert rows.meta["has_memory"] and rows.meta["sort_by"] == "self_device_memory_usage"
    by_name = rows_by_name(rows)
    for name, (self_bytes, total_bytes) in EXPECTED_DEVICE_MEMORY.items():
        row = by_name[name]
        assert (row["self_device_mem_bytes"], row["device_mem_bytes"]) == (self_bytes, total_bytes), name
    assert by_name["aten::embedding"]["self_cpu_mem_bytes"] == 64
    assert by_name["aten::embedding"]["self_device_mem_bytes"] == 0
    assert [row["name"] for row in rows[:2]] == ["aten::mm", "aten::_softmax"]


def test_memory_sort_without_memory_events_falls_back():
    rows = reports.top_operators(CPU_TRACE, sort_by="self_device_memory_usage", limit=5)
    assert rows.meta["sort_by"] == "self_cpu_time"
    assert "no memory events" in rows.meta["note"] and "no device" not in rows.meta["note"]


def test_self_cpu_time_subtracts_direct_children():
    by_name = rows_by_name(reports.top_operators(build_gpu_trace("cuda"), limit=None))
    assert by_name["aten::softmax"]["self_cpu_us"] == 20.0  # 80 - 60 (aten::_softmax)
    assert by_name["aten::softmax"]["cpu_us"] == 80.0
    assert by_name["aten::_softmax"]["self_cpu_us"] == 55.0  # 60 - 5 (its launch call)
    # Launch calls are rows too: 11 kernel launches + 1 call that launches nothing, 2 driver launches.
    assert by_name["cudaLaunchKernel"]["calls"] == 12 and by_name["cudaLaunchKernel"]["cpu_us"] == 60.0
    assert by_name["cuLaunchKernel"]["calls"] == 2
    assert by_name["cudaMemsetAsync"]["calls"] == 1 and by_name["cudaMemcpyAsync"]["calls"] == 1


@pytest.mark.parametrize("key, field", [
    ("self_device_time", "self_device_us"), ("self_cuda_time_total", "self_device_us"),
    ("self_device_time_total", "self_device_us"), ("device_time", "device_us"),
    ("cuda_time_total", "device_us"), ("device_time_total", "device_us"), ("self_cpu_time", "self_cpu_us"),
    ("self_cpu_time_total", "self_cpu_us"), ("cpu_time", "cpu_us"), ("cpu_time_total", "cpu_us"),
    ("count", "calls"),
])
def test_sort_keys_and_torch_aliases(key, field):
    rows = reports.top_operators(build_gpu_trace("cuda"), sort_by=key, limit=None)
    values = [row[field] for row in rows]
    assert values == sorted(values, reverse=True)
    assert rows.meta["sort_by"] == reports.canonical_sort_key(key)


def test_unknown_sort_key_is_rejected():
    with pytest.raises(ValueError, match="unknown sort key"):
        reports.top_operators(build_gpu_trace("cuda"), sort_by="flops")


def test_device_kernels_records_links():
    records = {rec["correlation"]: rec for rec in reports.device_kernels(build_gpu_trace("cuda"))}
    assert records[3]["launch"] == "cudaLaunchKernel" and records[3]["operator"] == "aten::mm"
    assert records[3]["phase"] == "attention" and records[3]["step"] == "ProfilerStep#1"
    assert records[3]["issued_us"] == 120.0
    assert records[11]["launch"] is None and records[11]["operator"] == "aten::mm"  # via External id
    assert records[12]["operator"] is None and records[12]["issued_us"] == 1500.0  # linked to nothing
    assert records[13]["step"] is None  # launched after the last step
    assert records[14]["operator"] == "cuLaunchKernel" and records[14]["phase"] == "rope"
    kernels_only = reports.device_kernels(build_gpu_trace("cuda"), include_memory_ops=False)
    assert {rec["category"] for rec in kernels_only} == {"kernel"} and len(kernels_only) == len(records) - 2


def test_phase_split_on_cpu_basis():
    split = reports.phase_split(build_gpu_trace("cuda"), basis="cpu")
    assert split["basis"] == "cpu" and "CPU self time" in split["label"]
    # attention: step 1 aten::mm 85 + launch 5, softmax 20, _softmax 55 + launch 5; step 2 aten::mm 85 + 5
    assert split["us"]["attention"] == 260.0
    assert split["us"]["backward"] == 4.0 + 16.0 + 65.0 + 5.0  # wrapper 90-86, node 86-70, mm 70-5, launch


def test_gzip_and_file_round_trip(tmp_path):
    trace = build_gpu_trace("rocm")
    plain, packed = tmp_path / "t.json", tmp_path / "t.pt.trace.json.gz"
    plain.write_text(json.dumps(trace))
    packed.write_bytes(gzip.compress(json.dumps(trace).encode()))
    for path in (plain, packed, str(packed)):
        loaded = reports.load_trace(path)
        assert reports.kernels_per_step(loaded) == EXPECTED_KERNELS_PER_STEP
        assert reports.phase_split(path)["us"] == EXPECTED_PHASE_US


def test_bare_event_list_is_accepted():
    assert reports.kernels_per_step(build_gpu_trace("cuda")["traceEvents"]) == EXPECTED_KERNELS_PER_STEP


def test_write_reports_and_summary(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(build_gpu_trace("cuda")))
    result = reports.write_reports(path, tmp_path / "out", sort_by="cuda_time_total", limit=5)
    assert sorted(result) == ["kernels.csv", "operators.csv", "phases.csv", "summary.md"]  # paths only
    for path in result.values():
        assert path.is_file() and path.stat().st_size > 0
    summary = result.summary
    assert summary["kernels_per_step"] == EXPECTED_KERNELS_PER_STEP
    assert summary["device_us_per_step"] == (EXPECTED_DEVICE_US - 6.0) / 2  # add_kernel is after the steps
    assert summary["sort_by"] == "device_time" and summary["steps"] == 2
    json.dumps(summary)  # fit for a metrics file
    phases_csv = result["phases.csv"].read_text().splitlines()
    assert phases_csv[0] == "phase,us,pct,count,us_per_step"
    assert phases_csv[1].startswith("attention,150.0,")
    assert len(result["operators.csv"].read_text().splitlines()) > 6  # every row, not only the top 5
    markdown = result["summary.md"].read_text()
    assert "Kernels per step: 7.0" in markdown and "| attention | 150.0 |" in markdown


def test_compare_traces_side_by_side():
    rows = reports.compare_traces({"v1": build_gpu_trace("cuda"), "v2": build_gpu_trace("rocm")})
    assert [row["version"] for row in rows] == ["v1", "v2"]
    assert rows[0]["kernels_per_step"] == rows[1]["kernels_per_step"] == EXPECTED_KERNELS_PER_STEP
    assert rows[0]["attention_us_per_step"] == 75.0


def test_cli_prints_tables_for_a_gpu_trace(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(build_gpu_trace("cuda")))
    assert reports.main([str(path), "--sort-by", "self_cuda_time_total", "--limit", "4",
                         "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Kernels per step: 7.0" in out and "Top kernels" in out and "ampere_sgemm_128x64_tn" in out
    assert (tmp_path / "out" / "summary.md").is_file()


# ----------------------------------------------------------------------------------------------------------
# CPU traces recorded by torch
# ----------------------------------------------------------------------------------------------------------


def check_cpu_trace(trace):
    steps = reports.profiler_steps(trace)
    assert len(steps) == 2 and all(name.startswith("ProfilerStep#") for name, _, _ in steps)
    assert all(start < end for _, start, end in steps)
    assert not reports.has_device_activity(trace)
    assert reports.kernels_per_step(trace) is None
    ops = reports.operators_per_step(trace)
    assert ops is not None and ops > 20 and ops == int(ops)  # both steps run the same ops
    split = reports.phase_split(trace)
    assert split["basis"] == "cpu"
    for phase in reports.MODEL_PARTS + ("forward_other", "backward", "optimizer"):
        assert split["us"][phase] > 0 and split["rows"][reports.PHASES.index(phase)]["count"] > 0, phase
    assert math.isclose(sum(split["pct"].values()), 100.0)
    rows = reports.top_operators(trace, sort_by="self_device_time", limit=10)
    assert rows.meta["sort_by"] == "self_cpu_time" and "no device activity" in rows.meta["note"]
    assert len(rows) == 10 and all(row["self_device_us"] == 0.0 for row in rows)
    values = [row["self_cpu_us"] for row in rows]
    assert values == sorted(values, reverse=True)
    assert len(reports.top_kernels(trace)) == 0


def test_committed_cpu_fixture():
    assert CPU_TRACE.stat().st_size < 300 * 1024
    check_cpu_trace(reports.load_trace(CPU_TRACE))


def test_fresh_cpu_recording_with_installed_torch(tmp_path):
    spec = importlib.util.spec_from_file_location("make_cpu_trace", FIXTURES / "make_cpu_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.record_cpu_trace(tmp_path / "fresh.json")
    check_cpu_trace(reports.load_trace(path))


def test_cpu_tables_match_torch_key_averages(tmp_path):
    """Calls, CPU times and memory per operator agree with torch's own table for the same recording."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, labels = torch.randn(16, 32), torch.zeros(16, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    path = tmp_path / "memory.json"
    prof.export_chrome_trace(str(path))
    theirs = {event.key: event for event in prof.key_averages()}
    ours = reports.top_operators(path, sort_by="self_cpu_memory_usage", limit=None)
    assert len(ours) > 20 and ours.meta["has_memory"]
    for row in ours:
        event = theirs[row["name"]]
        assert row["calls"] == event.count, row["name"]
        assert (row["self_cpu_mem_bytes"], row["cpu_mem_bytes"]) == (event.self_cpu_memory_usage,
                                                                     event.cpu_memory_usage), row["name"]
        # the file rounds every time to 1 ns
        close = dict(rel_tol=1e-3, abs_tol=0.05)
        assert math.isclose(row["self_cpu_us"], event.self_cpu_time_total, **close), row["name"]
        assert math.isclose(row["cpu_us"], event.cpu_time_total, **close), row["name"]


def test_cli_on_cpu_fixture(tmp_path, capsys):
    assert reports.main([str(CPU_TRACE), "--limit", "5", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Kernels per step: n/a" in out and "sorted by self_cpu_time" in out
    assert "Top kernels" not in out
    header = (tmp_path / "operators.csv").read_text().splitlines()[0]
    assert header == ",".join(reports.OPERATOR_COLUMNS)
    assert header.startswith("name,calls,self_cpu_us,cpu_us,self_device_us,device_us,self_cpu_mem_bytes")


# ----------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------

BAD_FILES = {
    "missing.json": None,
    "random.bin": bytes(range(256)) * 4,
    "not_utf8.json": b"\xff\xfe\x00garbage",
    "truncated.json": b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1',
    "object.json": b'{"hello": "world"}',
    "numbers.json": b"[1, 2, 3]",
    "no_events.json": b'{"traceEvents": []}',
    "only_metadata.json": b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {}}]}',
    "bad_gzip.json.gz": b"\x1f\x8b" + b"not really gzip",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_input_raises_trace_error(tmp_path, name):
    path = tmp_path / name
    if BAD_FILES[name] is not None:
        path.write_bytes(BAD_FILES[name])
    with pytest.raises(TraceError) as caught:
        reports.load_trace(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert ("ends too early" in str(caught.value)) == (name == "truncated.json")


@pytest.mark.parametrize("name", ["missing.json", "random.bin", "object.json", "truncated.json"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, name):
    path = tmp_path / name
    if BAD_FILES[name] is not None:
        path.write_bytes(BAD_FILES[name])
    with pytest.raises(SystemExit) as exited:
        reports.main([str(path)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in captured.err


def test_directory_is_rejected(tmp_path):
    with pytest.raises(TraceError, match="directory"):
        reports.load_trace(tmp_path)


def test_in_memory_non_trace_is_rejected():
    with pytest.raises(TraceError):
        reports.kernels_per_step({"events": []})


def test_cli_rejects_bad_options(tmp_path):
    for argv in ([str(CPU_TRACE), "--sort-by", "flops"], [str(CPU_TRACE), "--limit", "-1"], []):
        with pytest.raises(SystemExit) as exited:
            reports.main(argv)
        assert exited.value.code == 2


# ----------------------------------------------------------------------------------------------------------
# Text tables
# ----------------------------------------------------------------------------------------------------------


def test_format_table_aligns_and_shortens():
    rows = [{"name": "aten::mm", "calls": 1234, "us": 3.14159},
            {"name": "x" * 100, "calls": 7, "us": None}]
    lines = reports.format_table(rows, ["name", ("calls", "n"), "us"], max_width=20).splitlines()
    assert lines[0].split() == ["name", "n", "us"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("aten::mm") and lines[2].rstrip().endswith("3.1")
    assert "1,234" in lines[2] and ("x" * 17 + "...") in lines[3] and lines[3].rstrip().endswith("-")
    # numbers are right-aligned: the calls column ends at the same place in every row
    assert lines[2].index("1,234") + 5 == lines[3].index("7") + 1
    assert "(no rows)" in reports.format_table([], ["name", "calls"])
