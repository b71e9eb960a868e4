"""Tests of version 4's flash attention (version4_triton_ultra/kernels/flash_attention.py): version 3's kernels
with RoPE applied as q and k are loaded (--rope-in-attention), and the packed kernels without autograd that
version 4's default path calls after its QKV GEMM has rotated q and k (RotaryQKVAttention).

Every case compares against attention computed in float64 by PyTorch with an explicit S x S softmax, with q and
k rotated first (attention_checks.py). The plain path, which this copy shares with version 3, is tested in
test_v3_flash_attention.py; the launch choices are checked to be version 3's here.
"""
import math

import pytest
import torch

from tinytransformer import triton_support
from version3_triton.kernels import flash_attention as v3_fa
from version4_triton_ultra.kernels import flash_attention as fa

from .attention_checks import (TOLERANCE, check_against_reference, check_backward_is_deterministic,
                               check_non_contiguous_inputs_and_broadcast_grad, check_packed_against_reference,
                               check_packed_equals_unpacked, fixed_tiles, pack_heads, recording_new_buffer,
                               reference_attention, relative_error, rope_tables, rotate_half, unpack_reference)
from .script_checks import assert_refused_in_one_line

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    """Every buffer the op allocates starts as NaN, so an element a kernel never writes fails the test."""
    monkeypatch.setattr(fa, "FILL_NEW_BUFFERS_WITH_NAN", True)


def test_nan_fill_hook_is_active():
    assert torch.isnan(fa._new_buffer((3, 4), torch.float32, torch.device("cpu"))).all()


