"""Data parallel on the CPU (gloo): torchrun runs equal single-process runs step by step, a two-"node" c10d
rendezvous on one machine, DeepSpeed's engine, a stop signal that all ranks obey together, rank-0-only output,
the scaling benchmark, and bad inputs (one line, exit 2).

Why the runs must agree: the global batch of step t is a function of (seed, t); rank r of N takes the r-th
contiguous slice, and the gradients are averaged over the ranks. So N ranks with --batch-size B compute the
same updates as one process with --batch-size N*B, up to float32 summation order.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tinytransformer import deepspeed_engine, distributed
from tinytransformer.config import ConfigError, TrainConfig
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "v1": REPO_ROOT / "version1_pytorch_baseline" / "tiny_llama_v1.py",
    "v2": REPO_ROOT / "version2_pytorch_fused" / "tiny_llama_v2.py",
    "v3": REPO_ROOT / "version3_triton" / "tiny_llama_v3.py",
    "v4": REPO_ROOT / "version4_triton_ultra" / "tiny_llama_v4.py",
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SIZES = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
         "--vocab-size", "300", "--seq-len", "16", "--device", "cpu"]
RUN = SIZES + ["--num-steps", "6", "--eval-every", "3", "--eval-batches", "2", "--log-every", "2"]
GLOBAL_BATCH, RANKS = 8, 2
LOSS_RTOL = 1e-5   # float32: only the order of the sums differs (gradient all-reduce, loss averages)


def clean_env(on_gpu: bool = False, **extra) -> dict:
    """The environment of a child run: one thread per process (as torchrun sets it), no launcher variables
    inherited from whoever started pytest; Triton's interpreter for versions 3 and 4 on the CPU, never on a GPU
    (there the kernels are compiled; the interpreter cannot run them on GPU tensors)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1", **extra)
    if not on_gpu:
        env["TRITON_INTERPRET"] = "1"
    return env


def run(command, cwd, timeout=240, on_gpu=False) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, env=clean_env(on_gpu), capture_output=True,
                          text=True, timeout=timeout)


