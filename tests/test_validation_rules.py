"""Each validation rule on its own: typed values (checks.py), YAML files, output paths (paths.py), the memory
estimate (memory.py), checkpoints with non-finite tensors, the checkpoint directory's lock, divergence."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer.checks import ConfigError, check_bool, check_choice, check_int, check_number, check_text
from tinytransformer.config import ModelConfig, TrainConfig, load_yaml
from tinytransformer.memory import REFUSE_ABOVE, Estimate, check_fits, estimate_run_bytes, host_available_bytes
from tinytransformer.paths import prove_output_dir, prove_output_file, refuse_output_over_input
from tinytransformer.training.checkpoint import CheckpointError
from tinytransformer.training.checkpoint.loading import read_checkpoint
from tinytransformer.training.checkpoint.lock import LOCK_NAME, DirectoryLock
from tinytransformer.training.divergence import Diverged, check_losses
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--vocab-size", "256", "--batch-size", "2", "--seq-len", "16", "--num-steps", "2", "--device", "cpu"]


# -- checks.py: one rule for a value, wherever it comes from ---------------------------------------------------
@pytest.mark.parametrize("value", [True, False, "12", 12.0, 1.5, None, [1], float("nan")])
def test_an_integer_is_an_int(value):
    with pytest.raises(ConfigError, match="must be an integer"):
        check_int("n", value, 1)


@pytest.mark.parametrize("value, problem", [(0, "positive"), (-1, "positive"), (2**31, "at most"),
                                            (10**30, "at most")])
def test_an_integer_within_range(value, problem):
    with pytest.raises(ConfigError, match=problem):
        check_int("n", value, 1)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "0.1", True, 10**60])
def test_a_number_is_finite_and_numeric(value):
    with pytest.raises(ConfigError):
        check_number("lr", value, positive=True)


def test_valid_values_pass_unchanged():
    assert check_int("n", 7, 1) == 7 and check_number("x", 3, positive=True) == 3.0
    assert check_bool("b", False) is False and check_choice("c", "a", ("a", "b")) == "a"
    assert check_text("p", None, optional=True) is None
    with pytest.raises(ConfigError):
        check_choice("c", "z", ("a", "b"))
    with pytest.raises(ConfigError):
        check_text("p", "a\0b")


def test_the_same_message_from_a_flag_and_from_yaml(tmp_path, capsys):
    """--num-layers 2.0 and num_layers: 2.0 are refused alike (a flag and a YAML value share the check)."""
    (tmp_path / "c.yaml").write_text("num_layers: 2.0\n")
    flags = [a for a in TINY if a not in ("--num-layers", "1")]
    assert v1_main(flags + ["--config", str(tmp_path / "c.yaml")]) == 2
    from_yaml = capsys.readouterr().err
    with pytest.raises(SystemExit):
        v1_main(flags + ["--num-layers", "2.0"])
    from_flag = capsys.readouterr().err
    assert "must be an integer" in from_yaml and "must be an integer" in from_flag


def test_dataclass_configs_built_in_code_are_checked_too():
    with pytest.raises(ConfigError, match="vocab_size must be at least 2"):
        ModelConfig(vocab_size=1).validate()
    with pytest.raises(ConfigError, match="learning_rate must be a finite"):
        TrainConfig(learning_rate=math.inf).validate()
    with pytest.raises(ConfigError, match="stop_on_nan must be true or false"):
        TrainConfig(stop_on_nan="no").validate()


# -- YAML ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, problem", [
    ("model:\n  hidden_dim: 64\n  hidden_dim: 128\n", "given twice"),
    ("seed: 1\nseed: 1\n", "given twice"),
    ("model:\n  num_layers: 2\nnum_layers: 3\n", "given twice"),
])
def test_a_repeated_yaml_key_is_an_error(tmp_path, text, problem):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_yaml(path)


def test_a_flag_still_overrides_yaml(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  num_steps: 50\n")
    out = tmp_path / "m.json"
    assert v1_main(TINY + ["--config", str(path), "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["train_config"]["num_steps"] == 2


# -- paths.py --------------------------------------------------------------------------------------------------
def test_proving_a_file_path_leaves_nothing_behind(tmp_path):
    target = tmp_path / "new" / "deeper" / "m.json"
    prove_output_file(target, "--output-json")
    assert list(tmp_path.iterdir()) == []


def test_proving_a_directory_leaves_nothing_behind_unless_kept(tmp_path):
    prove_output_dir(tmp_path / "a" / "b", "--checkpoint-dir")
    assert list(tmp_path.iterdir()) == []
    prove_output_dir(tmp_path / "a" / "b", "--checkpoint-dir", keep=True)
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


@pytest.mark.parametrize("make, prove, problem", [
    (lambda t: t / "d", prove_output_file, "is a directory"),
    (lambda t: t / "f", prove_output_dir, "is a file, not a directory"),
    (lambda t: t / "f" / "x.json", prove_output_file, "is a file, not a directory"),
    (lambda t: t / ("x" * 300), prove_output_dir, "File name too long"),
    (lambda t: Path("/proc/no_such_dir/x.json"), prove_output_file, "cannot create"),
    (lambda t: Path("/dev/null"), prove_output_file, "not a regular file"),
])
def test_wrong_paths_are_one_line(tmp_path, make, prove, problem):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("kept")
    with pytest.raises(ConfigError, match=problem) as caught:
        prove(make(tmp_path), "--flag")
    assert "\n" not in str(caught.value) and (tmp_path / "f").read_text() == "kept"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="cannot write"):
        prove_output_file(locked / "m.json", "--output-json")


# -- memory.py -------------------------------------------------------------------------------------------------
def test_the_estimate_grows_with_what_the_run_holds():
    model, train = ModelConfig(), TrainConfig()
    small = estimate_run_bytes(model, train)
    assert 16 * 3_000_000 < small.weights_and_optimizer < 16 * 3_300_000   # ~3.1M parameters, 16 bytes each
    bigger = estimate_run_bytes(model, TrainConfig(batch_size=64))
    assert bigger.activations == pytest.approx(8 * small.activations, rel=1e-9)
    assert estimate_run_bytes(model, train, score_matrix=False).activations < small.activations


def test_check_fits_refuses_above_the_margin(monkeypatch):
    import tinytransformer.memory as memory
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    cpu = torch.device("cpu")
    check_fits(Estimate(int(REFUSE_ABOVE * 1000) - 100, 0, 50, 50), cpu)   # within the margin: accepted
    with pytest.raises(ConfigError, match="needs about .* but .* is available"):
        check_fits(Estimate(2000, 0, 0, 0), cpu)


def test_host_memory_is_known_here():
    assert host_available_bytes() > 0


# Other processes on the GPU (pytest-xdist's other workers keep what their tests allocated cached) can leave too
# little memory for the large preset. Only then is running out of memory not the estimate's fault.
SHARED_GPU_BYTES = 2 * 2**30
OWN_CONTEXT_BYTES = 2**30   # this process's CUDA context, which mem_get_info counts but memory_reserved does not


def gpu_bytes_other_processes_hold() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved() - OWN_CONTEXT_BYTES


def ran_out_of_gpu_memory(stderr: str) -> bool:
    """The script's two one-line refusals: the allocator's failure, or the estimate above the free memory."""
    return "out of GPU memory" in stderr or ("of GPU memory" in stderr and "is available" in stderr)


def test_both_gpu_memory_refusals_are_recognised(monkeypatch):
    import tinytransformer.memory as memory
    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 1000)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2**40)
    with pytest.raises(ConfigError) as refusal:
        check_fits(Estimate(2000, 0, 0, 0), torch.device("cuda"))
    assert ran_out_of_gpu_memory(str(refusal.value))
    assert ran_out_of_gpu_memory("tiny_llama_v1.py: error: out of GPU memory (CUDA out of memory. Tried to allocate")
    assert not ran_out_of_gpu_memory("this run needs about 2.00 GiB of host memory (...) but 1.00 GiB is available")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "small", "medium", "large"])
def test_gpu_estimate_within_25_percent_of_the_measured_peak(preset, tmp_path):
    """In a process of its own, as a user runs it: in the test process, memory that earlier tests still hold
    would count towards the measured peak."""
    from tinytransformer.config import preset_path, split_settings
    out = tmp_path / "m.json"
    script = REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"
    held_before = gpu_bytes_other_processes_hold()
    result = subprocess.run([sys.executable, str(script), "--preset", preset, "--num-steps", "3", "--device", "cuda",
                             "--output-json", str(out)], capture_output=True, text=True, timeout=300)
    held = max(held_before, gpu_bytes_other_processes_hold())
    if result.returncode != 0 and ran_out_of_gpu_memory(result.stderr) and held > SHARED_GPU_BYTES:
        pytest.skip(f"other processes held {held / 2**30:.1f} GiB of the GPU; run this test alone to measure the "
                    f"peak ({result.stderr.strip()[:160]})")
    assert result.returncode == 0, result.stderr[-2000:]
    model_settings, train_settings = split_settings(load_yaml(preset_path(preset)))
    estimate = estimate_run_bytes(ModelConfig(**model_settings), TrainConfig(**train_settings))
    measured = json.loads(out.read_text())["memory"]["peak_allocated_mib"] * 2**20
    print(f"{preset}: estimate {estimate.device_total / 2**20:,.0f} MiB, measured peak {measured / 2**20:,.0f} MiB")
    assert abs(estimate.device_total - measured) <= 0.25 * measured, (estimate, measured)


# -- checkpoints: non-finite tensors and settings ---------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ck")
    assert v1_main(TINY + ["--save-every", "2", "--checkpoint-dir", str(directory)]) == 0
    return directory / "ckpt_step00000002.pt"


def spoiled(good, tmp_path, change):
    payload = torch.load(good, weights_only=True)
    change(payload)
    path = tmp_path / "ckpt_step00000002.pt"
    torch.save(payload, path)
    return path


def nan_in_weights(payload):
    payload["model"]["layers.0.attention.wq.weight" if "layers.0.attention.wq.weight" in payload["model"]
                     else sorted(payload["model"])[0]][0, 0] = float("nan")


def test_a_checkpoint_with_nan_weights_is_refused_naming_the_tensor(good_checkpoint, tmp_path):
    path = spoiled(good_checkpoint, tmp_path, nan_in_weights)
    with pytest.raises(CheckpointError, match=r"model tensor '.+' holds NaN values"):
        read_checkpoint(path)


def test_a_checkpoint_with_inf_optimizer_state_is_refused(good_checkpoint, tmp_path):
    def inf_moment(payload):
        first = next(iter(payload["optimizer"]["per_parameter"].values()))
        next(iter(first.values())).fill_(float("inf"))
    with pytest.raises(CheckpointError, match="holds infinite values"):
        read_checkpoint(spoiled(good_checkpoint, tmp_path, inf_moment))


def test_a_checkpoint_with_an_untyped_setting_is_refused(good_checkpoint, tmp_path):
    path = spoiled(good_checkpoint, tmp_path, lambda p: p["train_config"].update(learning_rate="fast"))
    with pytest.raises(CheckpointError, match="train_config is unusable .*learning_rate"):
        read_checkpoint(path)


def test_training_and_sample_refuse_a_nan_checkpoint(good_checkpoint, tmp_path, capsys):
    path = spoiled(good_checkpoint, tmp_path, nan_in_weights)
    assert v1_main(TINY + ["--num-steps", "4", "--resume", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds NaN values" in err[0]
    result = subprocess.run([sys.executable, str(REPO_ROOT / "sample.py"), "--checkpoint", str(path),
                             "--device", "cpu", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "holds NaN values" in result.stderr


# -- the checkpoint directory's lock ---------------------------------------------------------------------------
def write_lock(directory, host, pid):
    directory.mkdir(exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "since": "earlier"}))


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_live_run_holds_its_directory(tmp_path, capsys):
    import socket
    write_lock(tmp_path / "ck", socket.gethostname(), os.getppid())   # our parent: alive
    assert v1_main(TINY + ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in use by another run" in err[0]
    assert not list((tmp_path / "ck").glob("ckpt_step*.pt"))


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    import socket
    write_lock(tmp_path / "ck", socket.gethostname(), dead_pid())
    assert v1_main(TINY + ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1"]) == 0
    assert "taking over the stale lock" in capsys.readouterr().out
    assert not (tmp_path / "ck" / LOCK_NAME).exists() and list((tmp_path / "ck").glob("ckpt_step*.pt"))


def test_another_hosts_lock_is_never_taken_silently(tmp_path):
    write_lock(tmp_path, "some-other-host", 1)
    with pytest.raises(CheckpointError, match="locked by a run on host some-other-host"):
        DirectoryLock(tmp_path, print).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "some-other-host"


def test_a_lock_is_released_and_an_unused_directory_removed(tmp_path):
    lock = DirectoryLock(tmp_path / "new", print)
    lock.acquire()
    assert (tmp_path / "new" / LOCK_NAME).exists()
    lock.release()
    assert not (tmp_path / "new").exists()


# -- divergence ------------------------------------------------------------------------------------------------
def test_check_losses_names_the_first_bad_step_and_the_range():
    train = TrainConfig(learning_rate=0.5)
    check_losses([1.0, 0.9], 0, train)
    with pytest.raises(Diverged, match=r"nan at step 12 \(first of steps 11-20") as caught:
        check_losses([1.0, float("nan")] + [float("inf")] * 8, 10, train)
    assert "--learning-rate 0.5" in str(caught.value)
    check_losses([float("nan")], 0, TrainConfig(stop_on_nan=False))   # --no-stop-on-nan


def test_divergence_in_a_real_process(tmp_path):
    script = REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py"
    result = subprocess.run([sys.executable, str(script), *TINY, "--learning-rate", "1e30", "--num-steps", "3",
                             "--warmup-steps", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "training diverged" in result.stderr and "Traceback" not in result.stderr


def test_an_output_naming_an_input_file_is_refused(tmp_path):
    source = tmp_path / "config.yaml"
    source.write_text("num_steps: 2\n")
    # The same file however it is spelled: directly, through `..`, through a link.
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.yaml").symlink_to(source)
    for spelling in (source, tmp_path / "sub" / ".." / "config.yaml", tmp_path / "link.yaml"):
        with pytest.raises(ConfigError, match="is the file --config reads"):
            refuse_output_over_input([("--output-json", str(spelling))], [("--config", str(source))])
    # Another file, an absent input, or no output at all: nothing to refuse.
    refuse_output_over_input([("--output-json", str(tmp_path / "out.json"))], [("--config", str(source))])
    refuse_output_over_input([("--output-json", str(tmp_path / "out.json"))], [("--resume", None)])
    refuse_output_over_input([("--output-json", None)], [("--config", str(source))])
    assert source.read_text() == "num_steps: 2\n"
