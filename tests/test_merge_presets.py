"""benchmarks/merge_presets.py: per-preset compare_versions.py files joined into one, and what it refuses."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = {"python": "3.12.3", "torch": "2.11.0+cu130", "triton": "3.6.0", "gpu": "NVIDIA H100 80GB HBM3",
               "backend": "CUDA 13.0", "platform": "Linux"}


def run_of(preset, variant, repeat, samples_per_s):
    return {"variant": variant, "preset": preset, "batch_size": 8, "seq_len": 128, "samples_per_s": samples_per_s,
            "median_step_ms": 8000 / samples_per_s, "mfu": 0.3, "peak_memory_mib": 1000.0, "kernels_per_step": None,
            "repeat": repeat}


def part(preset, speeds, **changes):
    """A compare_versions.py file of one preset measured in len(speeds[variant]) rounds."""
    runs = [run_of(preset, variant, repeat, speed) for variant, per_round in speeds.items()
            for repeat, speed in enumerate(per_round)]
    rows = []
    for variant, per_round in speeds.items():
        median = sorted(per_round)[len(per_round) // 2]
        row = {k: v for k, v in run_of(preset, variant, 0, median).items() if k != "repeat"}
        row["repeats_samples_per_s"] = per_round
        rows.append(row)
    result = {"command": f"python benchmarks/compare_versions.py --preset {preset} --repeats 3 --output {preset}.json",
              "environment": dict(ENVIRONMENT), "preset": preset, "dtype": "bfloat16", "num_steps": 20,
              "warmup_steps": 8, "repeats": 3, "rows": rows, "runs": runs, "loss_agreement_problems": []}
    result.update(changes)
    return result


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def merge(*args):
    return subprocess.run([sys.executable, "benchmarks/merge_presets.py", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_parts_are_joined_with_every_run_and_command(tmp_path):
    tiny = part("tiny", {"v1": [10, 12, 11], "v4": [100, 90, 95]})
    large = part("large", {"v1": [1, 2, 3], "v4": [7, 9, 8]},
                 resumed_by=["python benchmarks/compare_versions.py --preset large --repeats 3 --resume"])
    out = tmp_path / "joined.json"
    result = merge(write(tmp_path, "tiny.json", tiny), write(tmp_path, "large.json", large), "--output", str(out))
    assert result.returncode == 0, result.stderr
    joined = json.loads(out.read_text())
    assert joined["preset"] == "tiny,large"
    assert [(r["preset"], r["variant"], r["samples_per_s"]) for r in joined["rows"]] == [
        ("tiny", "v1", 11), ("tiny", "v4", 95), ("large", "v1", 2), ("large", "v4", 8)]
    assert len(joined["runs"]) == 12
    assert [p["presets"] for p in joined["parts"]] == [["tiny"], ["large"]]
    assert joined["parts"][1]["resumed_by"] == large["resumed_by"]
    assert joined["command"].startswith("python benchmarks/merge_presets.py ")
    assert (joined["dtype"], joined["repeats"], joined["num_steps"]) == ("bfloat16", 3, 20)
    assert "note" not in joined


def test_the_readme_renderer_shows_each_parts_commands_and_notes(tmp_path):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import make_readme_table
    small = part("small", {"v1": [5, 6, 7]}, note="partial: 3 of 6 runs")
    medium = part("medium", {"v1": [3, 4, 5]}, resumed_by=["python benchmarks/compare_versions.py --resume"])
    out = tmp_path / "h100_presets_bfloat16.json"
    result = merge(write(tmp_path, "s.json", small), write(tmp_path, "m.json", medium), "--output", str(out))
    assert result.returncode == 0, result.stderr
    text = make_readme_table.render_presets(json.loads(out.read_text()), out.name)
    assert f"small: `{small['command']}`" in text
    assert f"medium: `{medium['command']}`" in text
    assert "then: `python benchmarks/compare_versions.py --resume`" in text
    assert "s.json: partial: 3 of 6 runs" in text


def test_a_note_every_part_carries_is_written_once(tmp_path):
    shared = "measured at the same time, one preset per GPU"
    parts = [write(tmp_path, f"{name}.json", part(name, {"v1": [1, 2, 3]}, note=shared))
             for name in ("tiny", "small")]
    other = write(tmp_path, "medium.json", part("medium", {"v1": [1, 2, 3]}, note="partial"))
    out = tmp_path / "out.json"
    assert merge(*parts, "--output", str(out)).returncode == 0
    assert json.loads(out.read_text())["note"] == f"every part: {shared}"
    assert merge(*parts, other, "--output", str(out)).returncode == 0
    assert json.loads(out.read_text())["note"] == f"tiny.json, small.json: {shared}; medium.json: partial"


@pytest.mark.parametrize("change, expected", [
    ({"repeats": 1}, "repeats is 1"),
    ({"dtype": "float32"}, "dtype is float32"),
    ({"num_steps": 60}, "num_steps is 60"),
    ({"command": "python benchmarks/compare_versions.py --preset small --no-profile"},
     "without the profiled window, "),
    ({"environment": {**ENVIRONMENT, "gpu": "NVIDIA H200"}}, "measured with gpu NVIDIA H200"),
    ({"environment": {**ENVIRONMENT, "torch": "2.12.0"}}, "measured with torch 2.12.0"),
])
def test_parts_measured_differently_are_refused(tmp_path, change, expected):
    first = write(tmp_path, "a.json", part("tiny", {"v1": [1, 2, 3]}))
    second = write(tmp_path, "b.json", part("small", {"v1": [1, 2, 3]}, **change))
    out = tmp_path / "out.json"
    result = merge(first, second, "--output", str(out))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert not out.exists()


def test_bad_inputs_get_one_line(tmp_path):
    good = write(tmp_path, "good.json", part("tiny", {"v1": [1, 2, 3]}))
    again = write(tmp_path, "again.json", part("tiny", {"v4": [1, 2, 3]}))
    not_json = tmp_path / "broken.json"
    not_json.write_text("{")
    cases = [
        ([good, again, "--output", str(tmp_path / "o.json")], "preset tiny is in"),
        ([good, str(tmp_path / "missing.json"), "--output", str(tmp_path / "o.json")], "cannot read it"),
        ([good, str(not_json), "--output", str(tmp_path / "o.json")], "not JSON"),
        ([good, write(tmp_path, "list.json", [1]), "--output", str(tmp_path / "o.json")], "a JSON object"),
        ([good, write(tmp_path, "other.json", {"rows": []}), "--output", str(tmp_path / "o.json")], "missing"),
        ([good, write(tmp_path, "seed.json", part(None, {"v1": [1, 2, 3]})), "--output", str(tmp_path / "o.json")],
         "rows without a preset"),
        ([good, "--output", str(tmp_path)], "--output"),   # a directory, not a file
        ([good], "--output"),
    ]
    for args, expected in cases:
        result = merge(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