def single_process(version: str, tmp_path: Path, *extra) -> dict:
    """The reference: one process with the whole global batch."""
    out = tmp_path / f"single_{version}.json"
    result = run([sys.executable, SCRIPTS[version], *RUN, "--batch-size", GLOBAL_BATCH, "--output-json", out,
                  *extra], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(out.read_text())


def two_ranks(version: str, tmp_path: Path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"ranks_{version}.json"
    result = run(TORCHRUN + ["--standalone", "--nproc-per-node", RANKS, SCRIPTS[version], *RUN,
                             "--batch-size", GLOBAL_BATCH // RANKS, "--output-json", out, *extra], cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result, json.loads(out.read_text())


def assert_same_training(parallel: dict, reference: dict) -> None:
    """Every step's training loss and every validation loss agree to float32 tolerance; the ranks ended with the
    same weights, bit for bit (the reference, one process, has no ranks to compare)."""
    assert parallel["distributed"]["weights_identical_across_ranks"] is True
    assert reference["distributed"]["weights_identical_across_ranks"] is None
    ours, theirs = np.array(parallel["loss"]["history"]), np.array(reference["loss"]["history"])
    assert ours.shape == theirs.shape and np.isfinite(ours).all()
    relative = np.abs(ours - theirs) / np.abs(theirs)
    assert relative.max() < LOSS_RTOL, f"per-step relative loss differences {relative}"
    evals = [(e["step"], e["loss"]) for e in parallel["eval"]["history"]]
    expected = [(e["step"], e["loss"]) for e in reference["eval"]["history"]]
    assert [s for s, _ in evals] == [s for s, _ in expected] == [3, 6]
    for (_, a), (_, b) in zip(evals, expected):
        assert abs(a - b) < LOSS_RTOL * abs(b)


@pytest.fixture(scope="module")
def v1_reference(tmp_path_factory):
    return single_process("v1", tmp_path_factory.mktemp("v1_reference"))


# ----------------------------------------------------------------------------------------------------------
# torchrun: 2 ranks x batch 4 == 1 process x batch 8
# ----------------------------------------------------------------------------------------------------------
def test_v1_two_ranks_equal_one_process(v1_reference, tmp_path):
    result, metrics = two_ranks("v1", tmp_path)
    assert_same_training(metrics, v1_reference)
    # Only rank 0 prints: one header, one summary, one line per logged step.
    out = result.stdout
    assert out.count("=== Summary") == 1 and out.count("=== TinyLlama v1") == 1
    assert out.count("step      6/6") == 1
    assert "DistributedDataParallel over 2 rank(s) (gloo), global batch 8 = 2 x 4 per rank" in out
    # Throughput is global: the global batch over rank 0's median step time.
    dist_info, timing = metrics["distributed"], metrics["timing"]
    assert dist_info == {"engine": "ddp", "world_size": 2, "backend": "gloo", "batch_size_per_rank": 4,
                         "global_batch_size": 8, "gradients_averaged_by": "ddp", "zero_stage": None,
                         "grad_reduce_dtype": "float32", "weights_identical_across_ranks": True}
    assert "ranks       : the weights are the same bits on all 2 ranks" in out
    assert metrics["throughput"]["samples_per_s"] == pytest.approx(8 / (timing["median_ms"] / 1e3))


def test_v2_two_ranks_equal_one_process(tmp_path):
    reference = single_process("v2", tmp_path)
    _, metrics = two_ranks("v2", tmp_path)
    assert_same_training(metrics, reference)


@pytest.mark.slow   # Triton's interpreter, or compilation: ~40-60 s each on a 2-core CPU
@pytest.mark.parametrize("version, flags", [("v3", []), ("v4", []), ("v2", ["--enable-torch-compile"])],
                         ids=["v3", "v4", "v2-compiled"])
def test_slow_variants_two_ranks_equal_one_process(version, flags, tmp_path):
    """Triton kernels (custom autograd functions) under DDP's gradient hooks; torch.compile'd model inside DDP."""
    reference = single_process(version, tmp_path, *flags)
    _, metrics = two_ranks(version, tmp_path, *flags)
    assert_same_training(metrics, reference)


# ----------------------------------------------------------------------------------------------------------
# Multi-node: two torchrun "nodes" on this machine, joined by a c10d rendezvous
# ----------------------------------------------------------------------------------------------------------
def test_two_node_rendezvous_equals_one_process(v1_reference, tmp_path):
    """What scripts/slurm_multinode.sbatch does on a cluster: one torchrun per node, all meeting at a c10d
    rendezvous endpoint. The c10d rendezvous hands out ranks in the order the nodes join (--node-rank only
    applies to the static rendezvous), so we do not know which node holds rank 0: each node runs in its own
    directory with RELATIVE output paths, and exactly one directory may receive the JSON and checkpoints."""
    port = distributed.free_port()
    nodes = []
    for node in range(2):
        directory = tmp_path / f"node{node}"
        directory.mkdir()
        command = TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tinytest",
                              SCRIPTS["v1"], *RUN, "--batch-size", GLOBAL_BATCH // 2,
                              "--output-json", "metrics.json", "--save-every", "3", "--checkpoint-dir", "ckpt"]
        nodes.append((directory, subprocess.Popen([str(c) for c in command], cwd=directory, env=clean_env(),
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    outputs = []
    for directory, process in nodes:
        stdout, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, (stdout + stderr)[-3000:]
        outputs.append(stdout)
    assert sum(out.count("=== Summary") for out in outputs) == 1
    writers = [d for d, _ in nodes if (d / "metrics.json").exists()]
    assert len(writers) == 1
    assert sorted(p.name for p in (writers[0] / "ckpt").iterdir()) == ["ckpt_step00000003.pt",
                                                                       "ckpt_step00000006.pt"]
    assert not any((d / "ckpt").exists() for d, _ in nodes if d != writers[0])
    metrics = json.loads((writers[0] / "metrics.json").read_text())
    assert metrics["distributed"]["world_size"] == 2
    assert_same_training(metrics, v1_reference)


# ----------------------------------------------------------------------------------------------------------
# DeepSpeed's engine (runs on the CPU with gloo)
# ----------------------------------------------------------------------------------------------------------
def test_deepspeed_zero2_equals_one_process(v1_reference, tmp_path):
    pytest.importorskip("deepspeed")
    result, metrics = two_ranks("v1", tmp_path, "--deepspeed", "--zero-stage", "2")
    assert_same_training(metrics, v1_reference)
    assert metrics["distributed"]["engine"] == "deepspeed" and metrics["distributed"]["zero_stage"] == 2
    assert result.stdout.count("=== Summary") == 1 and "DeepSpeed engine over 2 rank(s)" in result.stdout


# ----------------------------------------------------------------------------------------------------------
# A stop signal: every rank stops after the same step; rank 0 writes the checkpoint; the job resumes
# ----------------------------------------------------------------------------------------------------------
def test_sigterm_stops_every_rank_at_the_same_step_and_the_job_resumes(tmp_path):
    log = tmp_path / "run.log"
    # Validation after every step makes each step slow enough for the test to signal the run mid-way.
    command = TORCHRUN + ["--standalone", "--nproc-per-node", "2", SCRIPTS["v1"], *SIZES, "--batch-size", "4",
                          "--num-steps", "3000", "--log-every", "1", "--eval-every", "1", "--eval-batches", "20",
                          "--checkpoint-dir", "ckpt"]
    with open(log, "w") as sink:
        process = subprocess.Popen([str(c) for c in command], cwd=tmp_path, env=clean_env(), stdout=sink,
                                   stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while "step      3/3000" not in log.read_text():
            assert process.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)   # to torchrun, which passes SIGTERM on to both workers
        process.wait(timeout=120)
    text = log.read_text()
    stopped = re.findall(r"SIGTERM received: stopping after step (\d+)", text)
    assert len(stopped) == 1, text[-3000:]   # rank 0 alone prints it
    step = int(stopped[0])
    assert step % 10 == 0   # the ranks agree on a stop every STOP_AGREEMENT_EVERY = 10 steps
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [f"ckpt_step{step:08d}.pt"]
    assert "resume with: torchrun --nproc-per-node 2 " in text
    # Resume the job with the same two ranks, for two more steps.
    resumed = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", SCRIPTS["v1"], *SIZES, "--batch-size", "4",
                              "--num-steps", step + 2, "--log-every", "1", "--checkpoint-dir", "ckpt",
                              "--resume", "auto", "--output-json", "resumed.json"], cwd=tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"at step {step}/{step + 2}" in resumed.stdout
    metrics = json.loads((tmp_path / "resumed.json").read_text())
    assert metrics["steps_completed"] == step + 2 and len(metrics["loss"]["history"]) == step + 2


# ----------------------------------------------------------------------------------------------------------
# The scaling benchmark, as a CPU smoke test
# ----------------------------------------------------------------------------------------------------------
def test_scaling_benchmark_cpu_smoke(tmp_path):
    result = run([sys.executable, REPO_ROOT / "benchmarks" / "scaling.py", "--device", "cpu", "--versions", "v1",
                  "--presets", "tiny", "--max-gpus", "2", "--num-steps", "4", "--warmup-steps", "1",
                  "--output-dir", tmp_path / "out", "--", *SIZES, "--batch-size", "2"], cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]
    assert [(r["gpus"], r["global_batch_size"]) for r in rows] == [(1, 2), (2, 4)]
    assert rows[0]["efficiency"] == pytest.approx(1.0) and rows[1]["efficiency"] > 0
    assert "| v1 | tiny | 2 | 4 |" in (tmp_path / "out" / "scaling.md").read_text()


def test_scaling_benchmark_with_a_single_process_reference(tmp_path):
    """--with-single-process: a plain process (no torchrun) beside the 1-process torchrun point, as the reference
    of the speed-up and efficiency columns."""
    result = run([sys.executable, REPO_ROOT / "benchmarks" / "scaling.py", "--device", "cpu", "--versions", "v1",
                  "--presets", "tiny", "--gpus", "1", "--with-single-process", "--num-steps", "4",
                  "--warmup-steps", "1", "--output-dir", tmp_path / "out", "--", *SIZES, "--batch-size", "2"],
                 cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]
    assert [(r["launcher"], r["gpus"]) for r in rows] == [("none", 1), ("torchrun", 1)]
    assert rows[0]["command"].startswith("python ") and "torch.distributed.run" not in rows[0]["command"]
    assert rows[1]["command"].startswith("torchrun --standalone --nproc-per-node 1 ")
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"])
    assert "| v1 | tiny | 1 (no torchrun) | 2 |" in (tmp_path / "out" / "scaling.md").read_text()


def test_scaling_efficiency_reference():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from scaling import add_efficiency
    torchrun_only = [{"version": "v4", "preset": "small", "gpus": g, "launcher": "torchrun", "samples_per_s": s}
                     for g, s in [(1, 100.0), (2, 150.0)]]
    add_efficiency(torchrun_only)
    assert [r["efficiency"] for r in torchrun_only] == [1.0, 0.75]
    plain = {"version": "v4", "preset": "small", "gpus": 1, "launcher": "none", "samples_per_s": 200.0}
    rows = torchrun_only + [plain]   # the plain process is the reference wherever it stands in the list
    add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [0.5, 0.375, 1.0]


def test_scaling_repeats_are_interleaved_and_each_row_is_the_median_run(tmp_path, monkeypatch):
    """--repeats 3: the points run 1, 2, 1, 2, 1, 2 GPUs; each row is its median run (a failed run counts as
    slowest) and keeps every run's samples/s."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import scaling
    speeds = iter([100.0, 150.0, 120.0, None, 90.0, 190.0])   # run order: (1, 2) x 3
    order = []

    def fake_point(version, preset, gpus, args, out_dir, launcher="torchrun"):
        order.append(gpus)
        speed = next(speeds)
        row = {"version": version, "preset": preset, "gpus": gpus, "launcher": launcher, "command": "c"}
        if speed is None:
            return {**row, "error": "exit 1"}
        return {**row, "samples_per_s": speed, "global_batch_size": 2 * gpus, "median_step_ms": 1.0, "mfu": 0.1,
                "peak_memory_mib_per_gpu": 1.0}
    monkeypatch.setattr(scaling, "run_point", fake_point)
    monkeypatch.setattr(scaling, "visible_gpus", lambda device: 2)
    assert scaling.main(["--device", "cpu", "--versions", "v1", "--presets", "tiny", "--gpus", "1", "2",
                         "--repeats", "3", "--output-dir", str(tmp_path)]) == 0
    assert order == [1, 2, 1, 2, 1, 2]
    result = json.loads((tmp_path / "scaling.json").read_text())
    one, two = result["rows"]
    assert result["repeats"] == 3
    assert one["repeats_samples_per_s"] == [100.0, 120.0, 90.0] and one["samples_per_s"] == 100.0
    assert two["repeats_samples_per_s"] == [150.0, None, 190.0] and two["samples_per_s"] == 150.0
    assert two["speedup"] == pytest.approx(1.5)


def test_slurm_script_dry_run_builds_the_rendezvous_command(tmp_path):
    script = REPO_ROOT / "scripts" / "slurm_multinode.sbatch"
    env = clean_env(DRY_RUN="1", SLURM_NNODES="4", SLURM_JOB_ID="123", HEAD_NODE="node007", GPUS_PER_NODE="8",
                    REPO_ROOT=str(REPO_ROOT))
    result = subprocess.run(["bash", str(script), "v2", "--preset", "medium"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    command = result.stdout.split("command      :", 1)[1]
    for expected in ("srun", "--nnodes 4", "--nproc-per-node 8", "--rdzv-backend c10d",
                     "--rdzv-endpoint node007:29500", "--rdzv-id 123", "tiny_llama_v2.py --preset medium",
                     "--resume auto"):
        assert expected in command, expected
    assert "NCCL_NVLS_ENABLE=0" in result.stdout
    assert not (REPO_ROOT / "runs" / "slurm_123").exists()


# ----------------------------------------------------------------------------------------------------------
# Bad inputs: one line on stderr, exit code 2
# ----------------------------------------------------------------------------------------------------------
def write(tmp_path: Path, name: str, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


BAD_INPUTS = {
    "ZeRO stage 3": (lambda t: ["--deepspeed", "--zero-stage", "3"], "ZeRO stage 3 is not supported"),
    "ZeRO stage 7": (lambda t: ["--deepspeed", "--zero-stage", "7"], "must be 0, 1 or 2"),
    "--zero-stage without --deepspeed": (lambda t: ["--zero-stage", "1"], "add --deepspeed"),
    "--deepspeed with checkpoints": (lambda t: ["--deepspeed", "--save-every", "2"], "not supported with --deepspeed"),
    "DeepSpeed config not JSON": (lambda t: ["--deepspeed-config", write(t, "a.json", "{stage: 1")], "not valid JSON"),
    "DeepSpeed config missing": (lambda t: ["--deepspeed-config", str(t / "none.json")], "cannot read"),
    "DeepSpeed config not an object": (lambda t: ["--deepspeed-config", write(t, "b.json", [1, 2])], "JSON object"),
    "DeepSpeed config sets an optimizer": (
        lambda t: ["--deepspeed-config", write(t, "c.json", {"optimizer": {"type": "Adam"}})], "'optimizer'"),
    "DeepSpeed config batch differs": (
        lambda t: ["--deepspeed-config", write(t, "d.json", {"train_batch_size": 64})], "train_batch_size=64"),
    "DeepSpeed config ZeRO 3": (
        lambda t: ["--deepspeed-config", write(t, "e.json", {"zero_optimization": {"stage": 3}})], "ZeRO stage 3"),
    "DeepSpeed config bf16 without --use-amp": (
        lambda t: ["--deepspeed-config", write(t, "f.json", {"bf16": {"enabled": True}})], "--use-amp"),
    "unknown --dist-backend": (lambda t: ["--dist-backend", "mpi"], "invalid choice"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    flags, expected = BAD_INPUTS[case]
    code = call_main(SIZES + ["--num-steps", "2"] + flags(tmp_path))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def call_main(argv) -> int:
    try:
        return v1_main(argv)
    except SystemExit as exit_:   # argparse errors leave through SystemExit
        return exit_.code


def test_deepspeed_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deepspeed", None)   # `import deepspeed` now raises ImportError
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")          # restored afterwards (the harness may set it)
    code = call_main(SIZES + ["--num-steps", "2", "--deepspeed"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("DeepSpeed is not installed: pip install deepspeed") and "\n" not in err


LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}   # fails before anything connects to the port


def test_nccl_on_the_cpu_is_one_line(monkeypatch, capsys):
    for name, value in LAUNCHED.items():
        monkeypatch.setenv(name, value)
    code = call_main(SIZES + ["--num-steps", "2", "--dist-backend", "nccl"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--dist-backend nccl needs GPUs" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without GPUs")
def test_gpu_request_under_torchrun_without_gpus(tmp_path):
    result = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", SCRIPTS["v1"], *SIZES[:-2],
                             "--device", "cuda", "--num-steps", "2"], cwd=tmp_path)
    output = result.stdout + result.stderr
    # Rank 0 says it once and the workers exit with 2; torchrun then fails with its own report (which names the
    # first worker's exit code; it may stop the other worker before that one finishes).
    assert output.count("error: --device cuda was requested but no GPU is visible") == 1, output[-3000:]
    assert "exitcode  : 2" in output and result.returncode != 0
    assert "File \"" + str(SCRIPTS["v1"]) not in output   # no traceback through our script


# ----------------------------------------------------------------------------------------------------------
# Pieces, without processes
# ----------------------------------------------------------------------------------------------------------
def test_launcher_detection():
    assert distributed.launched_by_torchrun({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert not distributed.launched_by_torchrun({"RANK": "1"})
    context = distributed.setup(TrainConfig(), torch.device("cpu"), env={})
    assert not context.enabled and context.world_size == 1 and context.is_main
    # Without a process group every collective is the identity.
    assert context.average(2.5) == 2.5 and context.max_over_ranks(15) == 15
    context.check_same(3, "anything")
    assert context.weights_identical([torch.nn.Parameter(torch.ones(2))]) is None   # one process: nothing to compare


def test_backend_choice():
    assert distributed.choose_backend(torch.device("cuda", 0), "auto") == "nccl"   # RCCL on ROCm, same name
    assert distributed.choose_backend(torch.device("cpu"), "auto") == "gloo"
    assert distributed.choose_backend(torch.device("cuda", 0), "gloo") == "gloo"
    with pytest.raises(ConfigError, match="needs GPUs"):
        distributed.choose_backend(torch.device("cpu"), "nccl")


def test_deepspeed_config_is_built_from_the_flags():
    train = TrainConfig(batch_size=4, deepspeed=True, zero_stage=2, use_amp=True, amp_dtype="bfloat16")
    config = deepspeed_engine.build_deepspeed_config(train, world_size=8,
                                                file_settings={"zero_optimization": {"stage": 1,
                                                                                     "overlap_comm": True},
                                                               "train_batch_size": "auto"})
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["train_batch_size"] == 32
    assert config["gradient_accumulation_steps"] == 1
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}   # the flag wins over the file
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    plain = deepspeed_engine.build_deepspeed_config(TrainConfig(deepspeed=True), world_size=1)
    assert plain["zero_optimization"] == {"stage": 0} and not plain["bf16"]["enabled"]


def test_version_4_keeps_its_graph_under_ddp_and_falls_back_to_eager_under_deepspeed():
    from version4_triton_ultra.graphed_step import uses_graph
    gpu = torch.device("cuda", 0)

    def v4_args(**overrides):
        return SimpleNamespace(**{"cuda_graph": True, "use_amp": None, "amp_dtype": "bfloat16", **overrides})

    def context(engine):
        return distributed.DistributedContext(enabled=True, world_size=2, engine=engine, device=gpu)

    # DDP: the graph stays (its step averages the gradients itself), and the note says so.
    args = v4_args()
    note = distributed.graph_capture_note(args, gpu, context("ddp"), uses_graph)
    assert args.cuda_graph is True and "averages gradients inside its CUDA/HIP-graph step" in note
    assert "without the DDP wrapper" in note and "eager" not in note
    # DeepSpeed: its engine's hooks cannot be captured; the eager step, and the note says why.
    args = v4_args()
    note = distributed.graph_capture_note(args, gpu, context("deepspeed"), uses_graph)
    assert args.cuda_graph is False and "eager step under DeepSpeed" in note and "Python hooks" in note
    # DDP without the hook (a version whose step does not average): eager under DDP, as before.
    args = v4_args()
    note = distributed.graph_capture_note(args, gpu, context("ddp"))
    assert args.cuda_graph is False and "eager step under DDP" in note
    # float16 AMP: no graph in any case (GradScaler), so no note; the eager step under DDP.
    args = v4_args(use_amp=True, amp_dtype="float16")
    assert distributed.graph_capture_note(args, gpu, context("ddp"), uses_graph) is None
    single = v4_args()
    assert distributed.graph_capture_note(single, gpu, distributed.DistributedContext(), uses_graph) is None
    assert single.cuda_graph is True                         # a single process keeps its graph
    on_cpu = v4_args()
    assert distributed.graph_capture_note(on_cpu, torch.device("cpu"), context("ddp"), uses_graph) is None
    assert distributed.graph_capture_note(SimpleNamespace(), gpu, context("ddp")) is None   # v1-v3


# ----------------------------------------------------------------------------------------------------------
# On GPUs (run on a machine with at least 2 GPUs; skipped elsewhere)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("version, flags", [("v1", []), ("v2", []), ("v3", []), ("v4", []),
                                            pytest.param("v2", ["--enable-torch-compile"], marks=pytest.mark.slow)],
                         ids=["v1", "v2", "v3", "v4", "v2+compile"])
def test_two_gpus_equal_one_gpu(version, flags, tmp_path):
    """NCCL (RCCL) between two GPUs. Tolerance: TF32 (v4's default) and atomics (v4's embedding backward) make
    GPU runs differ slightly more than float32 on the CPU. Version 2 + torch.compile under DDP too (the scaling
    table's row; slow: two compilations)."""
    gpu = [arg if arg != "cpu" else "cuda" for arg in RUN] + flags
    out1, out2 = tmp_path / "one.json", tmp_path / "two.json"
    one = run([sys.executable, SCRIPTS[version], *gpu, "--batch-size", 8, "--output-json", out1], cwd=tmp_path,
              on_gpu=True)
    two = run(TORCHRUN + ["--standalone", "--nproc-per-node", 2, SCRIPTS[version], *gpu, "--batch-size", 4,
                          "--output-json", out2], cwd=tmp_path, on_gpu=True)
    assert one.returncode == 0 and two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    a = np.array(json.loads(out2.read_text())["loss"]["history"])
    b = np.array(json.loads(out1.read_text())["loss"]["history"])
    assert np.abs(a - b).max() < 1e-3 * np.abs(b).max()
    assert json.loads(out2.read_text())["distributed"]["weights_identical_across_ranks"] is True
    if version == "v4":   # the graph-captured step, averaging its own gradients (test_v4_data_parallel.py)
        assert "averages gradients inside its CUDA/HIP-graph step" in two.stdout
        assert "gradients averaged in v4's own step" in two.stdout and "eager step" not in two.stdout


def test_nccl_collectives_run_on_a_high_priority_stream_unless_switched_off(monkeypatch):
    assert distributed.nccl_high_priority({})
    for value in ("1", "yes", "true"):
        assert distributed.nccl_high_priority({"TORCH_NCCL_HIGH_PRIORITY": value})
    for value in ("0", "false", "No", " off "):
        assert not distributed.nccl_high_priority({"TORCH_NCCL_HIGH_PRIORITY": value})

    class Options:   # dist.ProcessGroupNCCL.Options, which a build without NCCL (this CPU one) does not have
        is_high_priority_stream = False
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    assert distributed.nccl_options({}).is_high_priority_stream
    assert not distributed.nccl_options({"TORCH_NCCL_HIGH_PRIORITY": "0"}).is_high_priority_stream
    monkeypatch.delattr(torch.distributed, "ProcessGroupNCCL")
    assert distributed.nccl_options({}) is None   # no NCCL in this torch: torch reports the backend itself
