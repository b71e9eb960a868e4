"""Version 4's fused Triton ops one at a time against the PyTorch code they replace: forward and backward
time, speed-up and the Triton op's achieved bandwidth.

    python run_kernel_benchmarks.py                    (the seed config: batch 8, seq 128, hidden 256, ...)
    python run_kernel_benchmarks.py --check --output-json kernels_v4.json
    python run_kernel_benchmarks.py --dtype bfloat16 --batch-size 64 --seq-len 1024 --vocab-size 32000

Ops: add_rmsnorm (residual add + RMSNorm in one kernel, against the add and RMSNorm in PyTorch),
linear_cross_entropy (output head + cross-entropy in chunks, against the lm_head matmul + F.cross_entropy in
float32), embedding (the token lookup whose backward is one scatter-add kernel, against F.embedding) and
embedding_rmsnorm (the lookup and the model's first RMSNorm in one kernel each way, against F.embedding and
the RMSNorm in PyTorch).
Version 3's kernels (rmsnorm, rope, swiglu, flash_attention) are in version3_triton/run_triton_profiling.py.
Without a GPU there is nothing to time: `--check` then verifies the ops in Triton's CPU interpreter at a small
size.

This file only describes the ops; how they are checked, timed and reported (and why that way) is in
tinytransformer/kernel_bench/, shared with version 3.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # without a GPU: Triton's interpreter, chosen before the kernels import triton

from tinytransformer.kernel_bench import ops as kb  # noqa: E402
from tinytransformer.kernel_bench.cli import main as benchmark_main  # noqa: E402
from version4_triton_ultra.kernels import add_rmsnorm as norm_kernels  # noqa: E402
from version4_triton_ultra.kernels.add_rmsnorm import add_rms_norm, embedding_rms_norm  # noqa: E402
from version4_triton_ultra.kernels.embedding_backward import embedding_lookup  # noqa: E402
from version4_triton_ultra.kernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402

EPS = 1e-6   # the model's RMSNorm epsilon


def row_fits_in_registers(s):
    """The norm kernels hold a whole row in registers: None if the hidden size allows it, else why not."""
    return norm_kernels.shape_problem(s.D)


# ----------------------------------------------------------------------------------------------------------
# add_rmsnorm: residual, delta [N, D], weight [D] -> (h = residual + delta, normed = RMSNorm(h) * weight)
# ----------------------------------------------------------------------------------------------------------
def add_rmsnorm_inputs(s, device):
    return kb.InputSet([kb.random_tensor((s.N, s.D), s.dtype, device),
                        kb.random_tensor((s.N, s.D), s.dtype, device),
                        kb.random_norm_weight(s.D, s.dtype, device)])


def torch_add_rmsnorm(residual, delta, weight):
    h = residual + delta
    return h, kb.torch_rms_norm(h, weight, EPS)


ADD_RMSNORM = kb.OpBench(
    name="add_rmsnorm",
    make_inputs=add_rmsnorm_inputs,
    triton=lambda residual, delta, weight: add_rms_norm(residual, delta, weight, EPS),
    pytorch={"torch (add + v1 RMSNorm)": torch_add_rmsnorm},
    output_names=("h", "normed"), input_names=("residual", "delta", "weight"),
    # Byte model. Forward: read residual, delta and weight; write h, normed and the float32 rstd per row.
    # Backward: read h, the gradients of h and of normed, weight and rstd; write grad_h (one tensor: the
    # gradient of residual and of delta alike) and grad_weight.
    byte_model={
        "fwd": ("4*N*D*e + D*e + 4*N (read residual, delta, weight; write h, normed, rstd)",
                lambda s: 4 * s.N * s.D * s.e + s.D * s.e + 4 * s.N),
        "bwd": ("4*N*D*e + 2*D*e + 4*N (read h, dh, dnormed, weight, rstd; write grad_h, grad_weight)",
                lambda s: 4 * s.N * s.D * s.e + 2 * s.D * s.e + 4 * s.N),
    },
    validate=row_fits_in_registers,
)


# ----------------------------------------------------------------------------------------------------------
# linear_cross_entropy: hidden [N, D], lm_head weight [V, D], targets [N] -> mean loss (float32 scalar)
# ----------------------------------------------------------------------------------------------------------
def linear_cross_entropy_inputs(s, device):
    hidden = kb.random_tensor((s.N, s.D), s.dtype, device)
    weight = kb.random_tensor((s.V, s.D), s.dtype, device, scale=s.D ** -0.5)   # logits of about unit size
    targets = torch.randint(0, s.V, (s.N,), device=device)
    return kb.InputSet([hidden, weight], [targets])


def torch_linear_cross_entropy(hidden, weight, targets):
    """The model's lm_head and loss: [N, V] logits in the input dtype, cross-entropy in float32."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.to(kb.statistics_dtype(logits.dtype)), targets)


