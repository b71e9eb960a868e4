"""What a GPU kernel is, read from its name alone: its family (GEMM, attention, norm, ...), and the training
phase of a kernel replayed from a CUDA/HIP graph.

Families. Vendor libraries name their GEMMs differently (cuBLAS: gemm, sm90_xmma, nvjet, cutlass; hipBLASLt:
Cijk_...), PyTorch names its own kernels after what they do (vectorized_elementwise_kernel, reduce_kernel),
torch.compile's after the ops it fused (triton_poi_fused_..., triton_red_fused_...), and a Triton kernel carries
the name of its Python function (_flash_attention_forward_kernel). FAMILIES groups them the same way for all
four versions, so one table compares them (run_ultra_profiling.py) and every profiler report has it.

Phases of a graph replay. The phase split (profiling/attribution.py) charges a kernel to the record_function
range that was open when the kernel was LAUNCHED: "attention", "backward", "optimizer", ... A graph replay is
one launch (cudaGraphLaunch, hipGraphLaunch) for every kernel of the step, and the ranges were open only while
the graph was captured, not while it is replayed. Version 4 replays its whole step from outside any range, so
without more help all of its time would land in "other". For such a replay the kernels are charged by name and
order instead (replay_phases):
  1. a kernel named like an optimizer's (adam, sgd, lamb) is "optimizer" wherever it runs (version 4 updates
     part of the model during the backward pass);
  2. a step runs its forward pass, then its backward pass: from the first kernel whose name says backward
     (backward, bwd, dkdv, ...), every other kernel is "backward";
  3. before it, a kernel is the model part its name says (attention, ffn, rmsnorm, rope, loss), else
     "forward_other".
What the names cannot tell: a vendor GEMM (cuBLAS, hipBLASLt) says nothing of the layer that runs it, so in a
replay the forward pass's vendor GEMMs (version 4's attention output and down projections, its output head)
count as "forward_other", where the eager split (--no-cuda-graph) charges them to attention, ffn and loss; the
family table (GEMM time whatever the phase) and the eager split fill that gap. And rule 2 is approximate at the
boundary: backward work before the first backward-named kernel (the output head's gradient GEMMs that version 4
runs with its loss) counts as forward. Graphs launched INSIDE a range (torch.compile's "reduce-overhead" replays
one graph for the forward pass inside "forward" and one for the backward pass inside "backward") keep that
range's phase: only replays outside every range are split here.
"""
from __future__ import annotations

import functools
import re

# Name patterns that are both a family and a model part of a replay's forward pass (written once for both).
LOSS = r"cross_entropy|log_softmax|logsoftmax|nll_loss|mean_loss|inverse_count"
RMSNORM = r"rms_norm|rmsnorm"
ROPE = r"rope|rotate"
SWIGLU = r"swiglu|silu"
# The loss's kernels of both passes: LOSS and version 4's _scale_pair_kernel, the loss's backward (a family, but a
# backward kernel, so not a forward model part).
LOSS_FAMILY = LOSS + r"|_scale_pair"

