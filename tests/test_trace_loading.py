"""tinytransformer/profiling/trace.py: reading a trace (plain, gzip, a bare event list) and refusing, in one line,
everything that is not one."""
import gzip
import json

import pytest

from tinytransformer.profiling import analysis
from tinytransformer.profiling.trace import TraceError, load_trace

from .trace_samples import BAD_FILES, EXPECTED_KERNELS_PER_STEP, EXPECTED_PHASE_US, build_gpu_trace


def test_gzip_and_file_round_trip(tmp_path):
    trace = build_gpu_trace("rocm")
    plain, packed = tmp_path / "t.json", tmp_path / "t.pt.trace.json.gz"
    plain.write_text(json.dumps(trace))
    packed.write_bytes(gzip.compress(json.dumps(trace).encode()))
    for path in (plain, packed, str(packed)):
        loaded = load_trace(path)
        assert analysis.kernels_per_step(loaded) == EXPECTED_KERNELS_PER_STEP
        assert analysis.phase_split(path)["us"] == EXPECTED_PHASE_US


def test_bare_event_list_is_accepted():
    assert analysis.kernels_per_step(build_gpu_trace("cuda")["traceEvents"]) == EXPECTED_KERNELS_PER_STEP


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_input_raises_trace_error(tmp_path, name):
    path = tmp_path / name
    if BAD_FILES[name] is not None:
        path.write_bytes(BAD_FILES[name])
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert ("ends too early" in str(caught.value)) == (name == "truncated.json")


def test_directory_is_rejected(tmp_path):
    with pytest.raises(TraceError, match="directory"):
        load_trace(tmp_path)


def test_in_memory_non_trace_is_rejected():
    with pytest.raises(TraceError):
        analysis.kernels_per_step({"events": []})