LINEAR_CROSS_ENTROPY = kb.OpBench(
    name="linear_cross_entropy",
    make_inputs=linear_cross_entropy_inputs,
    triton=linear_cross_entropy,
    pytorch={"matmul + F.cross_entropy": torch_linear_cross_entropy},
    output_names=("loss",), input_names=("hidden", "weight"),
    # Byte model. The Triton op computes both gradients during its forward pass, so its forward writes them
    # (grad_weight as a float32 sum over chunks) and its backward only scales them by the incoming gradient.
    # The whole op (fwd+bwd) must read hidden, weight and targets and write the loss and both gradients; the
    # [N, V] logits need never reach memory, so they are not counted.
    byte_model={
        "fwd": ("2*N*D*e + V*D*e + 4*V*D + 8*N + 4 (read hidden, weight, targets; write grad_hidden, "
                "float32 grad_weight, loss)",
                lambda s: 2 * s.N * s.D * s.e + s.V * s.D * s.e + 4 * s.V * s.D + 8 * s.N + 4),
        "bwd": ("2*N*D*e + 4*V*D + V*D*e (read grad_hidden, float32 grad_weight; write both scaled)",
                lambda s: 2 * s.N * s.D * s.e + 4 * s.V * s.D + s.V * s.D * s.e),
        "fwd+bwd": ("2*N*D*e + 2*V*D*e + 8*N + 4 (read hidden, weight, targets; write loss, grad_hidden, "
                    "grad_weight)",
                    lambda s: 2 * s.N * s.D * s.e + 2 * s.V * s.D * s.e + 8 * s.N + 4),
    },
    note="the Triton op computes its gradients inside the forward (so its fwd is slower and its bwd almost "
         "free): compare the fwd+bwd row. It is matmul-bound (6*N*V*D FLOPs in all), so its GB/s says little; "
         "its gain is memory: no [N, V] float32 logits.",
)

# ----------------------------------------------------------------------------------------------------------
# embedding: weight [V, D], token ids [N] -> the N rows weight[ids]; its backward is a scatter-add
# ----------------------------------------------------------------------------------------------------------
def embedding_inputs(s, device):
    # float32 whatever --dtype says: the model keeps its embedding (and so the residual stream) in float32 under
    # autocast, and atomic additions are done in float32.
    weight = kb.random_tensor((s.V, s.D), torch.float32, device)
    ids = torch.randint(0, s.V, (s.N,), device=device)
    return kb.InputSet([weight], [ids])


EMBEDDING = kb.OpBench(
    name="embedding",
    make_inputs=embedding_inputs,
    triton=lambda weight, ids: embedding_lookup(ids, weight),
    pytorch={"F.embedding (sorting backward)": lambda weight, ids: F.embedding(ids, weight)},
    output_names=("rows",), input_names=("weight",),
    # Byte model (float32: 4 bytes per element whatever --dtype says). Forward: read the ids and N rows of the
    # weight, write the N rows. Backward: read the gradient rows and the ids, zero grad_weight and add into it.
    byte_model={
        "fwd": ("8*N*D + 8*N (read ids, N weight rows; write N rows)", lambda s: 8 * s.N * s.D + 8 * s.N),
        "bwd": ("4*N*D + 8*N + 8*V*D (read grad rows, ids; write zeros to grad_weight, then add into it)",
                lambda s: 4 * s.N * s.D + 8 * s.N + 8 * s.V * s.D),
    },
    note="the Triton op's forward is PyTorch's own row gather; only its backward is a Triton kernel (atomic "
         "adds: the summation order, and so the last bits of float32, may change from run to run).",
)


# ----------------------------------------------------------------------------------------------------------
# embedding_rmsnorm: table [V, D], norm weight [D], token ids [N] -> (h = table[ids], normed = RMSNorm(h) * weight)
# ----------------------------------------------------------------------------------------------------------
def embedding_rmsnorm_inputs(s, device):
    # float32 whatever --dtype says, as for embedding: the model's table and its first residual stream.
    table = kb.random_tensor((s.V, s.D), torch.float32, device)
    ids = torch.randint(0, s.V, (s.N,), device=device)
    return kb.InputSet([table, kb.random_norm_weight(s.D, torch.float32, device)], [ids])


def torch_embedding_rmsnorm(table, weight, ids):
    h = F.embedding(ids, table)
    return h, kb.torch_rms_norm(h, weight, EPS)


EMBEDDING_RMSNORM = kb.OpBench(
    name="embedding_rmsnorm",
    make_inputs=embedding_rmsnorm_inputs,
    triton=lambda table, weight, ids: embedding_rms_norm(ids, table, weight, EPS),
    pytorch={"F.embedding + v1 RMSNorm": torch_embedding_rmsnorm},
    output_names=("h", "normed"), input_names=("table", "weight"),
    # Byte model (float32). Forward: read the ids and N table rows; write h, normed and rstd. Backward: read the
    # ids, the N table rows again, the gradients of h and of normed, and rstd; write zeros to the table's
    # gradient, then add into it (and the D-element weight gradient, left out).
    byte_model={
        "fwd": ("12*N*D + 12*N (read ids, N table rows; write h, normed, rstd)",
                lambda s: 12 * s.N * s.D + 12 * s.N),
        "bwd": ("12*N*D + 12*N + 8*V*D (read ids, table rows, dh, dnormed, rstd; write zeros to grad_table, "
                "then add into it)",
                lambda s: 12 * s.N * s.D + 12 * s.N + 8 * s.V * s.D),
    },
    validate=row_fits_in_registers,
    note="the table's gradient comes from atomic adds: the summation order, and so the last bits of float32, "
         "may change from run to run.",
)

OPS = [ADD_RMSNORM, LINEAR_CROSS_ENTROPY, EMBEDDING, EMBEDDING_RMSNORM]


def main(argv=None) -> int:
    description = ("Version 4's fused Triton ops against the PyTorch code they replace: forward and backward "
                   "median times, speed-up and achieved GB/s (see tinytransformer/kernel_bench/ for the method).")
    return benchmark_main(OPS, prog="run_kernel_benchmarks.py", description=description, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
