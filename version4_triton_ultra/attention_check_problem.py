"""The attention problem that tune_attention_tiles.py times and checks: a packed qkv as version 4's QKV GEMM hands
it to the attention kernels (q and k already rotated by RoPE), the forward and backward passes of version 4's
kernels on it, and the same attention computed in float64 by PyTorch for the check.

The backward pass returns the gradient of q and k rotated back by RoPE (the gradient of the UNrotated q and k, as
the model's backward needs), so the reference undoes the rotation first and differentiates through it.
"""
import math

import torch

from version1_pytorch_baseline.tiny_llama_v1 import rotate_half
from version3_triton.kernels.rope import rope_tables
from version4_triton_ultra.kernels import flash_attention as fa


def rotate(x, cos, sin):
    """x rotated by RoPE's angles (cos, sin as rope_tables gives them; -sin rotates back), in x's dtype."""
    return x * cos + rotate_half(x) * sin


class Problem:
    """A packed qkv [B, S, 3D] whose q and k are already rotated (as version 4's QKV GEMM hands them over)."""

    def __init__(self, batch, heads, seq_len, head_dim, dtype, device="cuda"):
        self.heads, self.dim = heads, heads * head_dim
        self.qkv = torch.randn(batch, seq_len, 3 * self.dim, device=device).to(dtype)
        self.grad_out = torch.randn(batch, seq_len, self.dim, device=device).to(dtype)
        self.cos, self.sin = rope_tables(seq_len, head_dim, device=device)

    def forward(self):
        return fa.packed_attention_forward(self.qkv, self.heads)

    def backward(self, out, lse):
        return fa.packed_attention_backward(self.qkv, out, lse, self.grad_out, self.heads, rope=(self.cos, self.sin))

    def reference(self):
        """out, and the gradient of the UNrotated q, k and v, in float64."""
        batch, seq_len, _ = self.qkv.shape
        head_dim = self.dim // self.heads
        rotated = self.qkv.double()
        heads = lambda t: t.view(batch, seq_len, self.heads, head_dim).transpose(1, 2)  # noqa: E731
        cos, sin = self.cos.double(), self.sin.double()
        # Undo the rotation to get the inputs whose gradient the backward pass returns.
        q0 = rotate(heads(rotated[..., :self.dim]), cos, -sin).detach().requires_grad_()
        k0 = rotate(heads(rotated[..., self.dim:2 * self.dim]), cos, -sin).detach().requires_grad_()
        v = heads(rotated[..., 2 * self.dim:]).detach().requires_grad_()
        scores = rotate(q0, cos, sin) @ rotate(k0, cos, sin).transpose(-1, -2) / math.sqrt(head_dim)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=self.qkv.device).triu(1)
        out = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(batch, seq_len, -1)
        out.backward(self.grad_out.double())
        grads = [g.transpose(1, 2).reshape(batch, seq_len, -1) for g in (q0.grad, k0.grad, v.grad)]
        return out.detach(), grads
