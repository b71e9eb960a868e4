"""Version 4 with the vendor's attention: cuDNN's fused attention after our QKV GEMM and RoPE (fused_layers.py:
RotatedQKV, vendor_attention, vendor_attention_pays; --cudnn-attention / --triton-attention).

On the CPU: the inverse rotation that RoPE's backward needs (kernels/qk_rotation.py, in Triton's interpreter), the
backward of RotatedQKV against autograd through a float64 reference (a plain PyTorch attention stands in for
cuDNN's, which needs an NVIDIA GPU), the rule that picks the attention, with stand-ins for the GPU it asks about,
and the flags' one-line refusals. On an NVIDIA GPU (gpu-marked): the whole model with cuDNN's attention against
version 1, at head dim 128 (where the rule picks it) and at the seed model's 32, and graph-captured.
"""
import pytest
import torch

from version4_triton_ultra import fused_layers
from version4_triton_ultra.kernels import qk_rotation as qk

from .equivalence import canonical, compare, forward_backward, random_batch
from .script_checks import assert_refused_in_one_line
from .v4_kernel_checks import assert_matches, random, rope_reference

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def tables(seq_len, head_dim, device):
    from version3_triton.kernels.rope import rope_tables
    return rope_tables(seq_len + 3, head_dim, device=device)


# ----------------------------------------------------------------------------------------------------------
# The inverse rotation
# ----------------------------------------------------------------------------------------------------------
def test_inverse_rotation_undoes_the_rotation(device):
    seq_len, heads, head_dim = 7, 2, 16
    qkv = random((2 * seq_len, 3 * heads * head_dim), torch.float32, device, seed=401)
    cos, sin = tables(seq_len, head_dim, device)
    rotated = qk.rotate_qk_(qkv.clone(), cos, sin, seq_len, head_dim)
    assert not torch.allclose(rotated, qkv)   # the rotation did something
    back = qk.rotate_qk_(rotated, cos, sin, seq_len, head_dim, inverse=True)
    assert_matches(back, qkv.double(), torch.float32, "rotated, then rotated back")


def test_inverse_rotation_is_the_rotation_by_minus_the_angle(device):
    """Against float64: rot(t, -angle) = t * cos - rotate_half(t) * sin (v untouched)."""
    batch, seq_len, heads, head_dim = 2, 5, 3, 16
    dim = heads * head_dim
    qkv = random((batch * seq_len, 3 * dim), torch.float32, device, seed=403)
    before = qkv.clone()
    cos, sin = tables(seq_len, head_dim, device)
    qk.rotate_qk_(qkv, cos, sin, seq_len, head_dim, inverse=True)
    parts = before.double().view(batch, seq_len, 3, heads, head_dim).unbind(2)
    c, s = cos[:seq_len].double(), sin[:seq_len].double()
    for name, got, part in zip("qk", qkv.split(dim, dim=-1)[:2], parts[:2]):
        assert_matches(got, rope_reference(part, c, -s).reshape(-1, dim), torch.float32, name)
    assert torch.equal(qkv[:, 2 * dim:], before[:, 2 * dim:]), "v was changed"


# ----------------------------------------------------------------------------------------------------------
# RotatedQKV's backward, with a plain attention standing in for cuDNN's
# ----------------------------------------------------------------------------------------------------------
def plain_causal_attention(qkv, num_heads):
    """vendor_attention's function in plain PyTorch ops (float64-able): [B, S, 3D] -> [B, S, D]."""
    batch, seq_len, width = qkv.shape
    q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, seq_len, 3, num_heads, -1).unbind(2))
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=qkv.device).tril()
    out = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, seq_len, width // 3)


@pytest.mark.parametrize("separate_rope", [True, False], ids=["vendor GEMM + RoPE kernel", "RoPE in the GEMM"])
def test_rotated_qkv_gradients_match_float64(separate_rope, device):
    batch, seq_len, heads, head_dim = 2, 6, 2, 16
    dim = heads * head_dim
    x = random((batch, seq_len, dim), torch.float32, device, seed=411).requires_grad_(True)
    weight = random((3 * dim, dim), torch.float32, device, seed=412, scale=dim ** -0.5).requires_grad_(True)
    grad_out = random((batch, seq_len, dim), torch.float32, device, seed=413)
    cos, sin = tables(seq_len, head_dim, device)

    qkv = fused_layers.RotatedQKV.apply(x, weight, weight, cos, sin, heads, None, separate_rope)
    plain_causal_attention(qkv, heads).backward(grad_out)

    x64, w64 = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    parts = (x64 @ w64.T).view(batch, seq_len, 3, heads, head_dim).unbind(2)
    c, s = cos[:seq_len].double(), sin[:seq_len].double()
    qkv64 = torch.stack([rope_reference(parts[0], c, s), rope_reference(parts[1], c, s), parts[2]], dim=2)
    plain_causal_attention(qkv64.reshape(batch, seq_len, 3 * dim), heads).backward(grad_out.double())
    assert_matches(qkv.detach(), qkv64.reshape(batch, seq_len, 3 * dim).detach(), torch.float32, "qkv")
    assert_matches(x.grad, x64.grad, torch.float32, "grad x")
    assert_matches(weight.grad, w64.grad, torch.float32, "grad W_qkv")


