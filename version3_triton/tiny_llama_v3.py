"""Version 3: TinyLlama with custom Triton kernels for the memory-bound work; GEMMs stay on the vendor BLAS.

What changed from version 2 (`diff ../version2_pytorch_fused/tiny_llama_v2.py tiny_llama_v3.py`):
  - RMSNorm: one Triton kernel per direction (PyTorch runs ~6 element-wise kernels) -> kernels/rmsnorm.py
  - RoPE: q and k rotated in one kernel, backward is the inverse rotation         -> kernels/rope.py
  - Attention: our own causal flash attention (online softmax, no S x S matrix)    -> kernels/flash_attention.py
    Both read the fused QKV output [B, S, 3D] as it is: no permute copies to [B, H, S, Dh] and back.
  - SwiGLU: silu(gate) * up read straight from the fused gate/up GEMM output      -> kernels/swiglu.py
  - Every kernel sits behind a torch.autograd.Function with a Triton backward: a kernel called outside one
    would silently cut the autograd graph (the parameters before it would never learn).
The matrix multiplies (QKV, output, gate/up, down, LM head) stay on cuBLAS / hipBLASLt: a hand-written Triton
GEMM rarely beats them, while fusing memory-bound element-wise work is where Triton wins.

Without a GPU the kernels run in Triton's CPU interpreter (slow, but the same code): that is how laptops and CI
test them.

Run:   python tiny_llama_v3.py
       python run_triton_profiling.py          (each kernel against its PyTorch equivalent)
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.triton_support import enable_interpreter_if_no_gpu, interpreter_active  # noqa: E402

enable_interpreter_if_no_gpu()  # must precede the first `import triton` (inside the kernel modules)

from tinytransformer.cli import VersionSpec, build_parser, resolve_configs, run  # noqa: E402
from tinytransformer.config import ConfigError, ModelConfig, head_dim_advice  # noqa: E402
from tinytransformer.profiling.ranges import profile_range  # noqa: E402
from tinytransformer.weights import (GATE_UP_GROUP, QKV_GROUP, check_canonical, fuse,  # noqa: E402
                                     init_canonical_weights, split)
from version3_triton.kernels import flash_attention as attention_kernels  # noqa: E402
from version3_triton.kernels import rmsnorm as rmsnorm_kernels  # noqa: E402
from version3_triton.kernels.flash_attention import flash_attention_packed  # noqa: E402
from version3_triton.kernels.rmsnorm import rms_norm  # noqa: E402
from version3_triton.kernels.rope import apply_rope_packed, rope_tables  # noqa: E402
from version3_triton.kernels.swiglu import swiglu_fused  # noqa: E402


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight in one Triton kernel (float32 statistics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profile_range("rmsnorm"):
            return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Fused QKV GEMM -> Triton RoPE -> Triton flash attention -> output GEMM, all on the packed [B, S, 3D]."""

    exact_float32 = False   # True: float32 dot products in IEEE float32 instead of TF32 (tests, debugging)

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden_dim
        self.num_heads = config.num_heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)   # rows: [q; k; v]
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        with profile_range("attention"):
            qkv = self.qkv_proj(x)                                    # [B, S, 3D]: per token q, k, v heads
            with profile_range("rope"):
                qkv = apply_rope_packed(qkv, self.num_heads, cos, sin)   # q and k rotated in one kernel
            # Reads q, k, v straight out of qkv and writes [B, S, D]: no [B, H, S, S], and no layout copies
            # (a permute to [B, H, S, Dh] and back would cost a copy of each tensor, forward and backward).
            out = flash_attention_packed(qkv, self.num_heads, causal=True, precise_fp32=self.exact_float32)
            return self.o_proj(out)


