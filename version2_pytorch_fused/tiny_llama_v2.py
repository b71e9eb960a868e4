"""Version 2: TinyLlama with PyTorch-level fusions. Same function as version 1, fewer and larger kernels.

What changed from version 1 (`diff ../version1_pytorch_baseline/tiny_llama_v1.py tiny_llama_v2.py`):
  1. QKV fusion: one [D -> 3D] projection instead of three [D -> D] ones: one GEMM reads x once.
  2. Flash attention: F.scaled_dot_product_attention(is_causal=True) picks a fused kernel (FlashAttention /
     memory-efficient / cuDNN on NVIDIA, CK or AOTriton flash kernels on AMD) that never stores the S x S matrix.
  3. SwiGLU fusion: one [D -> 2F] gate/up projection instead of two.
  4. PyTorch's own RMSNorm (F.rms_norm): one fused kernel where version 1 launches about six.
  5. RoPE for q and k together, without `cat`: rotate_half(x) * sin == roll(x, half) * signed_sin, so one roll,
     two multiplies and one add rotate both tensors (version 1: ten kernels, two of them copies).
  6. The fused AdamW (torch.optim.AdamW(fused=True)): one multi-tensor kernel per step for every parameter.
  7. Optional torch.compile of the model (--enable-torch-compile; --torch-compile-mode reduce-overhead replays the
     step's kernels from a CUDA/HIP graph) and of the optimizer step (--compile-optimizer).
  8. On a GPU, float32 matmuls on the TF32 tensor cores (--no-tf32 for exact float32), as torch.compile itself
     advises and as version 4 does: each input keeps 10 mantissa bits, the sums stay float32. Under --use-amp
     the matmuls are bfloat16 anyway and this changes nothing.
  9. Optional whole-step graph (--cuda-graph): forward, backward and the fused AdamW captured in ONE CUDA/HIP
     graph and replayed, so a small step no longer waits for Python to launch its kernels
     (tinytransformer/training/captured_step.py). With torch.compile, use its default mode: reduce-overhead
     records graphs of its own.
Each switch can be turned off; with all of them off (and --no-tf32 on a GPU) this file computes exactly version
1's model.

Run:   python tiny_llama_v2.py                              (all fusions on)
       python tiny_llama_v2.py --enable-torch-compile --torch-compile-mode reduce-overhead
       python tiny_llama_v2.py --enable-torch-compile --cuda-graph   (compiled kernels, the whole step one graph)
       python tiny_llama_v2.py --disable-all-fusion         (= version 1's computation)
       python fusion_ablation.py                            (each switch alone and left out, one table)
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import GRAPH_WARMUP_LIMIT, VersionSpec, graph_warmup_int, needs_switch, run  # noqa: E402
from tinytransformer.config import ConfigError, ModelConfig  # noqa: E402
from tinytransformer.precision import (  # noqa: E402
    add_tf32_arguments, apply_tf32_argument, describe_float32_matmuls)
from tinytransformer.profiling.ranges import profile_range  # noqa: E402
from tinytransformer.training import captured_step  # noqa: E402
from tinytransformer.weights import (GATE_UP_GROUP, QKV_GROUP, check_canonical, fuse,  # noqa: E402
                                     init_canonical_weights, split)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, with the statistics in float32 even under mixed precision.

    With use_torch_kernel, PyTorch's own F.rms_norm: one fused kernel on the GPU. Without it, version 1's chain of
    element-wise operations (cast, square, mean, add, rsqrt, two multiplies: a kernel each)."""

    def __init__(self, dim: int, eps: float, use_torch_kernel: bool = True):
        super().__init__()
        self.eps, self.use_torch_kernel = eps, use_torch_kernel
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with profile_range("rmsnorm"):
            if self.use_torch_kernel:
                # The residual stream is float32 even under autocast, so this is the same float32 arithmetic.
                return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
            x32 = x.float()
            variance = x32.pow(2).mean(-1, keepdim=True)
            return (self.weight * (x32 * torch.rsqrt(variance + self.eps))).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin and signed sin of the rotation angles, [seq_len, head_dim], for the rotate-half convention.

    Pair (i, i + head_dim/2) of each head vector is rotated by angle pos * theta^(-2i/head_dim). The signed sin
    is sin with its first half negated: rotate_half(x) * sin == roll(x, head_dim/2) * signed_sin, exactly.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)   # [S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [S, head_dim]
    sin = angles.sin()
    signed_sin = torch.cat([-sin[:, :head_dim // 2], sin[:, head_dim // 2:]], dim=-1)
    return angles.cos().float(), sin.float(), signed_sin.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(q, k, cos, sin):
    """Rotate query and key vectors by their position (RoPE); q, k: [B, H, S, head_dim]. Version 1's way."""
    with profile_range("rope"):
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rope_rolled(x, cos, signed_sin):
    """RoPE on any tensor whose last dimension is head_dim (cos and signed_sin broadcast against it): one roll,
    two multiplies, one add. The same products and sum as apply_rope, so the same bits."""
    with profile_range("rope"):
        rolled = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)   # [x2, x1]; times signed sin = [-x2, x1] * sin
        return x * cos.to(x.dtype) + rolled * signed_sin.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection and a fused attention kernel."""

    def __init__(self, config: ModelConfig, fuse_qkv: bool, flash_attention: bool, rolled_rope: bool):
        super().__init__()
        d = config.hidden_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.fuse_qkv, self.flash_attention, self.rolled_rope = fuse_qkv, flash_attention, rolled_rope
        if fuse_qkv:
            self.qkv_proj = nn.Linear(d, 3 * d, bias=False)   # rows: [q; k; v]
        else:
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def fused_projection(self, x):
        """One GEMM, viewed as [B, S, 3, H, Dh]: q, k and v side by side."""
        batch, seq, _ = x.shape
        return self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim)

    def project(self, x):
        batch, seq, _ = x.shape
        if self.fuse_qkv:
            # Views: [B, S, 3, H, Dh] -> three [B, H, S, Dh] tensors, no copies.
            return self.fused_projection(x).permute(2, 0, 3, 1, 4).unbind(0)
        split = lambda t: t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        return split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))

    def project_and_rotate(self, x, rope):
        """q, k (rotated) and v, each [B, H, S, Dh]."""
        cos, sin, signed_sin = rope
        if not self.rolled_rope:
            q, k, v = self.project(x)
            return (*apply_rope(q, k, cos, sin), v)
        if not self.fuse_qkv:
            q, k, v = self.project(x)   # [B, H, S, Dh]: the [S, Dh] tables broadcast as they are
            return apply_rope_rolled(q, cos, signed_sin), apply_rope_rolled(k, cos, signed_sin), v
        # q and k are neighbours in the fused projection's output: rotate both with one set of kernels.
        qkv = self.fused_projection(x)
        qk = apply_rope_rolled(qkv[:, :, :2], cos[:, None, None, :], signed_sin[:, None, None, :])
        q, k = qk.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, qkv[:, :, 2].transpose(1, 2)

    def forward(self, x, rope, causal_mask):
        batch, seq, dim = x.shape
        with profile_range("attention"):
            q, k, v = self.project_and_rotate(x, rope)
            if self.flash_attention:
                # A fused kernel: scores live in on-chip memory one tile at a time, never as [B, H, S, S].
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
                scores = scores.masked_fill(causal_mask, float("-inf"))
                probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
                out = torch.matmul(probs, v)
            out = out.transpose(1, 2).contiguous().view(batch, seq, dim)
            return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up computed by one GEMM when fused."""

    def __init__(self, config: ModelConfig, fuse_gate_up: bool):
        super().__init__()
        d, f = config.hidden_dim, config.intermediate_size
        self.fuse_gate_up = fuse_gate_up
        if fuse_gate_up:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)   # rows: [gate; up]
        else:
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        with profile_range("ffn"):
            if self.fuse_gate_up:
                gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + ffn(norm(.))."""

    def __init__(self, config: ModelConfig, fusions: "Fusions"):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, fusions.rms_norm)
        self.attention = Attention(config, fusions.qkv, fusions.flash_attention, fusions.rope)
        self.ffn_norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, fusions.rms_norm)
        self.feed_forward = FeedForward(config, fusions.swiglu)

    def forward(self, x, rope, causal_mask):
        x = x + self.attention(self.attention_norm(x), rope, causal_mask)
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class Fusions:
    """Version 2's switches, all on by default; all off is version 1's computation."""
    qkv: bool = True              # one [D -> 3D] GEMM
    flash_attention: bool = True  # F.scaled_dot_product_attention
    swiglu: bool = True           # one [D -> 2F] GEMM
    rms_norm: bool = True         # F.rms_norm
    rope: bool = True             # q and k rotated together, roll instead of cat
    fused_adamw: bool = True      # torch.optim.AdamW(fused=True)

    @classmethod
    def none(cls) -> "Fusions":
        return cls(**{name: False for name in cls.__dataclass_fields__})

    def weight_groups(self) -> dict:
        """The canonical matrices this configuration concatenates (see tinytransformer/weights.py)."""
        return {**(QKV_GROUP if self.qkv else {}), **(GATE_UP_GROUP if self.swiglu else {})}


class TinyLlama(nn.Module):
    def __init__(self, config: ModelConfig, fusions: Fusions = Fusions()):
        super().__init__()
        self.config, self.fusions = config, fusions
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_dim)
        self.layers = nn.ModuleList(TransformerBlock(config, fusions) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_dim, config.rms_norm_eps, fusions.rms_norm)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)
        cos, sin, signed_sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin, persistent=False)
        self.compile_optimizer = False      # set by build_model for --compile-optimizer
        self.capturable_optimizer = False   # set by build_model for --cuda-graph
        mask = torch.triu(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        self._init_weights()

    def _init_weights(self):
        self.load_canonical(init_canonical_weights(self.config, seed=0))

    def forward(self, input_ids, targets=None):
        seq = input_ids.shape[1]
        rope = self.rope_cos[:seq], self.rope_sin[:seq], self.rope_signed_sin[:seq]
        mask = self.causal_mask[:seq, :seq]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, rope, mask)
        x = self.norm(x)
        with profile_range("output_head"):
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            with profile_range("loss"):
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def configure_optimizer(self, train):
        """AdamW with version 1's settings. fused: one multi-tensor kernel for every parameter (CUDA, ROCm and the
        CPU have it); where the build lacks it, the multi-tensor (foreach) AdamW, said once. With
        --compile-optimizer the step is compiled (the learning rate then lives in a tensor, so a schedule
        changes it without recompiling). With --cuda-graph on a GPU the AdamW is `capturable`: its step counter
        stays on the device, where a replayed graph can advance it."""
        params = list(self.parameters())
        hyper = dict(betas=(0.9, 0.95), weight_decay=train.weight_decay)
        lr = train.learning_rate
        if self.compile_optimizer and train.uses_deepspeed:
            raise ConfigError("--compile-optimizer: under DeepSpeed the engine runs the optimizer step; drop one")
        if self.compile_optimizer:
            lr = torch.tensor(lr, dtype=torch.float32, device=params[0].device)
            optimizer = torch.optim.AdamW(params, lr=lr, **hyper)
            # Inductor writes its own fused kernels for the update: the compiled step replaces the eager one.
            optimizer.step = torch.compile(optimizer.step)
            return optimizer
        if self.capturable_optimizer and params[0].is_cuda:
            hyper["capturable"] = True
        if self.fusions.fused_adamw:
            try:
                return torch.optim.AdamW(params, lr=lr, fused=True, **hyper)
            except RuntimeError as why:   # this device has no fused AdamW in this build
                print(f"note: fused AdamW unavailable here ({str(why).splitlines()[0]}); using the foreach AdamW")
        return torch.optim.AdamW(params, lr=lr, **hyper)

    # Fused matrices are the canonical (version 1) ones concatenated along the output dimension.
    def load_canonical(self, state_dict):
        check_canonical(state_dict, self.config)
        fused = fuse(state_dict, self.fusions.weight_groups())
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(fused[name])

    def canonical_state_dict(self):
        return self.to_canonical({name: tensor.detach().clone() for name, tensor in self.state_dict().items()})

    def to_canonical(self, tensors: dict) -> dict:
        """Any per-parameter tensors of this model (weights, gradients) in the canonical layout."""
        return split(tensors, self.fusions.weight_groups())


# ----------------------------------------------------------------------------------------------------------
# Command line: the shared harness plus version 2's switches
# ----------------------------------------------------------------------------------------------------------
FUSION_NAMES = {"qkv": "qkv-fusion", "flash_attention": "flash-attention", "swiglu": "swiglu-fusion",
                "rms_norm": "torch-rmsnorm", "rope": "rolled-rope", "fused_adamw": "fused-adamw"}


def add_arguments(group):
    for field_name, flag in FUSION_NAMES.items():
        group.add_argument(f"--enable-{flag}", dest=field_name, action="store_true", default=None,
                           help=f"use {flag.replace('-', ' ')} (default: on)")
        group.add_argument(f"--disable-{flag}", dest=field_name, action="store_false",
                           help=f"do not use {flag.replace('-', ' ')}")
    group.add_argument("--enable-all-fusion", dest="all_fusion", action="store_true", default=None,
                       help="every switch above on (the default)")
    group.add_argument("--disable-all-fusion", dest="all_fusion", action="store_false",
                       help="all fusions off: version 1's computation (single switches still apply)")
    group.add_argument("--enable-torch-compile", action="store_true", default=False,
                       help="compile the model with torch.compile (first steps are slow: compilation)")
    group.add_argument("--torch-compile-mode", choices=["default", "reduce-overhead", "max-autotune"],
                       default="default", action=needs_switch("enable_torch_compile", "--enable-torch-compile"),
                       help="reduce-overhead replays CUDA/HIP graphs; max-autotune also "
                       "times several kernels per GEMM (minutes of compilation)")
    group.add_argument("--compile-optimizer", action="store_true", default=False,
                       help="compile the optimizer step with torch.compile (replaces the fused AdamW)")
    group.add_argument("--cuda-graph", action="store_true", default=False,
                       help="capture the whole training step (forward, backward, AdamW) in one CUDA/HIP graph and "
                            "replay it (GPU only; with torch.compile, its default mode)")
    group.add_argument("--graph-warmup-steps", type=graph_warmup_int, default=3,
                       help=f"eager steps before the capture (they make the optimizer state and compile the code); "
                            f"at most {GRAPH_WARMUP_LIMIT}")
    add_tf32_arguments(group)


def check_arguments(args, device):
    """One line for the combinations that cannot work, before anything is built."""
    if args.cuda_graph and args.enable_torch_compile and args.torch_compile_mode != "default":
        raise ConfigError(f"--cuda-graph captures the whole step in one graph, and torch.compile's "
                          f"{args.torch_compile_mode} mode records CUDA/HIP graphs of its own inside it: use "
                          f"--torch-compile-mode default with --cuda-graph")
    if args.cuda_graph and args.compile_optimizer:
        raise ConfigError("--cuda-graph captures the fused AdamW's step; drop --compile-optimizer")
    if args.graph_warmup_steps < 1:
        raise ConfigError("--graph-warmup-steps must be at least 1 (the optimizer state must exist before capture)")
    apply_tf32_argument(args, device)


def fusions_from_args(args) -> Fusions:
    """--enable/disable-all-fusion sets the baseline; a single switch given explicitly overrides it."""
    baseline = True if args.all_fusion is None else args.all_fusion
    pick = lambda value: baseline if value is None else value  # noqa: E731
    return Fusions(**{name: pick(getattr(args, name)) for name in FUSION_NAMES})


def build_model(config, args):
    model = TinyLlama(config, fusions_from_args(args))
    model.compile_optimizer = args.compile_optimizer
    model.capturable_optimizer = args.cuda_graph
    if args.enable_torch_compile:
        # Compiles forward (and, through AOTAutograd, backward) in place; the module keeps its methods.
        model.compile(mode=args.torch_compile_mode)
    return model


def describe(args) -> dict:
    fusions = fusions_from_args(args)
    on = [name for name, flag in FUSION_NAMES.items() if getattr(fusions, name)]
    compiled = f"torch.compile(mode={args.torch_compile_mode})" if args.enable_torch_compile else "eager"
    if args.compile_optimizer:
        compiled += ", compiled optimizer step"
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    if getattr(args, "cuda_graph", False):
        if not on_gpu:
            compiled += ", no graph (--cuda-graph needs a GPU)"
        elif captured_step.captures_step(args, torch.device("cuda")):
            compiled += ", the whole step replayed from one CUDA/HIP graph"
        else:
            compiled += ", no graph (float16 AMP's loss scaler decides on the host, which a graph cannot replay)"
    return {"fusions": ", ".join(on) if on else "none (version 1's computation)", "execution": compiled,
            "matmuls": describe_float32_matmuls(args, on_gpu)}


# The training step: the harness's eager one, or with --cuda-graph on a GPU the whole step captured in one graph.
SPEC = VersionSpec(name="v2", title="PyTorch fused", build_model=build_model, add_arguments=add_arguments,
                   check_arguments=check_arguments, describe=describe, make_step=captured_step.make_step)


def main(argv=None):
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
