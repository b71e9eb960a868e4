"""Version 4's graph-captured step trains exactly like its eager step (GPU only: graphs need a GPU)."""
import json

import pytest
import torch

from tinytransformer import triton_support
from version4_triton_ultra.fused_layers import VENDOR_ATTENTION_FROM_HEAD_DIM
from version4_triton_ultra.tiny_llama_v4 import main as v4_main

from .v4_training import train_frozen_embedding


def losses_of(tmp_path, name, extra):
    path = tmp_path / f"{name}.json"
    code = v4_main(["--num-steps", "25", "--warmup-steps", "5", "--log-every", "25", "--device", "cuda",
                    "--output-json", str(path), *extra])
    assert code == 0
    return json.loads(path.read_text())["loss"]["history"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [[], ["--use-amp", "--amp-dtype", "bfloat16"]], ids=["fp32", "bf16"])
def test_graph_and_eager_losses_match_step_for_step(tmp_path, precision):
    graphed = losses_of(tmp_path, "graph", ["--cuda-graph", *precision])
    eager = losses_of(tmp_path, "eager", ["--no-cuda-graph", *precision])
    assert len(graphed) == len(eager) == 25
    for step, (g, e) in enumerate(zip(graphed, eager)):
        # The same step: in float32 the same kernels in the same order (only the capturable optimizer's device-side
        # step counter differs); under autocast the graph's weight gradients are 16-bit GEMMs' products.
        assert g == pytest.approx(e, rel=1e-3), f"step {step}: graph {g} vs eager {e}"
    assert graphed[-1] < graphed[0] - 1.0   # and it trains


@pytest.mark.gpu
def test_graph_replays_read_new_batches(tmp_path):
    """A graph that kept reading its capture-time batch would show a frozen loss; losses must vary."""
    graphed = losses_of(tmp_path, "graph", ["--cuda-graph"])
    assert len(set(round(v, 6) for v in graphed[5:])) > 10
    assert torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize("equal", [False, True], ids=["main-stream-first", "equal-priority"])
def test_the_main_stream_is_captured_above_the_second_stream(equal):
    """GraphedStep records the step on a stream of higher priority than the weight-gradient stream's where replayed
    graphs honour it, and at the second stream's priority with --equal-stream-priority (or where they do not)."""
    from version4_triton_ultra import graphed_step, profile_graphed_step
    flags = ["--steps", "1"] + (["--equal-stream-priority"] if equal else [])
    step, inputs, targets = profile_graphed_step.build_step(profile_graphed_step.parse_args(flags))
    record_step, priorities = step._step, []

    def recording_step(*args):   # the priority of the stream the capture really records on
        if torch.cuda.is_current_stream_capturing():
            priorities.append(torch.cuda.current_stream().priority)
        return record_step(*args)
    step._step = recording_step
    losses = [step(inputs, targets).item() for _ in range(8)]   # 3 eager steps, the capture, replays
    second_stream = step.model.weight_grad_stream.stream.priority
    above = not equal and graphed_step.graph_priorities_apply()
    assert priorities == [graphed_step.CAPTURE_PRIORITY if above else second_stream]
    assert not above or graphed_step.CAPTURE_PRIORITY < second_stream   # CUDA counts down: lower starts sooner
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("torch_version, hip, applies", [
    ("2.9.1+cu128", None, False),        # before PyTorch instantiated graphs with per-kernel priorities
    ("2.10.0", None, True), ("2.10.0a0+git1234", None, True), ("2.11.0+cu130", None, True),
    ("2.13.0+rocm6.4", "6.4.1", False),   # HIP graphs: instantiated without per-kernel priorities
])
def test_stream_priorities_apply_on_cuda_from_torch_2_10(torch_version, hip, applies):
    from version4_triton_ultra.graphed_step import node_priorities_in
    assert node_priorities_in(torch_version, hip) is applies


