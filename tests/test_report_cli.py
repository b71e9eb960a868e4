"""python -m tinytransformer.profiling.report_cli: the tables of a recorded trace; bad input is one line and exit 2."""
import json

import pytest

from tinytransformer.profiling import report_cli
from tinytransformer.profiling.tables import OPERATOR_COLUMNS

from .trace_samples import BAD_FILES, CPU_TRACE, build_gpu_trace


def test_cli_prints_tables_for_a_gpu_trace(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(build_gpu_trace("cuda")))
    assert report_cli.main([str(path), "--sort-by", "self_cuda_time_total", "--limit", "4",
                         "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "Kernels per step: 7.0" in out and "Top kernels" in out and "ampere_sgemm_128x64_tn" in out
    assert (tmp_path / "out" / "summary.md").is_file()


def test_cli_on_cpu_fixture(tmp_path, capsys):
    assert report_cli.main([str(CPU_TRACE), "--limit", "5", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Kernels per step: n/a" in out and "sorted by self_cpu_time" in out
    assert "Top kernels" not in out
    header = (tmp_path / "operators.csv").read_text().splitlines()[0]
    assert header == ",".join(OPERATOR_COLUMNS)
    assert header.startswith("name,calls,self_cpu_us,cpu_us,self_device_us,device_us,self_cpu_mem_bytes")


@pytest.mark.parametrize("name", ["missing.json", "random.bin", "object.json", "truncated.json"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, name):
    path = tmp_path / name
    if BAD_FILES[name] is not None:
        path.write_bytes(BAD_FILES[name])
    with pytest.raises(SystemExit) as exited:
        report_cli.main([str(path)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in captured.err


def test_cli_rejects_bad_options(tmp_path):
    for argv in ([str(CPU_TRACE), "--sort-by", "flops"], [str(CPU_TRACE), "--limit", "-1"], []):
        with pytest.raises(SystemExit) as exited:
            report_cli.main(argv)
        assert exited.value.code == 2