# ----------------------------------------------------------------------------------------------------------
# RoPE on load: q, k, v [B, H, S, Dh]
# ----------------------------------------------------------------------------------------------------------
ROPE_SHAPES = [(1, 2, 1, 32), (2, 1, 37, 32), (1, 2, 100, 32), (1, 1, 64, 64), (1, 1, 37, 16),
               (1, 1, 37, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_on_load_matches_reference(shape, dtype, device):
    check_against_reference(fa, *shape, dtype, device, use_rope=True)


def test_rope_non_causal_matches_reference(device):
    check_against_reference(fa, 2, 1, 37, 32, torch.float32, device, causal=False, use_rope=True)


def test_rope_non_contiguous_inputs_and_broadcast_grad(device):
    check_non_contiguous_inputs_and_broadcast_grad(fa, device, use_rope=True)


def test_rope_backward_is_deterministic(device):
    check_backward_is_deterministic(fa, device, use_rope=True)


def test_rejects_bad_rope_tables(device):
    q = torch.randn(1, 2, 8, 32, device=device)
    with pytest.raises(ValueError, match="rope"):
        fa.flash_attention(q, q, q, rope=rope_tables(4, 32, device=device))
    qkv = torch.randn(1, 8, 3 * 2 * 32, device=device)
    with pytest.raises(ValueError, match="rope"):
        fa.flash_attention_packed(qkv, 2, rope=rope_tables(4, 32, device=device))


def test_forward_with_rope_refuses_to_run_without_a_buffer_for_the_rotated_rows(device):
    """The kernel writes the rotated q and k for the backward: a caller that gives nowhere to put them gets a
    clear error, not a kernel writing through placeholder pointers."""
    batch, heads, seq_len, head_dim = 1, 1, 8, 16
    q = torch.randn(batch, heads, seq_len, head_dim, device=device)
    strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim)   # contiguous [B, H, S, Dh]
    problem = fa._Problem(batch, heads, seq_len, head_dim, qkv_strides=strides, out_strides=strides,
                          causal=True, sm_scale=0.25, precision="ieee")
    cos, sin = rope_tables(seq_len, head_dim, device=device)
    with pytest.raises(ValueError, match="rotated"):
        fa._run_forward(problem, q, q, q, torch.empty_like(q), cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [129, 1000, 4096])
def test_rope_long_sequences_gpu(seq_len, head_dim, dtype, device):
    check_against_reference(fa, 1, 2, seq_len, head_dim, dtype, device, use_rope=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_more_heads_and_non_causal_gpu(head_dim, causal, device):
    check_against_reference(fa, 3, 5, 300, head_dim, torch.float16, device, causal=causal, use_rope=True)


# ----------------------------------------------------------------------------------------------------------
# RoPE on load, packed: qkv [B, S, 3D] (tiny_llama_v4.py --rope-in-attention)
# ----------------------------------------------------------------------------------------------------------
PACKED_SHAPES = [(1, 2, 1, 32), (2, 3, 37, 16), (2, 2, 64, 32), (1, 1, 100, 64), (1, 1, 129, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_rope_matches_reference(shape, dtype, device):
    check_packed_against_reference(fa, *shape, dtype, device, use_rope=True)


def test_packed_rope_non_causal_matches_reference(device):
    check_packed_against_reference(fa, 2, 2, 37, 32, torch.float32, device, causal=False, use_rope=True)


def test_packed_rope_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """The blocks a CPU run takes in the interpreter: 150 positions span two of each, the second one partial."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_packed_against_reference(fa, 2, 2, 150, 16, torch.float32, device, use_rope=True)


def test_packed_rope_equals_unpacked(device):
    check_packed_equals_unpacked(fa, 2, 3, 37, 16, torch.float32, device, causal=True, use_rope=True)


def test_packed_rope_allocates_poisoned_outputs(monkeypatch, device):
    """out, lse, the rotated [q | k | v] the forward saves for the backward, delta and the ONE gradient buffer of
    qkv all come from _new_buffer, i.e. start as NaN under the autouse fixture; finite results therefore mean
    every element was written (the backward reads every element of the rotated buffer)."""
    allocated = recording_new_buffer(fa, monkeypatch)
    batch, heads, seq_len, head_dim = 2, 2, 37, 16
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device, requires_grad=True)
    out = fa.flash_attention_packed(qkv, heads, rope=rope_tables(seq_len, head_dim, device=device))
    out.backward(torch.randn_like(out))
    assert sorted(allocated) == sorted([(batch, seq_len, dim), (batch * heads, seq_len),      # out, lse
                                        (batch, seq_len, 3 * dim),                              # rotated qkv
                                        (batch * heads, seq_len), (batch, seq_len, 3 * dim)])  # delta, d(qkv)
    assert torch.isfinite(out).all() and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 32), (16, 16)])
def test_rope_loop_bounds_with_other_tile_shapes(block_m, block_n, causal, monkeypatch, device):
    """The split into unmasked and masked key blocks, with RoPE, for any tile shapes."""
    monkeypatch.setattr(fa, "_launch_config", fixed_tiles(block_m, block_n))
    check_packed_against_reference(fa, 2, 2, 45, 16, torch.float32, device, causal=causal, use_rope=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 32), (16, 16)])
def test_whole_blocks_without_row_masks_with_other_tile_shapes(block_m, block_n, causal, monkeypatch, device):
    """64 positions are a whole number of blocks of every tile shape here, so the kernels run without their row
    masks (WHOLE_BLOCKS): the forward, dq and dk/dv, with and without RoPE, against float64."""
    monkeypatch.setattr(fa, "_launch_config", fixed_tiles(block_m, block_n))
    assert fa._whole_blocks(64, fa._launch_config())
    check_packed_against_reference(fa, 2, 2, 64, 16, torch.float32, device, causal=causal, use_rope=True)
    check_packed_against_reference(fa, 2, 2, 64, 16, torch.float32, device, causal=causal, use_rope=False)


@pytest.mark.parametrize("seq_len, block_m, block_n, whole", [(512, 64, 64, True), (64, 32, 16, True),
                                                               (48, 32, 16, False), (37, 16, 16, False),
                                                               (1, 16, 16, False), (128, 128, 64, True)])
def test_whole_blocks_only_when_no_block_runs_past_the_end(seq_len, block_m, block_n, whole):
    assert fa._whole_blocks(seq_len, dict(BLOCK_M=block_m, BLOCK_N=block_n)) is whole


def test_every_kernel_is_told_whether_its_blocks_are_whole(monkeypatch, device):
    """The three launches ask _whole_blocks with the tiles they launch with: masks go only where a block of the
    sequence runs past its end."""
    asked = []
    real = fa._whole_blocks
    monkeypatch.setattr(fa, "_whole_blocks", lambda seq_len, config: asked.append(real(seq_len, config)) or asked[-1])
    monkeypatch.setattr(fa, "_launch_config", fixed_tiles(32, 16))
    for seq_len in (64, 40):
        qkv = torch.randn(1, seq_len, 3 * 32, device=device)
        out, lse = fa.packed_attention_forward(qkv, 2)
        fa.packed_attention_backward(qkv, out, lse, torch.randn_like(out), 2)
    assert asked == [True] * 3 + [False] * 3   # forward, dq, dk/dv at 64 positions, then at 40


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seq_len", [128, 200, 512, 1000])
def test_packed_rope_full_size_gpu(seq_len, head_dim, dtype, device):
    check_packed_against_reference(fa, 4, 8 if head_dim == 32 else 4, seq_len, head_dim, dtype, device,
                                   use_rope=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seq_len", [128, 512])
def test_packed_rope_equals_unpacked_gpu(seq_len, dtype, device):
    check_packed_equals_unpacked(fa, 4, 8, seq_len, 32, dtype, device, causal=True, use_rope=True)


# ----------------------------------------------------------------------------------------------------------
# The packed kernels without autograd (version 4's default: RoPE in the QKV GEMM's epilogue)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_kernels_on_prerotated_qkv(causal, device):
    """packed_attention_forward / _backward (version 4 wraps them in a Function whose QKV GEMM rotates q and k in
    its epilogue): on a qkv whose q and k were rotated beforehand, the output is attention of the rotated q and
    k, and with rope= the gradient comes back for the UNrotated q and k."""
    batch, heads, seq_len, head_dim = 2, 3, 37, 16
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device)
    grad_out = torch.randn(batch, seq_len, dim, device=device)
    cos, sin = rope_tables(seq_len + 4, head_dim, device=device)

    qkv64 = qkv.double().requires_grad_()
    q, k, v = unpack_reference(qkv64, heads)
    want = pack_heads(reference_attention(q, k, v, causal, 1.0 / math.sqrt(head_dim), (cos, sin)))
    want.backward(grad_out.double())

    def rotate(t):   # [B, H, S, Dh] in float64, as the GEMM's epilogue would rotate it
        c, s = cos[:seq_len].double(), sin[:seq_len].double()
        return t * c + rotate_half(t) * s
    q, k, v = unpack_reference(qkv.double(), heads)
    rotated = torch.cat([pack_heads(rotate(q)), pack_heads(rotate(k)), pack_heads(v)], dim=-1).float()

    out, lse = fa.packed_attention_forward(rotated, heads, causal=causal, precise_fp32=True)
    assert lse.shape == (batch * heads, seq_len) and lse.dtype == torch.float32
    grad_qkv = fa.packed_attention_backward(rotated, out, lse, grad_out, heads, causal=causal, precise_fp32=True,
                                            rope=(cos, sin))
    checks = [("out", out, want)] + list(zip(("dq", "dk", "dv"), grad_qkv.split(dim, dim=-1),
                                             qkv64.grad.split(dim, dim=-1)))
    for name, got, ref in checks:
        error = relative_error(got, ref)
        assert error < TOLERANCE[torch.float32], f"{name}: relative error {error:.2e}"


def test_packed_kernels_without_rope_equal_the_autograd_function(device):
    """Without RoPE the two ways into the same kernels agree bit for bit."""
    batch, heads, seq_len, head_dim = 2, 2, 29, 32
    dim = heads * head_dim
    qkv = torch.randn(batch, seq_len, 3 * dim, device=device, requires_grad=True)
    grad_out = torch.randn(batch, seq_len, dim, device=device)
    out = fa.flash_attention_packed(qkv, heads)
    out.backward(grad_out)
    plain_out, lse = fa.packed_attention_forward(qkv.detach(), heads)
    grad_qkv = fa.packed_attention_backward(qkv.detach(), plain_out, lse, grad_out, heads)
    assert torch.equal(plain_out, out) and torch.equal(grad_qkv, qkv.grad)


def test_plain_path_equals_version_3(device):
    """Without RoPE version 4's copy runs version 3's arithmetic: the same output and gradient, bit for bit."""
    batch, heads, seq_len, head_dim = 2, 2, 37, 16
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim, device=device)
    results = []
    for module in (fa, v3_fa):
        leaf = qkv.clone().requires_grad_()
        out = module.flash_attention_packed(leaf, heads, precise_fp32=True)
        out.backward(torch.ones_like(out))
        results.append((out, leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


AMPERE_99_KIB = triton_support.KnownGpu("sm_86", "nvidia", 84, 99 * 1024)


@pytest.mark.parametrize("gpu", [triton_support.KNOWN_GPUS["gfx942"], triton_support.KNOWN_GPUS["sm_80"],
                                 AMPERE_99_KIB], ids=lambda gpu: gpu.target)
@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_launch_choices_off_hopper_are_version_3s(kernel, gpu, known_gpu):
    """AMD and NVIDIA GPUs with less shared memory than an H100 keep version 3's block sizes, warps and stages for
    every head dim, dtype and length, RoPE on load or not: nothing was measured there that says otherwise."""
    known_gpu(gpu)
    device = torch.device("meta")
    for head_dim in fa.SUPPORTED_HEAD_DIMS:
        for dtype in fa.SUPPORTED_DTYPES:
            for seq_len in (1, 128, 512, 4096):
                for rope_on_load in (False, True):
                    assert (fa._launch_config(head_dim, dtype, seq_len, kernel, device, rope_on_load)
                            == v3_fa._launch_config(head_dim, dtype, seq_len, kernel))
    assert fa.SUPPORTED_HEAD_DIMS == v3_fa.SUPPORTED_HEAD_DIMS


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_hopper_pipelines_only_16_bit_heads_of_64_and_128(kernel, known_gpu):
    """On an H100: float32 and head dims 16 and 32 (the seed size) keep version 3's choices; 16-bit head dims 64
    and 128 get 64 x 64 tiles with pipeline stages, except the forward with RoPE on load (one stage: three
    would not fit its shared memory at head dim 128)."""
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    device = torch.device("meta")
    for head_dim in fa.SUPPORTED_HEAD_DIMS:
        for dtype in fa.SUPPORTED_DTYPES:
            for rope_on_load in (False, True):
                mine = fa._launch_config(head_dim, dtype, 1024, kernel, device, rope_on_load)
                if dtype == torch.float32 or head_dim < 64:
                    assert mine == v3_fa._launch_config(head_dim, dtype, 1024, kernel)
                    continue
                assert (mine["BLOCK_M"], mine["BLOCK_N"], mine["num_warps"]) == (64, 64, 4)
                if kernel == "forward":
                    assert mine["num_stages"] == (1 if rope_on_load else 3)
    wide = {k: fa._launch_config(128, torch.bfloat16, 1024, k, device)["num_stages"] for k in ("dq", "dkdv")}
    assert wide == {"dq": 2, "dkdv": 2}


# ----------------------------------------------------------------------------------------------------------
# The run header's "attn tiles" line (launch_summary): what the launches take, in words
# ----------------------------------------------------------------------------------------------------------
def test_the_tiles_line_names_each_kernels_launch_and_its_rule(known_gpu):
    """Each kernel's tiles, warps and stages in launch order, the rule that chose them, and whether the sequence
    fills every block: Hopper's pipelined tiles at the medium preset's shape (one forward stage with RoPE on
    load), version 3's smaller tiles for AMD's LDS at head dim 128 with a partial last block."""
    meta = torch.device("meta")
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    assert fa.launch_summary(64, torch.bfloat16, 512, meta) == (
        "forward 64x64, 4 warps, 3 stages; dq 64x64, 4 warps, 2 stages; dk/dv 64x64, 4 warps, 1 stage "
        "(Hopper-class tiles from tune_attention_tiles.py; no row masks)")
    assert fa.launch_summary(64, torch.bfloat16, 512, meta, rope_on_load=True).startswith(
        "forward 64x64, 4 warps, 1 stage; dq 64x64, 4 warps, 2 stages;")
    known_gpu(triton_support.KNOWN_GPUS["gfx942"])
    assert fa.launch_summary(128, torch.bfloat16, 100, meta) == (
        "forward 64x32, 4 warps, 1 stage; dq 32x32, 4 warps, 1 stage; dk/dv 32x32, 4 warps, 1 stage "
        "(the portable rule; row masks on the last block)")


@pytest.mark.parametrize("rope_on_load", [False, True], ids=["packed", "rope-on-load"])
def test_the_tiles_line_describes_the_launches_a_pass_makes(rope_on_load, device, monkeypatch):
    """The configurations launch_summary reports are those a forward and backward pass launch at the same shape,
    RoPE on load or not (on a GPU, the Hopper rule gives the forward other stages with it)."""
    launched, reported = {}, {}
    choose = fa._launch_config

    def recording(into):
        def launch_config(head_dim, dtype, seq_len, kernel, *rest, **options):
            into[kernel] = choose(head_dim, dtype, seq_len, kernel, *rest, **options)
            return into[kernel]
        return launch_config

    torch.manual_seed(0)
    batch, heads, seq_len, head_dim = 1, 2, 64, 64
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16   # the interpreter refuses bfloat16
    monkeypatch.setattr(fa, "_launch_config", recording(launched))
    if rope_on_load:
        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        out = fa.flash_attention(q, k, v, rope=rope_tables(seq_len, head_dim, device=device))
    else:
        qkv = torch.randn(batch, seq_len, 3 * heads * head_dim, device=device, dtype=dtype, requires_grad=True)
        out = fa.flash_attention_packed(qkv, heads)
    out.float().sum().backward()
    monkeypatch.setattr(fa, "_launch_config", recording(reported))
    fa.launch_summary(head_dim, dtype, seq_len, device, rope_on_load=rope_on_load)
    assert set(launched) == {"forward", "dq", "dkdv"} and reported == launched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--preset", "huge"], ["--dtype", "float32"],
                                   ["--output-json", "/dev/null/x.json"]])
def test_the_attention_backend_comparison_needs_a_gpu_and_good_flags(flags):
    """compare_attention_backends.py: one line and exit 2, before anything is built."""
    assert_refused_in_one_line("compare_attention_backends.py", flags)


def test_attention_comparison_checks_gradients_and_catches_wrong_ones(device):
    """compare_attention_backends.py checks each row's output, dq, dk and dv against float64 attention: ours (dq and
    dk rotated back by RoPE, turned forward for the check) and an SDPA row pass; our gradient taken as an SDPA row's
    (not turned forward), an output off by 10% or a dv off by 4% is caught."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend
    from version4_triton_ultra import compare_attention_backends as compare
    torch.manual_seed(0)
    shape = compare.Shape(SimpleNamespace(batch=1, heads=2, seq_len=24, head_dim=16), torch.float32, device=device)
    want = compare.reference(shape)
    ours = compare.ours(shape)
    assert compare.check(shape, *ours, want, rotated_back=True)["verdict"] == "ok"
    assert compare.check(shape, *compare.sdpa(shape, SDPBackend.MATH), want, rotated_back=False)["verdict"] == "ok"
    not_turned = compare.check(shape, *ours, want, rotated_back=False)
    assert not_turned["verdict"].startswith("WRONG (dq") and "dv" not in not_turned["verdict"]
    assert not_turned["errors"]["out"] < 1e-3
    forward, forward_backward = ours
    off = compare.check(shape, lambda: 1.1 * forward(), forward_backward, want, rotated_back=True)
    assert off["verdict"].startswith("WRONG (out") and "dq" not in off["verdict"]

    def dv_slightly_off():   # one of the three gradients 4% off, the others right: named in the verdict
        grad = forward_backward()
        return torch.cat([grad[..., :2 * shape.dim], 1.04 * grad[..., 2 * shape.dim:]], -1)
    assert compare.check(shape, forward, dv_slightly_off, want, rotated_back=True)["verdict"].startswith("WRONG (dv")
