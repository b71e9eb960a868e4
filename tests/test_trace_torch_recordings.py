"""The profiling analysis on CPU traces recorded by torch: the committed fixture (tests/fixtures/cpu_trace.json.gz), a
fresh recording made by tests/fixtures/make_cpu_trace.py with the installed torch (so a change in torch's trace
format shows up here), and a recording whose operator table must match torch's own key_averages()."""
import importlib.util
import math

import pytest

from tinytransformer.profiling import analysis
from tinytransformer.profiling.attribution import MODEL_PARTS, PHASES
from tinytransformer.profiling.trace import load_trace

from .trace_samples import CPU_TRACE, FIXTURES


def check_cpu_trace(trace):
    steps = analysis.profiler_steps(trace)
    assert len(steps) == 2 and all(name.startswith("ProfilerStep#") for name, _, _ in steps)
    assert all(start < end for _, start, end in steps)
    assert not analysis.has_device_activity(trace)
    assert analysis.kernels_per_step(trace) is None
    ops = analysis.operators_per_step(trace)
    assert ops is not None and ops > 20 and ops == int(ops)  # both steps run the same ops
    split = analysis.phase_split(trace)
    assert split["basis"] == "cpu"
    for phase in MODEL_PARTS + ("forward_other", "backward", "optimizer"):
        assert split["us"][phase] > 0 and split["rows"][PHASES.index(phase)]["count"] > 0, phase
    assert math.isclose(sum(split["pct"].values()), 100.0)
    rows = analysis.top_operators(trace, sort_by="self_device_time", limit=10)
    assert rows.meta["sort_by"] == "self_cpu_time" and "no device activity" in rows.meta["note"]
    assert len(rows) == 10 and all(row["self_device_us"] == 0.0 for row in rows)
    values = [row["self_cpu_us"] for row in rows]
    assert values == sorted(values, reverse=True)
    assert len(analysis.top_kernels(trace)) == 0


def test_committed_cpu_fixture():
    assert CPU_TRACE.stat().st_size < 300 * 1024
    check_cpu_trace(load_trace(CPU_TRACE))


def test_fresh_cpu_recording_with_installed_torch(tmp_path):
    spec = importlib.util.spec_from_file_location("make_cpu_trace", FIXTURES / "make_cpu_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.record_cpu_trace(tmp_path / "fresh.json")
    check_cpu_trace(load_trace(path))


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
    ours = analysis.top_operators(path, sort_by="self_cpu_memory_usage", limit=None)
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
