"""Hostile inputs, found before the work and not after it: one line on stderr, the right exit code, no traceback,
nothing written earlier lost. A table of inputs over the four versions, then sample.py, the benchmark scripts, the
Hugging Face export and the profiler scripts. The rules themselves (checks.py, paths.py, memory.py, the lock,
divergence) are tested one by one in test_validation_rules.py."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSION_MODULES = {"v1": "version1_pytorch_baseline.tiny_llama_v1", "v2": "version2_pytorch_fused.tiny_llama_v2",
                   "v3": "version3_triton.tiny_llama_v3", "v4": "version4_triton_ultra.tiny_llama_v4"}
# A model every version's kernels accept (head dim 32), small enough for the CPU.
TINY = ["--hidden-dim", "64", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "128",
        "--vocab-size", "256", "--batch-size", "2", "--seq-len", "16", "--num-steps", "2", "--device", "cpu"]


def yaml_file(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("kept\n")
    return str(path)


def a_dir(tmp_path):
    path = tmp_path / "a_dir"
    path.mkdir(exist_ok=True)
    return str(path)


# name -> flags (given tmp_path); every one must be refused with exit 2 before the first step.
HOSTILE = {
    # the table
    "checkpoint dir is a file": lambda t: ["--checkpoint-dir", a_file(t), "--save-every", "1"],
    "output json is a directory": lambda t: ["--output-json", a_dir(t)],
    "tensorboard dir in /proc": lambda t: ["--tensorboard-dir", "/proc/no_such_dir/x"],
    "profile dir in /proc": lambda t: ["--profile-dir", "/proc/no_such_dir/x", "--enable-pytorch-profiler"],
    "batch of a billion": lambda t: ["--batch-size", "1000000000"],
    "ten-million-wide model": lambda t: ["--hidden-dim", "10000000", "--num-heads", "2"],
    "infinite learning rate": lambda t: ["--learning-rate", "inf"],
    "NaN learning rate": lambda t: ["--learning-rate", "nan"],
    "YAML hidden_dim is a word": lambda t: ["--config", yaml_file(t, 'model:\n  hidden_dim: "big"\n')],
    "vocabulary of one": lambda t: ["--vocab-size", "1"],
    # beyond it
    "YAML integer in quotes": lambda t: ["--config", yaml_file(t, 'num_layers: "2"\n')],
    "YAML whole float": lambda t: ["--config", yaml_file(t, "num_layers: 2.0\n")],
    "YAML boolean count": lambda t: ["--config", yaml_file(t, "log_every: true\n")],
    "YAML 1e-3 is text": lambda t: ["--config", yaml_file(t, "learning_rate: 1e-3\n")],
    "YAML infinite learning rate": lambda t: ["--config", yaml_file(t, "learning_rate: .inf\n")],
    "YAML repeated key": lambda t: ["--config", yaml_file(t, "model:\n  num_layers: 1\n  num_layers: 2\n")],
    "YAML key in two sections": lambda t: ["--config", yaml_file(t, "train:\n  seed: 1\nseed: 2\n")],
    "YAML switch as text": lambda t: ["--config", yaml_file(t, 'use_amp: "yes"\n')],
    "YAML negative seed": lambda t: ["--config", yaml_file(t, "seed: -5\n")],
    "YAML huge integer": lambda t: ["--config", yaml_file(t, "eval_every: 100000000000000000000\n")],
    "YAML path as a number": lambda t: ["--config", yaml_file(t, "output_json: 5\n")],
    "YAML rope theta NaN": lambda t: ["--config", yaml_file(t, "rope_theta: .nan\n")],
    "YAML unknown choice": lambda t: ["--config", yaml_file(t, "lr_schedule: linear\n")],
    "flag integer overflow": lambda t: ["--num-steps", "99999999999999999999"],
    "flag whole float": lambda t: ["--batch-size", "2.0"],
    "negative seed": lambda t: ["--seed", "-1"],
    "output json under a file": lambda t: ["--output-json", os.path.join(a_file(t), "m.json")],
    "output json name too long": lambda t: ["--output-json", str(t / ("n" * 300 + ".json"))],
    "output json is a device": lambda t: ["--output-json", "/dev/null"],
    "checkpoint dir under a file": lambda t: ["--checkpoint-dir", os.path.join(a_file(t), "ck"), "--save-every", "1"],
    "tensorboard dir is a file": lambda t: ["--tensorboard-dir", a_file(t)],
    "profile dir is a file": lambda t: ["--profile-dir", a_file(t), "--enable-pytorch-profiler"],
    "hundred-million tokens a step": lambda t: ["--batch-size", "1000", "--seq-len", "100000",
                                                "--max-seq-len", "100000"],
}
DIVERGE = ["--learning-rate", "1e30", "--num-steps", "4", "--warmup-steps", "0", "--log-every", "2"]


def tiny_without_overrides(hostile):
    """TINY minus any flag that would override a key of the hostile --config file (flags win over YAML)."""
    if "--config" not in hostile:
        return TINY
    text = Path(hostile[hostile.index("--config") + 1]).read_text()
    flags = {"--" + line.strip().split(":")[0].replace("_", "-") for line in text.splitlines()}
    argv, skip = [], False
    for arg in TINY:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            argv.append(arg)
    return argv


def run_version(version, argv, capsys):
    main = importlib.import_module(VERSION_MODULES[version]).main
    try:
        code = main(argv)
    except SystemExit as stop:   # argparse's errors leave through SystemExit
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def assert_kept(tmp_path):
    """The file the hostile input pointed at is as it was."""
    path = tmp_path / "a_file"
    assert not path.exists() or path.read_text() == "kept\n"


def assert_one_line(code, err_lines, expected_code=2):
    assert code == expected_code, f"exit {code}, stderr {err_lines}"
    assert len(err_lines) == 1, err_lines
    assert "error" in err_lines[0] and "Traceback" not in err_lines[0]


@pytest.mark.parametrize("version", sorted(VERSION_MODULES))
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_refused_before_training(version, case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostile = HOSTILE[case](tmp_path)
    code, out, err = run_version(version, tiny_without_overrides(hostile) + hostile, capsys)
    assert_one_line(code, err)
    assert "step " not in out, f"{case}: training started before the refusal"
    assert_kept(tmp_path)


@pytest.mark.parametrize("version", ["v1", "v2", pytest.param("v3", marks=pytest.mark.gpu),
                                     pytest.param("v4", marks=pytest.mark.gpu)])
def test_diverged_run_stops_and_keeps_its_last_good_checkpoint(version, tmp_path, capsys):
    device = [] if version in ("v1", "v2") else ["--device", "cuda"]
    checkpoints, metrics = tmp_path / "ck", tmp_path / "metrics.json"
    argv = TINY + DIVERGE + device + ["--save-every", "1", "--checkpoint-dir", str(checkpoints),
                                      "--output-json", str(metrics)]
    code, out, err = run_version(version, argv, capsys)
    assert_one_line(code, err, expected_code=1)
    assert "diverged" in err[0] and "at step 2" in err[0] and "--learning-rate" in err[0]
    assert not metrics.exists(), "a diverged run must not write a summary of NaNs"
    assert "Summary" not in out
    assert sorted(p.name for p in checkpoints.glob("ckpt_step*.pt")) == ["ckpt_step00000001.pt"]
    assert not (checkpoints / ".run.lock").exists()


def test_no_stop_on_nan_trains_on(tmp_path, capsys):
    code, out, err = run_version("v1", TINY + DIVERGE + ["--no-stop-on-nan"], capsys)
    assert code == 0 and "final nan" in out and not err


def test_refused_run_keeps_earlier_files(tmp_path, capsys):
    """A refusal after an earlier run: its checkpoints and metrics are untouched."""
    checkpoints, metrics = tmp_path / "ck", tmp_path / "m.json"
    flags = TINY + ["--checkpoint-dir", str(checkpoints), "--save-every", "1", "--output-json", str(metrics)]
    code, _, _ = run_version("v1", flags, capsys)
    assert code == 0
    before = {p.name: p.read_bytes() for p in [*checkpoints.iterdir(), metrics]}
    code, _, err = run_version("v1", flags + ["--learning-rate", "inf"], capsys)
    assert_one_line(code, err)
    code, _, err = run_version("v1", flags + ["--batch-size", "1000000000"], capsys)
    assert_one_line(code, err)
    assert {p.name: p.read_bytes() for p in [*checkpoints.iterdir(), metrics]} == before


# -- the commands beside training ---------------------------------------------------------------------------
def script_main(relative):
    """main() of a script that is not a package module (benchmarks/, sample.py): imported from its file."""
    path = REPO_ROOT / relative
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"hostile_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module.main


SCRIPTS = {
    "compare_versions: no variant": ("benchmarks/compare_versions.py", lambda t: ["--variants", ",", "--device", "cpu"]),
    "compare_versions: output is a directory": ("benchmarks/compare_versions.py",
                                                lambda t: ["--output", a_dir(t), "--device", "cpu"]),
    "compare_versions: plot under a file": ("benchmarks/compare_versions.py",
                                            lambda t: ["--plot", a_file(t) + "/p.png", "--device", "cpu"]),
    "compare_versions: negative batch": ("benchmarks/compare_versions.py", lambda t: ["--batch-size", "-2"]),
    "compare_versions: zero repeats": ("benchmarks/compare_versions.py", lambda t: ["--repeats", "0"]),
    "scaling: output dir is a file": ("benchmarks/scaling.py", lambda t: ["--output-dir", a_file(t), "--device", "cpu"]),
    "scaling: unknown preset": ("benchmarks/scaling.py", lambda t: ["--presets", "huge", "--device", "cpu"]),
    "scaling: zero processes": ("benchmarks/scaling.py", lambda t: ["--gpus", "0", "--device", "cpu"]),
    "fusion_ablation: output json is a directory": ("version2_pytorch_fused/fusion_ablation.py",
                                                    lambda t: ["--output-json", a_dir(t)]),
    "fusion_ablation: fractional steps": ("version2_pytorch_fused/fusion_ablation.py",
                                          lambda t: ["--num-steps", "2.5"]),
    "sample: infinite temperature": ("sample.py", lambda t: ["--checkpoint", a_file(t), "--temperature", "inf"]),
    "sample: negative seed": ("sample.py", lambda t: ["--checkpoint", a_file(t), "--seed", "-4"]),
    "hf export: out is a file": ("tinytransformer/hf/__main__.py",
                                 lambda t: ["export", "--checkpoint", a_file(t), "--out", a_file(t)]),
    "hf export: out under a file": ("tinytransformer/hf/__main__.py",
                                    lambda t: ["export", "--checkpoint", a_file(t), "--out", a_file(t) + "/m"]),
    "trace report: output dir is a file": ("tinytransformer/profiling/report_cli.py",
                                           lambda t: [a_file(t), "--output-dir", a_file(t)]),
    "bottlenecks: report is a directory": ("version1_pytorch_baseline/analyze_bottlenecks.py",
                                           lambda t: ["--profile-data", a_file(t), "--output-report", a_dir(t)]),
    "ultra profiling: output dir is a file": ("version4_triton_ultra/run_ultra_profiling.py",
                                              lambda t: ["--versions", "v1", "--output-dir", a_file(t)]),
    "ultra profiling: nothing to analyse": ("version4_triton_ultra/run_ultra_profiling.py",
                                           lambda t: ["--analyze-only", a_file(t) + "/none"]),
}


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_script_refuses_hostile_input(case, tmp_path, capsys, monkeypatch):
    relative, flags = SCRIPTS[case]
    if relative.startswith("tinytransformer/"):
        module = importlib.import_module(relative[:-3].replace("/", "."))
        main = module.main
    else:
        main = script_main(relative)
    monkeypatch.chdir(tmp_path)
    try:
        code = main(flags(tmp_path))
    except SystemExit as stop:
        code = stop.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert_one_line(code, err)
    assert_kept(tmp_path)


# -- real processes: the contract as a user meets it -----------------------------------------------------------
def run_process(args, cwd):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_checkpoint_dir_that_is_a_file_in_a_real_process(tmp_path):
    result = run_process([sys.executable, str(REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"), *TINY,
                          "--checkpoint-dir", a_file(tmp_path), "--save-every", "1"], tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "is a file, not a directory" in result.stderr and "step" not in result.stdout


@pytest.mark.parametrize("output_dir", [a_file, lambda t: "/proc/no_such_dir/runs"])
def test_run_all_profilers_refuses_an_unusable_output_dir(output_dir, tmp_path):
    script = REPO_ROOT / "version1_pytorch_baseline" / "run_all_profilers.sh"
    result = run_process(["bash", str(script), "--output-dir", output_dir(tmp_path), "--", "--num-steps", "2"],
                         tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--output-dir" in result.stderr and "profile_runs" not in os.listdir(tmp_path)
    assert_kept(tmp_path)


def test_run_all_profilers_with_every_step_skipped_has_nothing_to_do(tmp_path):
    script = REPO_ROOT / "version1_pytorch_baseline" / "run_all_profilers.sh"
    every_step = "timed-run,pytorch-profiler,deepspeed-flops,rocprofv3,rocprof-sys,rocprof-compute,nsys,ncu"
    result = run_process(["bash", str(script), "--skip", every_step], tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "nothing to run" in result.stderr
    assert not (tmp_path / "profile_runs").exists()