@pytest.mark.gpu
def test_stream_priority_changes_no_loss(tmp_path):
    """The priority only orders kernels that may run side by side: the losses are those of equal priorities."""
    first = losses_of(tmp_path, "first", ["--cuda-graph", "--use-amp", "--amp-dtype", "bfloat16"])
    equal = losses_of(tmp_path, "equal", ["--cuda-graph", "--use-amp", "--amp-dtype", "bfloat16",
                                          "--equal-stream-priority"])
    for step, (f, e) in enumerate(zip(first, equal)):
        assert f == pytest.approx(e, rel=1e-3), f"step {step}: main stream first {f} vs equal priority {e}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--batch-size", "0"], ["--bogus"]])
def test_profile_graphed_step_needs_a_gpu_and_good_flags(flags):
    import subprocess
    import sys
    from pathlib import Path
    repo_root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "version4_triton_ultra/profile_graphed_step.py", *flags],
                            cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "error:" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--forms", "as-is", "bogus"], ["--forms", "as-is", "as-is"],
                                   ["--preset", "huge"], ["--rounds", "0"], ["--use-amp", "--seq-len", "0"],
                                   ["--top", "5"], ["--forms", "separate-swiglu", "--swiglu-in-gemms"]])
def test_compare_step_forms_needs_a_gpu_and_good_flags(flags):
    import subprocess
    import sys
    from pathlib import Path
    repo_root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "version4_triton_ultra/compare_step_forms.py", *flags],
                            cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("compare_step_forms.py: error:"), result.stderr


def fake_steps(monkeypatch, build=None):
    """compare_step_forms's GPU calls replaced: each built step is its form's name; the timings are recorded."""
    from version4_triton_ultra import profile_graphed_step
    timed = []
    monkeypatch.setattr(profile_graphed_step, "build_step", build or (lambda args: (args.form, None, None)))
    monkeypatch.setattr(profile_graphed_step, "median_step_ms",
                        lambda step, inputs, targets, steps: timed.append(step) or 1.0)
    return timed


def test_compare_step_forms_starts_each_round_with_the_next_form(monkeypatch):
    from types import SimpleNamespace
    from version4_triton_ultra.compare_step_forms import time_forms
    timed = fake_steps(monkeypatch)
    forms = {name: SimpleNamespace(form=name, programmatic_launch=True) for name in ("a", "b", "c")}
    times = time_forms(forms, rounds=4, steps=5)
    assert timed[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]   # after 3 warm-ups
    assert all(len(rounds) == 4 for rounds in times.values())


def test_compare_step_forms_captures_each_form_with_its_own_launches(monkeypatch):
    """The launch setting is process-wide and a graph keeps what it captured: each form's step must be warmed up
    and captured with its own setting, whatever the form built last set; afterwards the setting is the one before."""
    from types import SimpleNamespace
    from version4_triton_ultra.compare_step_forms import time_forms
    from version4_triton_ultra.kernels import programmatic_launch
    fake_steps(monkeypatch)
    captured = {}

    def first_call_captures(step, inputs, targets, steps):
        captured.setdefault(step, programmatic_launch.programmatic_launch_enabled())
        return 1.0
    monkeypatch.setattr("version4_triton_ultra.profile_graphed_step.median_step_ms", first_call_captures)
    forms = {"as-is": SimpleNamespace(form="as-is", programmatic_launch=True),
             "no-programmatic-launch": SimpleNamespace(form="no-programmatic-launch", programmatic_launch=False)}
    programmatic_launch.set_programmatic_launch(True)
    try:
        time_forms(forms, rounds=1, steps=5)
        after = programmatic_launch.programmatic_launch_enabled()
    finally:
        programmatic_launch.set_programmatic_launch(True)
    assert captured == {"as-is": True, "no-programmatic-launch": False}
    assert after, "the setting from before the forms, not the last form's"