def test_vendor_attention_reads_the_packed_layout(device):
    """vendor_attention's views of the packed qkv and its [B, S, D] output, on PyTorch's math backend (any
    machine), against plain_causal_attention: output and gradient in float64."""
    from torch.nn.attention import SDPBackend
    qkv = random((2, 7, 3 * 2 * 16), torch.float64, device, seed=421).requires_grad_(True)
    grad_out = random((2, 7, 2 * 16), torch.float64, device, seed=422)
    out = fused_layers.vendor_attention(qkv, 2, backend=SDPBackend.MATH)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    qkv_ref = qkv.detach().clone().requires_grad_(True)
    out_ref = plain_causal_attention(qkv_ref, 2)
    (grad_ref,) = torch.autograd.grad(out_ref, qkv_ref, grad_out)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(grad, grad_ref)


# ----------------------------------------------------------------------------------------------------------
# The rule, with stand-ins for the GPU
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def hopper_with_cudnn(monkeypatch):
    """An NVIDIA GPU of compute capability 9.0 on which cuDNN's attention runs (stand-ins, on any machine)."""
    monkeypatch.setattr(fused_layers, "is_rocm", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_layers, "vendor_attention_problem", lambda device, dtype, head_dim: None)


def test_the_rule_picks_cudnn_on_hopper_from_head_dim_128(hopper_with_cudnn):
    cuda = torch.device("cuda")
    assert fused_layers.vendor_attention_pays(cuda, torch.bfloat16, 128)
    assert fused_layers.vendor_attention_pays(cuda, torch.bfloat16, 256)
    assert not fused_layers.vendor_attention_pays(cuda, torch.bfloat16, 64)   # a tie there: ours
    assert not fused_layers.vendor_attention_pays(torch.device("cpu"), torch.bfloat16, 128)


def test_the_rule_keeps_ours_off_hopper_and_on_rocm(hopper_with_cudnn, monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not fused_layers.vendor_attention_pays(cuda, torch.bfloat16, 128)   # not measured there
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_layers, "is_rocm", lambda: True)
    assert not fused_layers.vendor_attention_pays(cuda, torch.bfloat16, 128)   # no cuDNN on ROCm


def test_a_switch_overrides_the_rule_but_not_rope_on_load(hopper_with_cudnn):
    cuda = torch.device("cuda")
    choose = fused_layers.uses_vendor_attention
    assert choose(None, "separate", cuda, torch.bfloat16, 128) and not choose(None, "gemm", cuda, torch.bfloat16, 64)
    assert choose(True, "gemm", cuda, torch.bfloat16, 64) and not choose(False, "separate", cuda, torch.bfloat16, 128)
    assert not choose(True, "attention", cuda, torch.bfloat16, 128)   # RoPE on load: our kernel only


def test_what_cudnn_attention_needs_is_said_in_one_line(monkeypatch):
    problem = fused_layers.vendor_attention_problem
    assert "NVIDIA GPU" in problem(torch.device("cpu"), torch.bfloat16, 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fused_layers, "is_rocm", lambda: True)
    assert "NVIDIA GPU" in problem(torch.device("cuda"), torch.bfloat16, 128)
    monkeypatch.setattr(fused_layers, "is_rocm", lambda: False)
    assert "bfloat16 or float16" in problem(torch.device("cuda"), torch.float32, 128)


@pytest.mark.parametrize("flags, says", [
    (["--cudnn-attention", "--triton-attention"], "not allowed with"),
    (["--cudnn-attention", "--rope-in-attention"], "RoPE on load"),
    (["--cudnn-attention", "--device", "cpu"], "NVIDIA GPU"),
], ids=["both switches", "with RoPE on load", "on the CPU"])
def test_the_switches_refuse_what_cannot_run(flags, says):
    if "cpu" in flags and torch.cuda.is_available():
        pytest.skip("with a GPU, --device cpu is refused first for the interpreter being off")
    assert says in assert_refused_in_one_line("tiny_llama_v4.py", flags + ["--num-steps", "1"])


