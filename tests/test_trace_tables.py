"""tinytransformer/profiling/tables.py: the report files written beside a trace, and fixed-width text tables."""
import json

from tinytransformer.profiling.tables import format_table, write_reports

from .trace_samples import EXPECTED_DEVICE_US, EXPECTED_KERNELS_PER_STEP, build_gpu_trace


def test_write_reports_and_summary(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(build_gpu_trace("cuda")))
    result = write_reports(path, tmp_path / "out", sort_by="cuda_time_total", limit=5)
    assert sorted(result) == ["families.csv", "kernels.csv", "operators.csv", "phases.csv", "summary.md"]  # paths only
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


def test_format_table_aligns_and_shortens():
    rows = [{"name": "aten::mm", "calls": 1234, "us": 3.14159},
            {"name": "x" * 100, "calls": 7, "us": None}]
    lines = format_table(rows, ["name", ("calls", "n"), "us"], max_width=20).splitlines()
    assert lines[0].split() == ["name", "n", "us"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("aten::mm") and lines[2].rstrip().endswith("3.1")
    assert "1,234" in lines[2] and ("x" * 17 + "...") in lines[3] and lines[3].rstrip().endswith("-")
    # numbers are right-aligned: the calls column ends at the same place in every row
    assert lines[2].index("1,234") + 5 == lines[3].index("7") + 1
    assert "(no rows)" in format_table([], ["name", "calls"])