def test_compare_step_forms_out_of_memory_is_one_line(monkeypatch):
    from types import SimpleNamespace
    from tinytransformer.config import ConfigError
    from version4_triton_ultra.compare_step_forms import time_forms

    def build(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fake_steps(monkeypatch, build)
    with pytest.raises(ConfigError, match="does not hold 2 forms") as error:
        time_forms({"a": SimpleNamespace(programmatic_launch=True), "b": SimpleNamespace(programmatic_launch=True)},
                   rounds=1, steps=5)
    assert "\n" not in str(error.value)


def test_compare_step_forms_reports_each_form_against_the_first():
    from version4_triton_ultra.compare_step_forms import report
    rows = report({"as-is": [10.0, 12.0, 11.0], "separate-rope": [9.0, 8.0, 10.0]})
    assert [row["form"] for row in rows] == ["as-is", "separate-rope"]
    assert rows[0]["median_step_ms"] == 11.0 and rows[0]["relative_to_first"] == 1.0
    assert rows[1]["median_step_ms"] == 9.0 and rows[1]["relative_to_first"] == pytest.approx(9.0 / 11.0)
    assert rows[1]["flags"] == ["--separate-rope"] and rows[1]["rounds_ms"] == [9.0, 8.0, 10.0]
    assert rows[0]["rounds_faster_than_first"] == 0 and rows[1]["rounds_faster_than_first"] == 3


@pytest.mark.gpu
def test_compare_step_forms_times_every_form(tmp_path, capsys):
    import json
    from version4_triton_ultra import compare_step_forms
    out = tmp_path / "forms.json"
    assert compare_step_forms.main(["--forms", "rope-in-gemm", "separate-rope", "--rounds", "2", "--steps", "5",
                                    "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["form"] for row in rows] == ["rope-in-gemm", "separate-rope"]
    assert all(len(row["rounds_ms"]) == 2 and min(row["rounds_ms"]) > 0 for row in rows)
    assert "separate-rope" in capsys.readouterr().out


@pytest.mark.parametrize("flags, want", [
    (dict(preset=None), (256, 4, 8, 128, 128)),                                  # the seed model
    (dict(preset="small"), (512, 6, 16, 256, 256)),                              # the preset's model and sizes
    (dict(preset="medium", batch_size=2, seq_len=1024), (1024, 12, 2, 1024, 1024)),   # flags override the preset
])
def test_profile_graphed_step_takes_the_presets_sizes(flags, want):
    """--preset: the preset's model, batch and sequence; --batch-size and --seq-len still win, and the model's
    max_seq_len grows to hold a longer sequence."""
    import argparse
    from version4_triton_ultra.profile_graphed_step import model_config, resolve_sizes
    args = resolve_sizes(argparse.Namespace(**{"batch_size": None, "seq_len": None, **flags}))
    config = model_config(args)
    assert (config.hidden_dim, config.num_layers, args.batch_size, args.seq_len, config.max_seq_len) == want


def test_profile_graphed_step_kernel_families():
    from version4_triton_ultra.profile_graphed_step import family_totals, kernel_family
    assert kernel_family("_flash_attention_backward_dq_kernel") == "attention"
    # cuDNN's fused attention (the layers' choice at head dim 128 on Hopper), by the name its kernels carry.
    assert kernel_family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128") == "attention"
    assert kernel_family("_down_swiglu_backward_kernel") == "feed-forward GEMMs + SwiGLU (Triton)"
    assert kernel_family("_separate_swiglu_backward_kernel") == "SwiGLU between vendor GEMMs (Triton)"
    assert kernel_family("_qkv_rope_kernel") == "QKV GEMM + RoPE (Triton)"
    assert kernel_family("_rotate_qk_kernel") == "RoPE after a vendor GEMM (Triton)"
    assert kernel_family("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN") == "GEMMs (vendor BLAS)"
    assert kernel_family("Cijk_Alik_Bljk_BBS_BH_MT128x128x32") == "GEMMs (vendor BLAS)"
    assert kernel_family("void at::native::reduce_kernel<512, 1, ...>") == "norms"
    assert kernel_family("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "GEMMs (vendor BLAS)"
    assert kernel_family("Memset (Unknown)") == "other"
    rows = [("_add_rms_norm_backward_kernel", 9, 2.0, 18.0), ("_add_rms_norm_forward_kernel", 9, 1.0, 9.0),
            ("_cross_entropy_rows_kernel", 1, 30.0, 30.0), ("Memcpy DtoD", 2, 1.0, 2.0)]
    assert family_totals(rows) == [("loss", 30.0), ("norms", 27.0), ("other", 2.0)]


def gradients_after_backward(config, inputs, targets, amp: bool, stream: bool, backward_passes: int = 1,
                             sixteen_bit: bool = False):
    """({name: gradient} after the backward passes, [16-bit gradients held after each pass]); with sixteen_bit, a
    weight's 16-bit gradient widened where the stream wrote one (and then the weight has no .grad)."""
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama
    model = TinyLlama(config).cuda()
    model.use_weight_gradient_stream(stream, sixteen_bit_gradients=sixteen_bit)
    held = []
    for _ in range(backward_passes):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            _, loss = model(inputs, targets)
        loss.backward()
        model.join_weight_gradients()
        held.append(len(model.sixteen_bit_gradients))
    # Read on the main stream right after the join, which must have ordered it after the side stream.
    gradients16 = model.sixteen_bit_gradients
    assert all(p.grad is None for p in gradients16)
    return {name: (gradients16[p].float() if p in gradients16 else p.grad.clone())
            for name, p in model.named_parameters()}, held


def small_batch(config):
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, 129), device="cuda")
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backward_passes", [1, 2], ids=["one-backward", "accumulated"])
def test_weight_gradients_on_a_second_stream_equal_autograds(amp, backward_passes):
    from tinytransformer.config import ModelConfig
    config = ModelConfig(num_layers=2)
    inputs, targets = small_batch(config)
    want, _ = gradients_after_backward(config, inputs, targets, amp, stream=False, backward_passes=backward_passes)
    got, _ = gradients_after_backward(config, inputs, targets, amp, stream=True, backward_passes=backward_passes)
    assert got.keys() == want.keys()
    for name in want:
        # The same GEMMs on another stream; only the embedding's atomic scatter-add may sum in another order.
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("backward_passes", [1, 2], ids=["one-backward", "accumulated"])
def test_16bit_weight_gradients_are_autograds_rounded(backward_passes):
    """Under autocast, the stream's 16-bit weight gradients are autograd's float32 ones rounded to bfloat16 (the
    16-bit GEMM may sum in another order: within two units of bfloat16's last place), and so is the output head's,
    which the fused loss sums in bfloat16 (one rounding a chunk; this batch is one chunk). A second backward pass
    continues in float32, from the first one's 16-bit gradient: its sum carries that rounding only."""
    from tinytransformer.config import ModelConfig
    config = ModelConfig(num_layers=2)
    inputs, targets = small_batch(config)
    want, _ = gradients_after_backward(config, inputs, targets, True, stream=False, backward_passes=backward_passes)
    got, held = gradients_after_backward(config, inputs, targets, True, stream=True,
                                         backward_passes=backward_passes, sixteen_bit=True)
    # Every projection's, 4 in each of the 2 layers, and the output head's (which the fused loss sums in bfloat16);
    # a second pass widens them into float32 .grad.
    assert held == [9, 0][:backward_passes]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2 ** -7, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_graph_with_a_frozen_embedding_trains_like_the_eager_step():
    """The streams are joined by the step itself, so a backward pass that computes no embedding gradient (frozen
    here) still waits for every weight-gradient GEMM before the optimizer, in the graph as in eager mode."""
    losses = {graphed: train_frozen_embedding(graphed).losses for graphed in (True, False)}
    for g, e in zip(losses[True], losses[False]):
        assert g == pytest.approx(e, rel=1e-3)


def v4_args(**overrides):
    from types import SimpleNamespace
    args = dict(device="auto", cuda_graph=True, weight_grad_stream=True, rope_in_attention=False, separate_swiglu=False,
                separate_rope=False, torch_adamw=False, tf32=True, use_amp=None, deepspeed=None, deepspeed_config=None,
                equal_stream_priority=False, vendor_attention=False, preset=None, config=None)
    return SimpleNamespace(**{**args, **overrides})


@pytest.mark.parametrize("tf32", [True, False], ids=["--tf32", "--no-tf32"])
def test_header_on_the_cpu_says_exact_float32_in_the_interpreter(tf32, monkeypatch):
    """Without a GPU (or with --device cpu) the header describes what runs: eager steps in Triton's interpreter and
    exact float32 matmuls, whatever --tf32 says (TF32 is an NVIDIA GPU mode); with a GPU, the TF32 setting."""
    from version4_triton_ultra import tiny_llama_v4 as v4
    monkeypatch.setattr(v4, "interpreter_active", lambda: True)
    for cpu in (v4_args(tf32=tf32, device="cpu"), v4_args(tf32=tf32)):
        if cpu.device == "auto":
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        info = v4.describe(cpu)
        assert "TF32 tensor cores" not in info["matmuls"] and info["matmuls"].startswith("exact float32")
        assert "interpreter" in info["matmuls"] and "interpreter" in info["step"] and "graph" not in info["step"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(v4, "interpreter_active", lambda: False)
    monkeypatch.setattr(v4.graphed_step, "graph_priorities_apply", lambda: True)
    gpu = v4.describe(v4_args(tf32=tf32))
    assert gpu["matmuls"] == ("TF32 tensor cores for float32" if tf32 else "exact float32")
    assert gpu["step"].startswith("CUDA/HIP graph replay") and gpu["step"].endswith("a second stream of lower priority")
    equal = v4.describe(v4_args(tf32=tf32, equal_stream_priority=True))["step"]
    assert equal.endswith("a second stream"), equal
    monkeypatch.setattr(v4.graphed_step, "graph_priorities_apply", lambda: False)   # ROCm, or torch before 2.10
    assert v4.describe(v4_args(tf32=tf32))["step"].endswith("a second stream")


def test_header_names_the_weight_gradients_dtype_the_optimizer_reads(monkeypatch):
    """Under autocast in the graph-captured step the second stream writes 16-bit weight gradients, and the fused
    loss the output head's, unless --float32-weight-grads or torchrun (whose all-reduces sum float32 gradients) says
    otherwise; --float32-head-grad keeps the head's float32 alone."""
    from version4_triton_ultra import tiny_llama_v4 as v4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(v4, "interpreter_active", lambda: False)
    amp = dict(use_amp=True, amp_dtype="bfloat16")
    assert v4.describe(v4_args(**amp))["optimizer"].endswith("reading 16-bit weight gradients, the output head's too")
    head = v4.describe(v4_args(**amp, sixteen_bit_head_grad=False))["optimizer"]
    assert head.endswith("reading 16-bit weight gradients (the output head's float32)"), head
    assert v4.describe(v4_args(**amp, sixteen_bit_weight_grads=False))["optimizer"].endswith("float32 weight gradients")
    assert v4.describe(v4_args(**amp, weight_grad_stream=False))["optimizer"].endswith("weight copies")
    for torch_optimizer in (dict(torch_adamw=True), dict(deepspeed=True), dict(deepspeed_config="ds.json")):
        assert v4.describe(v4_args(**amp, **torch_optimizer))["optimizer"] == "torch AdamW (fused)"
        assert v4.sixteen_bit_weight_gradients_of_args(v4_args(**amp, **torch_optimizer)) is False
    monkeypatch.setattr(v4.distributed, "launched_by_torchrun", lambda: True)
    assert v4.sixteen_bit_weight_gradients_of_args(v4_args(**amp)) is False


def test_header_names_the_attention_tiles_where_version_4s_attention_runs(monkeypatch, known_gpu):
    """On an H100 the medium preset in bfloat16 takes version 4's attention (head dim 64), and the header's "attn
    tiles" line gives its launches at the preset's 512 tokens; where cuDNN's attention runs (--cudnn-attention,
    or by the rule at the large preset's head dim 128) and on the CPU, there is no such line."""
    from version4_triton_ultra import tiny_llama_v4 as v4
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(v4, "interpreter_active", lambda: False)
    # The H100's rule (fused_layers.vendor_attention_pays) without the probe of cuDNN that needs the GPU itself.
    monkeypatch.setattr(v4, "uses_vendor_attention",
                        lambda chosen, rope_form, device, dtype, head_dim: (head_dim >= VENDOR_ATTENTION_FROM_HEAD_DIM
                                                                          if chosen is None else chosen))
    medium = dict(preset="medium", use_amp=True, amp_dtype="bfloat16", vendor_attention=None)
    info = v4.describe(v4_args(**medium))
    assert info["attention"].startswith("version 4's Triton flash attention")
    assert info["attn tiles"] == ("forward 64x64, 4 warps, 3 stages; dq 64x64, 4 warps, 2 stages; dk/dv 64x64, "
                                  "4 warps, 1 stage (Hopper-class tiles from tune_attention_tiles.py; no row masks)")
    assert "attn tiles" not in v4.describe(v4_args(**{**medium, "vendor_attention": True}))
    assert "attn tiles" not in v4.describe(v4_args(**{**medium, "preset": "large"}))
    assert "attn tiles" not in v4.describe(v4_args(**{**medium, "device": "cpu"}))


@pytest.mark.parametrize("flags", [[], ["--use-amp", "--amp-dtype", "bfloat16"], ["--torch-adamw"], ["--deepspeed"],
                                   ["--deepspeed-config", "ds.json"]],
                         ids=["default", "bf16", "torch-adamw", "deepspeed", "deepspeed-config"])
def test_header_names_the_optimizer_the_model_builds(flags):
    """The header reads the optimizer from the flags (takes_torch_adamw: it may describe a run before any
    configuration exists); the model chooses it from its TrainConfig. Parsed from the same flags, they agree."""
    from tinytransformer.cli import build_parser, resolve_configs
    from version4_triton_ultra import tiny_llama_v4 as v4
    args = build_parser(v4.SPEC).parse_args(flags + ["--num-layers", "1", "--hidden-dim", "64", "--num-heads", "2"])
    config, train = resolve_configs(args)
    optimizer = v4.build_model(config, args).configure_optimizer(train)
    assert isinstance(optimizer, torch.optim.AdamW) == v4.takes_torch_adamw(args)
    assert v4.describe(args)["optimizer"].startswith("torch AdamW") == isinstance(optimizer, torch.optim.AdamW)


def test_sixteen_bit_weight_gradients_need_every_condition():
    """The step writes 16-bit weight gradients only when all four hold; any one of them false turns them off."""
    from version4_triton_ultra.graphed_step import writes_sixteen_bit_weight_gradients
    yes = dict(requested=True, on_second_stream=True, summed_across_ranks=False, optimizer_reads_them=True)
    assert writes_sixteen_bit_weight_gradients(**yes) is True
    for name in yes:
        assert writes_sixteen_bit_weight_gradients(**{**yes, name: not yes[name]}) is False, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the header of a run on a machine without a GPU")
@pytest.mark.interpreter
def test_cpu_run_header_has_no_tf32_claim(tmp_path, capsys):
    code = v4_main(["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "32",
                    "--vocab-size", "64", "--batch-size", "2", "--seq-len", "16", "--num-steps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    matmuls = [line for line in out.splitlines() if line.startswith("matmuls")]
    assert matmuls and "TF32 tensor cores" not in matmuls[0] and "exact float32" in matmuls[0], out
    assert not out.startswith("No GPU found")   # nothing before the header: bad input stays one line


def made_up_replay(t):
    """A replay starting at t us: a norm, beside it a weight GEMM of another stream, a memset, a GEMM."""
    return [("norm", t, t + 10), ("wgrad", t + 5, t + 12), ("memset", t + 14, t + 15), ("gemm", t + 19, t + 40)]


def test_idle_gaps_are_time_with_no_kernel_of_any_stream_by_the_kernels_around_them():
    """Three replays of a made-up step: a norm, beside it a weight GEMM of another stream, a memset, a GEMM. A gap
    is time that no stream's kernel covers, named by the kernel that ended last before it and the one that starts
    it; per step means over the three replays."""
    from version4_triton_ultra.profile_graphed_step import idle_gaps, kernel_table
    kernels = made_up_replay(200) + made_up_replay(0) + made_up_replay(100)   # any order
    idle_us, rows = idle_gaps(kernels, replays=3)
    # Per replay: 2 us before the memset, 4 us after it; and 60 us between replays 1 and 2 and between 2 and 3.
    assert idle_us == pytest.approx((2 + 4) + 2 * 60 / 3)
    assert rows == [(40.0, pytest.approx(2 / 3), "gemm", "norm"), (4.0, 1.0, "memset", "gemm"),
                    (2.0, 1.0, "wgrad", "memset")]
    assert idle_gaps(kernels, replays=3, min_gap_us=3.0)[1][-1][2:] == ("memset", "gemm")   # the 2 us gaps left out
    table, total_us, span_us = kernel_table(kernels, replays=3)
    assert table[0] == ("gemm", 1.0, 21.0, 21.0) and total_us == pytest.approx(10 + 7 + 1 + 21)
    assert span_us == pytest.approx(240 / 3)


def test_kernels_at_once_splits_the_busy_time_into_one_and_several():
    """The made-up step above: one kernel 0-5, 10-12, 14-15 and 19-40 us (29 us a replay), the norm and the weight
    GEMM together 5-10 (5 us); a third kernel over both adds to "two or more", not to a third column."""
    from version4_triton_ultra.profile_graphed_step import kernels_at_once
    kernels = made_up_replay(200) + made_up_replay(0) + made_up_replay(100)
    assert kernels_at_once(kernels, replays=3) == (pytest.approx(29.0), pytest.approx(5.0))
    assert kernels_at_once(kernels + [("adamw", 6, 8)], replays=1) == (pytest.approx(87.0), pytest.approx(15.0))
    back_to_back = [("a", 0, 10), ("b", 10, 20)]   # one ends as the next starts: never two at once
    assert kernels_at_once(back_to_back, replays=1) == (20.0, 0.0)


def test_profile_graphed_step_prints_its_tables_and_the_idle_gaps(monkeypatch, capsys):
    """main() end to end with the GPU parts replaced (parse_args, the step, its timing and profile): 10 replays of
    a norm, a memset and a GEMM, 50 us apart."""
    from types import SimpleNamespace
    from version4_triton_ultra import profile_graphed_step as pgs
    args = SimpleNamespace(use_amp=True, preset="medium", batch_size=16, seq_len=512, steps=5, top=3)
    kernels = [(name, t + start, t + end) for t in range(0, 500, 50) for name, start, end in
               (("_add_rms_norm_forward_kernel", 0, 10), ("Memset (Device)", 14, 15), ("nvjet_sm90_gemm", 19, 40))]
    assert pgs.PROFILED_REPLAYS == 10
    monkeypatch.setattr(pgs, "parse_args", lambda argv: args)
    monkeypatch.setattr(pgs, "build_step", lambda parsed: ("step", None, None))
    monkeypatch.setattr(pgs, "median_step_ms", lambda *call, **steps: 0.04)
    monkeypatch.setattr(pgs, "profiled_kernels", lambda *call: kernels)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "a GPU")
    assert pgs.main([]) == 0
    out = capsys.readouterr().out
    assert "median 40.0 us per step" in out and "3 kernels per step" in out and "GEMMs (vendor BLAS)" in out
    # 4 + 4 us in every replay and 10 us between replays, 9 times: 17 us a step
    assert "GPU idle (no kernel of any stream running): 17.0 us a step" in out
    assert "    9.0    0.9  nvjet_sm90_gemm -> _add_rms_norm_forward_kernel" in out
    assert "kernels running at once: one for 32.0 us a step, two or more for 0.0 us" in out
    monkeypatch.setattr(pgs, "profiled_kernels", lambda *call: [])
    assert pgs.main([]) == 1   # nothing recorded: said in one line, not a traceback