# ----------------------------------------------------------------------------------------------------------
# On an NVIDIA GPU: the model with cuDNN's attention is version 1's model
# ----------------------------------------------------------------------------------------------------------
def needs_cudnn_attention(head_dim):
    problem = fused_layers.vendor_attention_problem(torch.device("cuda"), torch.bfloat16, head_dim)
    if problem:
        pytest.skip(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_dim, num_heads", [(256, 2), (256, 8)], ids=["head dim 128", "head dim 32"])
def test_v4_with_cudnn_attention_matches_v1_under_bfloat16(hidden_dim, num_heads):
    from tinytransformer.config import ModelConfig
    from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama as V1
    from version4_triton_ultra.tiny_llama_v4 import TinyLlama as V4
    needs_cudnn_attention(hidden_dim // num_heads)
    config = ModelConfig(hidden_dim=hidden_dim, num_heads=num_heads)
    weights = canonical(config, seed=1)
    inputs, targets = random_batch(config, batch=8, seq=128, device="cuda", seed=2)
    reference = forward_backward(V1(config).cuda(), weights, inputs, targets, autocast_dtype=torch.bfloat16)
    model = V4(config).cuda()
    model.use_vendor_attention(True)
    candidate = forward_backward(model, weights, inputs, targets, autocast_dtype=torch.bfloat16)
    assert compare(reference, candidate, 2e-2) == []   # test_versions.GPU_BFLOAT16


@pytest.mark.gpu
def test_the_rule_decides_in_the_model_even_when_its_first_forward_has_no_gradients(monkeypatch):
    """No switch: at head dim 128 under bfloat16 the layers take cuDNN's attention on a Hopper GPU and ours on any
    other, also when the model's first forward pass runs under no_grad (forward_backward's is: the rule's probe of
    cuDNN must not read that as "cuDNN does not run"), and the model stays version 1's."""
    from tinytransformer.config import ModelConfig
    from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama as V1
    from version4_triton_ultra import tiny_llama_v4 as v4
    fused_layers._VENDOR_ATTENTION_RUNS.clear()   # probed afresh, from inside the model
    vendor_calls = []
    real = v4.vendor_attention
    monkeypatch.setattr(v4, "vendor_attention", lambda *a, **k: vendor_calls.append(1) or real(*a, **k))
    config = ModelConfig(hidden_dim=256, num_heads=2)
    weights = canonical(config, seed=1)
    inputs, targets = random_batch(config, batch=8, seq=128, device="cuda", seed=2)
    reference = forward_backward(V1(config).cuda(), weights, inputs, targets, autocast_dtype=torch.bfloat16)
    candidate = forward_backward(v4.TinyLlama(config).cuda(), weights, inputs, targets, autocast_dtype=torch.bfloat16)
    assert compare(reference, candidate, 2e-2) == []
    hopper = torch.cuda.get_device_capability()[0] == fused_layers.VENDOR_ATTENTION_GPU_GENERATION
    expected = hopper and fused_layers.vendor_attention_problem(torch.device("cuda"), torch.bfloat16, 128) is None
    assert bool(vendor_calls) == expected


@pytest.mark.gpu
def test_the_graph_captured_step_with_cudnn_attention_trains(tmp_path):
    """The training script at head dim 128 under bfloat16: the rule picks cuDNN's attention on a Hopper GPU (the
    header says so), the step is captured in a graph, and the loss falls as with our attention."""
    import json
    import subprocess
    import sys
    from .script_checks import VERSION4
    needs_cudnn_attention(128)
    losses = {}
    for switch in ("--cudnn-attention", "--triton-attention"):
        out = tmp_path / f"{switch}.json"
        result = subprocess.run([sys.executable, str(VERSION4 / "tiny_llama_v4.py"), switch, "--use-amp",
                                 "--hidden-dim", "256", "--num-heads", "2", "--num-steps", "30",
                                 "--output-json", str(out)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "CUDA/HIP graph replay" in result.stdout
        assert ("attention   : cuDNN's fused attention" in result.stdout) == (switch == "--cudnn-attention")
        losses[switch] = json.loads(out.read_text())["loss"]["history"]
    cudnn, ours = losses["--cudnn-attention"], losses["--triton-attention"]
    assert cudnn[-1] < cudnn[0] - 0.5
    assert abs(cudnn[-1] - ours[-1]) < 0.05 * abs(ours[-1])
