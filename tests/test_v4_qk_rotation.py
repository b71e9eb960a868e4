"""Version 4's RoPE as a kernel of its own (kernels/qk_rotation.py, the form --separate-rope runs).

Against a float64 PyTorch reference (q and k rotated, v untouched bit for bit), and against the epilogue form it
replaces (kernels/qkv_rope_gemm.py) on the same product. On CPU the kernel runs in Triton's interpreter: shapes
are small; the full-size and 16-bit cases are gpu-marked. The whole model with --separate-rope against version 1:
tests/test_versions.py (V4_SWITCHES).
"""
import pytest
import torch

from tinytransformer import triton_support
from version4_triton_ultra.kernels import qk_rotation as qk
from version4_triton_ultra.kernels import qkv_rope_gemm as qr

from .script_checks import assert_refused_in_one_line
from .v4_kernel_checks import assert_matches, random, rope_reference

# The kernels' smallest blocks in Triton's interpreter (the fixture in conftest.py): small problems span several
# blocks. A test of the blocks a CPU run gets says so.
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")


def tables(seq_len, head_dim, device):
    from version3_triton.kernels.rope import rope_tables
    return rope_tables(seq_len + 3, head_dim, device=device)   # longer than the sequence, as the model's are


def reference_rotation(qkv, cos, sin, seq_len, head_dim):
    """qkv [N, 3D] with its q and k heads rotated, in float64."""
    heads = qkv.double().view(-1, seq_len, 3, qkv.shape[1] // (3 * head_dim), head_dim)
    cos, sin = cos[:seq_len].double(), sin[:seq_len].double()
    q, k, v = heads.unbind(2)
    return torch.stack([rope_reference(q, cos, sin), rope_reference(k, cos, sin), v], dim=2).reshape(qkv.shape)


def check_rotation(batch, seq_len, heads, head_dim, dtype, device, seed):
    dim = heads * head_dim
    qkv = random((batch * seq_len, 3 * dim), dtype, device, seed)
    before = qkv.clone()
    cos, sin = tables(seq_len, head_dim, device)
    returned = qk.rotate_qk_(qkv, cos, sin, seq_len, head_dim)
    assert returned.data_ptr() == qkv.data_ptr() and qkv.dtype == dtype   # in place
    want = reference_rotation(before, cos, sin, seq_len, head_dim)
    for name, got, ref in zip("qk", qkv.split(dim, dim=-1)[:2], want.split(dim, dim=-1)[:2]):
        assert_matches(got, ref, dtype, name)
    assert torch.equal(qkv[:, 2 * dim:], before[:, 2 * dim:]), "v was changed"


@pytest.mark.parametrize("batch, seq_len, heads, head_dim", [(2, 5, 3, 16), (1, 37, 2, 32), (3, 16, 1, 16)],
                         ids=["rows not a multiple of the block", "two heads of 32", "one head, whole blocks"])
def test_rotation_matches_reference(batch, seq_len, heads, head_dim, device):
    check_rotation(batch, seq_len, heads, head_dim, torch.float32, device, seed=301)


def test_rotation_with_the_blocks_of_a_cpu_run(monkeypatch, device):
    """A CPU run's blocks (up to 256 rows, every head at once): a problem of more rows spans several blocks."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", False)
    check_rotation(3, 100, 5, 16, torch.float32, device, seed=311)


def test_rotation_after_the_gemm_equals_the_epilogue(device):
    """The two forms of version 4's QKV projection give the same qkv: the product rotated by this kernel, and the
    product rotated in the Triton GEMM's epilogue."""
    seq_len, heads, head_dim, n_in = 9, 3, 16, 40
    dim = heads * head_dim
    x = random((2 * seq_len, n_in), torch.float32, device, seed=321)
    weight = random((3 * dim, n_in), torch.float32, device, seed=322, scale=n_in ** -0.5)
    cos, sin = tables(seq_len, head_dim, device)
    separate = qk.rotate_qk_(x @ weight.T, cos, sin, seq_len, head_dim)
    fused = qr.qkv_rope(x, weight, cos, sin, seq_len, head_dim)
    tolerance = torch.bfloat16 if device.type == "cuda" else torch.float32   # TF32 GEMMs on a GPU
    assert_matches(separate, fused.double(), tolerance, "qkv")


def test_rotation_rejects_bad_inputs(device):
    cos, sin = tables(8, 16, device)
    qkv = torch.ones(16, 96, device=device)
    with pytest.raises(ValueError, match="whole sequences"):
        qk.rotate_qk_(qkv, cos, sin, 5, 16)
    with pytest.raises(ValueError, match="table"):
        qk.rotate_qk_(qkv[:12], cos, sin, 12, 16)
    with pytest.raises(ValueError, match="head_dim"):
        qk.rotate_qk_(torch.ones(16, 90, device=device), cos, sin, 8, 16)
    with pytest.raises(ValueError, match="head dim 24"):
        qk.rotate_qk_(torch.ones(16, 72, device=device), cos, sin, 8, 24)
    with pytest.raises(ValueError, match="contiguous"):
        qk.rotate_qk_(torch.ones(96, 16, device=device).T, cos, sin, 8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        qk.rotate_qk_(qkv.double(), cos, sin, 8, 16)


def test_rotation_shape_rule(monkeypatch):
    """The GPU's launch, checked on any machine: the row blocks run on the grid's first axis, so 16.8M rows (more
    than 65,535 row blocks of any tile here) are allowed on NVIDIA; heads beyond the second axis, unsupported head
    dims and, on AMD, more row blocks x threads than 2**32 are not."""
    monkeypatch.setattr(qk, "interpreter_active", lambda: False)
    assert qk.shape_problem(65535 * 257, 64, 64) is None
    assert "fewer heads" in qk.shape_problem(8, 64 * 2**20, 32)
    assert qk.shape_problem(8, 96, 24).startswith("head dim 24 not supported")
    monkeypatch.setattr(qk, "is_rocm", lambda: True)
    monkeypatch.setattr(qk, "threads_per_warp", lambda: 64)
    assert "2**32 work items" in qk.shape_problem(65535 * 257, 1024, 64)   # 8.4M row blocks of 512 threads
    assert qk.shape_problem(16 * 2**20 - 2, 1024, 64) is None   # 8,388,607 row blocks: the most that fit


def test_rotation_of_no_rows_is_a_no_op(device):
    cos, sin = tables(4, 16, device)
    empty = torch.ones(0, 96, device=device)
    assert qk.rotate_qk_(empty, cos, sin, 4, 16).shape == (0, 96)


def test_gpu_blocks_hold_whole_heads_and_2k_elements(monkeypatch):
    """The GPU's launch, checked on any machine: a power of two of heads, no more than there are to rotate (as a
    power of two) nor 1,024 columns, and 2,048 elements a program where a row's heads hold fewer."""
    monkeypatch.setattr(qk, "interpreter_active", lambda: False)
    for head_dim in qk.SUPPORTED_HEAD_DIMS:
        for rotated_heads in (1, 3, 32, 64):
            config = qk._launch_config(8192, rotated_heads, head_dim)
            heads, elements = config["HEADS"], config["BLOCK_M"] * config["HEADS"] * head_dim
            assert heads & (heads - 1) == 0 and heads <= max(1, 2 * rotated_heads - 1)
            assert heads * head_dim <= 1024 and elements == max(2048, heads * head_dim)
    assert qk._launch_config(8192, 32, 64) == dict(BLOCK_M=2, HEADS=16, num_warps=8)   # medium, as tuned


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq_len, heads, head_dim", [(8, 128, 8, 32), (16, 512, 16, 64), (4, 1024, 16, 128)],
                         ids=["seed", "medium", "large"])
def test_rotation_full_size_gpu(batch, seq_len, heads, head_dim, dtype, device):
    check_rotation(batch, seq_len, heads, head_dim, dtype, device, seed=331)



# ----------------------------------------------------------------------------------------------------------
# Which QKV form the attention layer uses: chosen by size unless a flag chooses (fused_layers.separate_rope_pays)
# ----------------------------------------------------------------------------------------------------------
def preset_rows_and_width(name):
    """(rows, hidden_dim) of a size preset's training batch."""
    from tinytransformer.cli import build_parser, resolve_configs
    from version4_triton_ultra import tiny_llama_v4 as v4
    args, _ = build_parser(v4.SPEC).parse_known_args(["--preset", name])
    config, train = resolve_configs(args)
    return train.batch_size * train.seq_len, config.hidden_dim


@pytest.mark.parametrize("preset, separate", [("tiny", False), ("small", True), ("medium", True), ("large", True)])
def test_the_size_rule_picks_the_qkv_form_measured_faster_at_each_preset(preset, separate):
    from version4_triton_ultra.fused_layers import separate_rope_pays
    assert separate_rope_pays(*preset_rows_and_width(preset)) is separate


def test_the_qkv_size_rule_switches_between_the_tiny_and_small_shapes():
    """2,048 rows x 512 x 1,536 = 1.6 G multiply-adds take the vendor GEMM, 1,024 rows (0.8 G) the epilogue."""
    from version4_triton_ultra.fused_layers import separate_rope_pays
    assert separate_rope_pays(2048, 512) and not separate_rope_pays(1024, 512)
    assert not separate_rope_pays(1024, 256) and separate_rope_pays(8192, 256)


@pytest.mark.parametrize("flags, expected", [([], None), (["--separate-rope"], True), (["--rope-in-gemm"], False)])
def test_the_rope_flags_choose_a_form_or_leave_it_to_the_size(flags, expected):
    from tinytransformer.cli import build_parser
    from version4_triton_ultra import tiny_llama_v4 as v4
    args, _ = build_parser(v4.SPEC).parse_known_args(flags)
    assert args.separate_rope is expected
    model = v4.build_model(v4.ModelConfig(vocab_size=64, hidden_dim=32, num_heads=2, num_layers=2,
                                          intermediate_size=48, max_seq_len=16), args)
    assert all(layer.attention.separate_rope is expected for layer in model.layers)


@pytest.mark.parametrize("flags", [["--separate-rope", "--rope-in-gemm"], ["--separate-rope", "--rope-in-attention"],
                                   ["--rope-in-gemm", "--rope-in-attention"]])
def test_two_rope_flags_are_one_line_and_exit_2(flags, capsys):
    from tinytransformer.cli import run as harness_run
    from version4_triton_ultra import tiny_llama_v4 as v4
    with pytest.raises(SystemExit) as exit_:
        harness_run(v4.SPEC, flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "not allowed with argument" in err[0], err


@pytest.mark.parametrize("threshold, separate", [(1, True), (2 ** 62, False)], ids=["above", "below"])
def test_the_attention_layer_without_a_flag_follows_the_size_rule(threshold, separate, monkeypatch, device):
    """The same layer, the same batch: which kernel rotates q and k follows the rule (its threshold moved to
    either side of the batch's size), and the header says which form ran."""
    from version4_triton_ultra import fused_layers
    from version4_triton_ultra import tiny_llama_v4 as v4
    from version3_triton.kernels.rope import rope_tables
    monkeypatch.setattr(fused_layers, "SEPARATE_ROPE_FROM_MULTIPLY_ADDS", threshold)
    calls = []
    monkeypatch.setattr(fused_layers, "rotate_qk_", lambda *a: calls.append("separate") or qk.rotate_qk_(*a))
    monkeypatch.setattr(fused_layers, "qkv_rope", lambda *a: calls.append("epilogue") or qr.qkv_rope(*a))
    layer = v4.Attention(v4.ModelConfig(vocab_size=64, hidden_dim=32, num_heads=2, num_layers=1,
                                        intermediate_size=48, max_seq_len=16)).to(device)
    assert layer.separate_rope is None
    cos, sin = rope_tables(16, 16, device=device)
    layer(torch.randn(2, 5, 32, device=device, requires_grad=True), cos, sin).sum().backward()
    assert calls == (["separate"] if separate else ["epilogue"])


def test_the_rope_form_by_size_needs_the_size():
    from version4_triton_ultra.fused_layers import rope_form_of
    assert rope_form_of(True, None) == "attention" and rope_form_of(False, True) == "separate"
    assert rope_form_of(False, False) == "gemm" and rope_form_of(False, None, 8192, 1024) == "separate"
    with pytest.raises(ValueError, match="needs rows and hidden_dim"):
        rope_form_of(False, None)


@pytest.mark.parametrize("preset, form", [("tiny", "in the QKV GEMM's epilogue (the faster form at this size)"),
                                          ("small", "a kernel of its own, after a vendor QKV GEMM (the faster form")])
def test_the_header_names_the_qkv_form_of_the_run(preset, form):
    from tinytransformer.cli import build_parser
    from version4_triton_ultra import tiny_llama_v4 as v4
    args, _ = build_parser(v4.SPEC).parse_known_args(["--preset", preset])
    assert v4.describe_rope(args).startswith(form)
    args, _ = build_parser(v4.SPEC).parse_known_args(["--preset", preset, "--rope-in-gemm"])
    assert v4.describe_rope(args) == "in the QKV GEMM's epilogue"


# ----------------------------------------------------------------------------------------------------------
# tune_qk_rotation.py: its candidates give the rule's output bit for bit, and bad flags are one line
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def rotation_tuner():
    """tune_qk_rotation, imported before a test switches the interpreter off (its import checks for a GPU)."""
    from version4_triton_ultra import tune_qk_rotation
    return tune_qk_rotation


@pytest.mark.parametrize("launch", [(1, 1, 1), (4, 2, 1), (8, 8, 2)], ids=["1 x 1", "4 x 2", "8 x 8, past the heads"])
def test_every_launch_of_the_rotation_gives_the_rules_output(launch, rotation_tuner, device):
    """Other tiles (a partial last row block, more heads a program than there are) change nothing, bit for bit:
    what the tuner's check relies on."""
    cos, sin = tables(8, 16, device)
    qkv = torch.randn(3 * 8, 3 * 48, device=device)
    want = qk.rotate_qk_(qkv.clone(), cos, sin, 8, 16)
    got = qk.rotate_qk_(qkv.clone(), cos, sin, 8, 16, launch=rotation_tuner.launch_of(launch))
    assert torch.equal(got, want)


def test_the_rotation_tuners_candidates_fit_the_shape(rotation_tuner):
    for rotated_heads, head_dim in ((32, 64), (32, 128), (16, 32)):
        candidates = rotation_tuner.default_candidates(rotated_heads, head_dim)
        assert candidates and len(set(candidates)) == len(candidates)
        for rows, heads, warps in candidates:
            assert heads <= rotated_heads and 1024 <= rows * heads * head_dim <= 8192 and warps in (2, 4, 8)
    assert rotation_tuner.candidate("16,4,8") == (16, 4, 8)
    with pytest.raises(ValueError, match="power of two"):
        rotation_tuner.candidate("16,3,8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--candidates", "4,4"], ["--candidates", "4,3,2"], ["--preset", "huge"],
                                   ["--preset", "tiny", "--candidates", "1,64,4"], ["--dtype", "float64"],
                                   ["--output-json", "/dev/null/x.json"]])
def test_the_rotation_tuner_needs_a_gpu_and_good_flags(flags):
    assert_refused_in_one_line("tune_qk_rotation.py", flags)
