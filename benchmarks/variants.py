"""What the benchmarks can run: every version, version 2 compiled, and the peers (Hugging Face's Llama, alone,
compiled, with Liger-Kernel), each as a training script plus the flags that make the variant.

A peer is a model people train instead of ours, from the same canonical weights and on the same data, trained by
the same harness (benchmarks/hf_llama.py), so its row is measured exactly like ours.
"""
from __future__ import annotations

COMPILE = ["--enable-torch-compile", "--torch-compile-mode", "reduce-overhead"]

# label -> (script key in training_runs.SCRIPTS, extra flags)
VARIANTS = {
    "v1": ("v1", []),
    "v2": ("v2", []),
    "v2+compile": ("v2", COMPILE),
    # torch.compile's kernels, and the whole step (forward, backward, AdamW) captured in one CUDA/HIP graph.
    "v2+compile+graph": ("v2", ["--enable-torch-compile", "--torch-compile-mode", "default", "--cuda-graph"]),
    "v3": ("v3", []),
    "v4": ("v4", []),
    "hf": ("hf", []),
    "hf+compile": ("hf", COMPILE),
    "hf+liger": ("hf", ["--liger"]),
    "hf+liger+compile": ("hf", ["--liger", *COMPILE]),
    # Offered, not run by default: autotuning each GEMM costs minutes of compilation before the first step.
    "v2+max-autotune": ("v2", ["--enable-torch-compile", "--torch-compile-mode", "max-autotune"]),
}
PEERS = ("hf", "hf+compile", "hf+liger", "hf+liger+compile")
NOT_BY_DEFAULT = ("v2+max-autotune",)


def default_variants(on_gpu: bool) -> list[str]:
    """Every variant but the opt-in ones; without a GPU also none that compiles (about a minute of compilation on
    a CPU) and no Liger-Kernel (its Triton kernels do not run in Triton's CPU interpreter)."""
    chosen = [v for v in VARIANTS if v not in NOT_BY_DEFAULT]
    if not on_gpu:
        chosen = [v for v in chosen if "compile" not in v and "liger" not in v]
    return chosen


def is_peer(label: str) -> bool:
    return label in PEERS