class FeedForward(nn.Module):
    """One gate/up GEMM -> Triton SwiGLU on its output halves -> down GEMM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_dim, config.intermediate_size
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)   # rows: [gate; up]
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        with profile_range("ffn"):
            return self.down_proj(swiglu_fused(self.gate_up_proj(x)))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + ffn(norm(.))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


WEIGHT_GROUPS = {**QKV_GROUP, **GATE_UP_GROUP}


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_dim, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.load_canonical(init_canonical_weights(config, seed=0))

    def forward(self, input_ids, targets=None):
        seq = input_ids.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        with profile_range("output_head"):
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            with profile_range("loss"):
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def use_exact_float32(self, exact: bool = True):
        """Float32 attention dot products in IEEE float32 rather than TF32 (equivalence tests use this)."""
        for layer in self.layers:
            layer.attention.exact_float32 = exact

    # Fused matrices are the canonical (version 1) ones concatenated along the output dimension.
    def load_canonical(self, state_dict):
        check_canonical(state_dict, self.config)
        fused = fuse(state_dict, WEIGHT_GROUPS)
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(fused[name])

    def canonical_state_dict(self):
        return self.to_canonical({name: tensor.detach().clone() for name, tensor in self.state_dict().items()})

    def to_canonical(self, tensors: dict) -> dict:
        """Any per-parameter tensors of this model (weights, gradients) in the canonical layout."""
        return split(tensors, WEIGHT_GROUPS)


# ----------------------------------------------------------------------------------------------------------
# Command line: the shared harness, with the checks Triton needs
# ----------------------------------------------------------------------------------------------------------
def shape_problem(config: ModelConfig, batch_size: int, seq_len: int, gemm_dtype: torch.dtype = torch.float32
                  ) -> str | None:
    """Why version 3's kernels cannot train this model on batches of batch_size x seq_len tokens (one line that
    names the sizes to change), or None when they can. Each rule is asked of the kernel module that enforces it
    (flash attention: head dims, 32-bit offsets, grid; RMSNorm: row width), so that a bad size is reported
    before anything is built instead of as a traceback from inside the first kernel launch. (gemm_dtype, the
    GEMMs' autocast dtype, matters to version 4's own GEMMs; version 3's are the vendor BLAS's.)"""
    problem = attention_kernels.shape_problem(batch_size * config.num_heads, seq_len, config.head_dim,
                                              3 * config.hidden_dim)
    if problem:
        context = (head_dim_advice(config, attention_kernels.SUPPORTED_HEAD_DIMS)
                   if "head dim" in problem else f"batch {batch_size} x {config.num_heads} heads, seq_len {seq_len}, "
                                                 f"hidden_dim {config.hidden_dim}")
        return f"version 3's Triton flash attention: {problem} ({context})"
    problem = rmsnorm_kernels.shape_problem(config.hidden_dim)
    if problem:
        return f"version 3's Triton RMSNorm: {problem} (--hidden-dim)"
    return None


def shape_problem_of_args(args) -> str | None:
    """shape_problem for the model and batch that this version's parsed command-line arguments describe (flags,
    --config and --preset resolved as the harness resolves them)."""
    config, train = resolve_configs(args)
    return shape_problem(config, train.batch_size, train.seq_len)


def shape_problem_of_flags(flags: list[str]) -> str | None:
    """shape_problem for training flags meant for this script: for a script that starts it with them
    (run_ultra_profiling.py, compare_versions.py), so that a bad size stops that script before its first run.
    Flags of other versions are ignored; a flag this version refuses is a ConfigError."""
    args, _ = build_parser(SPEC).parse_known_args(flags)
    return shape_problem_of_args(args)


def check_arguments(args, device):
    problem = shape_problem_of_args(args)   # first: a shape this version cannot run is wrong on any device
    if problem:
        raise ConfigError(problem)
    if device.type == "cpu" and not interpreter_active():
        raise ConfigError("version 3's Triton kernels were compiled for the GPU; for a CPU run start with "
                          "TRITON_INTERPRET=1 (Triton's interpreter) or omit --device cpu")
    if device.type == "cpu" and args.use_amp:
        raise ConfigError("--use-amp with Triton's CPU interpreter is not supported: the interpreter computes "
                          "bfloat16 dot products wrongly; run float32 on the CPU or use a GPU")


def describe(args) -> dict:
    mode = ("in Triton's CPU interpreter: correct but slow" if interpreter_active()
            else "compiled for the GPU")
    return {"kernels": f"Triton RMSNorm, RoPE, flash attention, SwiGLU ({mode}); GEMMs on the vendor BLAS"}


def build_model(config, args):
    return TinyLlama(config)


# The performance-debugging exercise (exercises/performance_debugging/) builds on this file: its run_stage.py is
# this SPEC with a --stage flag and the defects of its stages.py; nothing here imports it.
SPEC = VersionSpec(name="v3", title="Triton kernels", build_model=build_model, check_arguments=check_arguments,
                   describe=describe)


def main(argv=None):
    # Without a GPU the header says that the kernels run in Triton's CPU interpreter (describe); nothing is
    # printed before the arguments are checked, so that bad input is one line.
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
