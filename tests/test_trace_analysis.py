"""tinytransformer/profiling/attribution.py and analysis.py on a hand-made GPU trace (tests/trace_samples.py) whose
every number is worked out by hand: steps, kernels and operators per step, top kernels and operators, the phase
split, the links from each kernel to its launch, operator, step and phase."""
import math

import pytest

from tinytransformer.profiling import analysis
from tinytransformer.profiling.attribution import PHASES

from .trace_samples import (CPU_TRACE, EXPECTED_DEVICE_MEMORY, EXPECTED_DEVICE_US, EXPECTED_KERNELS_PER_STEP,
                        EXPECTED_OPERATORS, EXPECTED_OPERATORS_PER_STEP, EXPECTED_PHASE_US, EXPECTED_UNATTRIBUTED_US,
                        FLAVOURS, build_gpu_trace)


@pytest.fixture(params=sorted(FLAVOURS))
def flavour(request):
    return request.param


def rows_by_name(rows):
    return {row["name"]: row for row in rows}


def test_profiler_steps_come_from_host_ranges_only(flavour):
    assert analysis.profiler_steps(build_gpu_trace(flavour)) == [
        ("ProfilerStep#1", 0.0, 1000.0),
        ("ProfilerStep#2", 1000.0, 2000.0),
    ]


def test_kernels_per_step_counts_kernels_launched_inside_steps(flavour):
    trace = build_gpu_trace(flavour)
    assert analysis.has_device_activity(trace)
    assert analysis.kernels_per_step(trace) == EXPECTED_KERNELS_PER_STEP


def test_operators_per_step_counts_top_level_aten_ops(flavour):
    assert analysis.operators_per_step(build_gpu_trace(flavour)) == EXPECTED_OPERATORS_PER_STEP


def test_top_kernels_totals(flavour):
    gemm_name = FLAVOURS[flavour]["gemm"]
    rows = analysis.top_kernels(build_gpu_trace(flavour), limit=None)
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
    assert [row["name"] for row in analysis.top_kernels(build_gpu_trace(flavour), limit=3)] == [
        gemm_name, "softmax_kernel", "mul_kernel"]


def test_phase_split_device_time(flavour):
    split = analysis.phase_split(build_gpu_trace(flavour))
    assert split["basis"] == "device"
    assert split["us"] == EXPECTED_PHASE_US
    assert split["total_us"] == EXPECTED_DEVICE_US
    assert math.isclose(sum(split["pct"].values()), 100.0)
    assert math.isclose(split["pct"]["attention"], 100.0 * 150.0 / EXPECTED_DEVICE_US)
    assert [row["phase"] for row in split["rows"]] == list(PHASES)
    assert split["rows"][0]["us_per_step"] == 75.0  # attention, 2 steps


@pytest.mark.parametrize("backward_range, autograd_wrapper", [(True, False), (False, True)])
def test_backward_found_by_either_rule(backward_range, autograd_wrapper):
    """Either the main thread's "backward" window or the autograd engine's wrapper op is enough."""
    trace = build_gpu_trace("cuda", with_backward_range=backward_range,
                            with_autograd_wrapper=autograd_wrapper)
    assert analysis.phase_split(trace)["us"]["backward"] == 60.0


def test_backward_kernel_without_either_rule_is_other():
    trace = build_gpu_trace("cuda", with_backward_range=False, with_autograd_wrapper=False)
    assert analysis.phase_split(trace)["us"]["backward"] == 0.0
    assert analysis.phase_split(trace)["us"]["other"] == 14.0 + 60.0


def test_self_device_time_goes_to_innermost_operator(flavour):
    rows = analysis.top_operators(build_gpu_trace(flavour), sort_by="self_device_time", limit=None)
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
    rows = analysis.top_operators(build_gpu_trace("cuda"), sort_by="self_cuda_memory_usage", limit=None)
    assert rows.meta["has_memory"] and rows.meta["sort_by"] == "self_device_memory_usage"
    by_name = rows_by_name(rows)
    for name, (self_bytes, total_bytes) in EXPECTED_DEVICE_MEMORY.items():
        row = by_name[name]
        assert (row["self_device_mem_bytes"], row["device_mem_bytes"]) == (self_bytes, total_bytes), name
    assert by_name["aten::embedding"]["self_cpu_mem_bytes"] == 64
    assert by_name["aten::embedding"]["self_device_mem_bytes"] == 0
    assert [row["name"] for row in rows[:2]] == ["aten::mm", "aten::_softmax"]


def test_memory_sort_without_memory_events_falls_back():
    rows = analysis.top_operators(CPU_TRACE, sort_by="self_device_memory_usage", limit=5)
    assert rows.meta["sort_by"] == "self_cpu_time"
    assert "no memory events" in rows.meta["note"] and "no device" not in rows.meta["note"]


def test_self_cpu_time_subtracts_direct_children():
    by_name = rows_by_name(analysis.top_operators(build_gpu_trace("cuda"), limit=None))
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
    rows = analysis.top_operators(build_gpu_trace("cuda"), sort_by=key, limit=None)
    values = [row[field] for row in rows]
    assert values == sorted(values, reverse=True)
    assert rows.meta["sort_by"] == analysis.canonical_sort_key(key)


def test_unknown_sort_key_is_rejected():
    with pytest.raises(ValueError, match="unknown sort key"):
        analysis.top_operators(build_gpu_trace("cuda"), sort_by="flops")


def test_device_kernels_records_links():
    records = {rec["correlation"]: rec for rec in analysis.device_kernels(build_gpu_trace("cuda"))}
    assert records[3]["launch"] == "cudaLaunchKernel" and records[3]["operator"] == "aten::mm"
    assert records[3]["phase"] == "attention" and records[3]["step"] == "ProfilerStep#1"
    assert records[3]["issued_us"] == 120.0
    assert records[11]["launch"] is None and records[11]["operator"] == "aten::mm"  # via External id
    assert records[12]["operator"] is None and records[12]["issued_us"] == 1500.0  # linked to nothing
    assert records[13]["step"] is None  # launched after the last step
    assert records[14]["operator"] == "cuLaunchKernel" and records[14]["phase"] == "rope"
    kernels_only = analysis.device_kernels(build_gpu_trace("cuda"), include_memory_ops=False)
    assert {rec["category"] for rec in kernels_only} == {"kernel"} and len(kernels_only) == len(records) - 2


def test_phase_split_on_cpu_basis():
    split = analysis.phase_split(build_gpu_trace("cuda"), basis="cpu")
    assert split["basis"] == "cpu" and "CPU self time" in split["label"]
    # attention: step 1 aten::mm 85 + launch 5, softmax 20, _softmax 55 + launch 5; step 2 aten::mm 85 + 5
    assert split["us"]["attention"] == 260.0
    assert split["us"]["backward"] == 4.0 + 16.0 + 65.0 + 5.0  # wrapper 90-86, node 86-70, mm 70-5, launch


def test_compare_traces_side_by_side():
    rows = analysis.compare_traces({"v1": build_gpu_trace("cuda"), "v2": build_gpu_trace("rocm")})
    assert [row["version"] for row in rows] == ["v1", "v2"]
    assert rows[0]["kernels_per_step"] == rows[1]["kernels_per_step"] == EXPECTED_KERNELS_PER_STEP
    assert rows[0]["attention_us_per_step"] == 75.0