# (family, pattern), matched in order against the lower-cased kernel name; the first match wins. The order
# matters: names are whole demangled signatures, so PyTorch's flash attention kernels mention cutlass (attention
# before gemm) and its log-softmax kernels mention softmax (cross_entropy before attention). torch.compile's
# names list the ops they fused: "_to_copy" (an autocast cast) is left out before matching, since nearly every
# fused kernel has one, and "triton_tem_" is a GEMM template.
FAMILIES = (
    ("cross_entropy", LOSS_FAMILY),
    # cuDNN's fused attention names its main kernels ..._sdpa_...; its backward pass adds two helpers, the row
    # sums of dO * O (compute_dot_do_o) and dq's rounding from float32 (convert_dq_to_16bits)
    ("attention", r"flash|attention|fmha|sdpa|attn_fwd|bwd_kernel_d|softmax|dot_do_o|convert_dq"),
    ("gemm", r"gemm|gemv|xmma|nvjet|cutlass|cijk_|matmul|splitk|dot_kernel|triton_tem_"),
    ("rmsnorm", RMSNORM + r"|rsqrt"),
    ("rope", ROPE),
    ("swiglu", SWIGLU),
    ("communication", r"nccl|rccl|allreduce|all_reduce"),
    ("embedding", r"embedding"),
    ("optimizer", r"adam|sgd|lamb"),
    ("copy / layout", r"copy|transpose|(?<![a-z])cat|memcpy|memset|fill|index"),
    ("optimizer", r"multi_tensor|foreach"),   # the other multi-tensor kernels of a step: mostly the optimizer's
    ("reduction", r"reduce|triton_red_|triton_per_"),
    ("element-wise", r"elementwise|vectorized|unrolled|triton_"),
)
OTHER_FAMILY = "other"
# Every family once, in table order (a family may have several patterns above), "other" last.
FAMILY_NAMES = tuple(dict.fromkeys(family for family, _ in FAMILIES)) + (OTHER_FAMILY,)

# The host calls that replay a captured graph (CUDA runtime and driver, HIP).
GRAPH_LAUNCH = re.compile(r"graphlaunch", re.IGNORECASE)
# A kernel of the backward pass says so in its name: our Triton kernels (_add_rms_norm_backward_kernel,
# _flash_attention_backward_dkdv_kernel; _scale_pair_kernel, the first kernel of version 4's backward pass,
# which scales the gradients its fused loss computed in the forward pass), PyTorch's (..._backward_kernel,
# flash_bwd, fmha_cutlassB).
BACKWARD = re.compile(r"backward|bwd|bprop|dkdv|fmha_cutlassb|_scale_pair|dot_do_o|convert_dq", re.IGNORECASE)
# Optimizer kernels by name: torch's fused AdamW (FusedAdamMathFunctor), version 4's _adamw_kernel. (Not every
# multi-tensor kernel: version 4's 16-bit weight copies are one too, in the forward pass.)
OPTIMIZER = re.compile(r"adam|sgd|lamb", re.IGNORECASE)
# The model part a forward kernel's name tells (the phase split's model parts), in order; first match wins.
FORWARD_PARTS = (
    ("loss", LOSS),
    ("attention", r"flash|attention|fmha|sdpa|qkv"),   # qkv: the QKV GEMM with RoPE in its epilogue
    ("ffn", SWIGLU + r"|gate_up"),
    ("rmsnorm", RMSNORM),
    ("rope", ROPE),
)


@functools.lru_cache(maxsize=None)
def family_of(kernel_name: str) -> str:
    """The family of a kernel (FAMILIES); "other" when no pattern matches. Cached: a trace holds the same few
    hundred names many thousand times."""
    name = kernel_name.lower().replace("_to_copy", "")
    for family, pattern in FAMILIES:
        if re.search(pattern, name):
            return family
    return OTHER_FAMILY


def is_graph_launch(call_name: str) -> bool:
    """True for the host call that replays a CUDA/HIP graph (cudaGraphLaunch, cuGraphLaunch, hipGraphLaunch)."""
    return bool(GRAPH_LAUNCH.search(call_name))


def forward_part_of(kernel_name: str) -> str:
    """The model part of a forward kernel by its name, else "forward_other"."""
    for part, pattern in FORWARD_PARTS:
        if re.search(pattern, kernel_name, flags=re.IGNORECASE):
            return part
    return "forward_other"


def replay_phases(kernel_names: list[str]) -> list[str]:
    """The phase of each kernel of ONE graph replay, given in the order the device started them (rules in the
    module docstring)."""
    phases, in_backward = [], False
    for name in kernel_names:
        if OPTIMIZER.search(name):
            phases.append("optimizer")
            continue
        in_backward = in_backward or bool(BACKWARD.search(name))
        phases.append("backward" if in_backward else forward_part_of(name))
    return phases
