"""Version 4's attention kernels against PyTorch's attention backends at one preset's shape, forward and backward.

    python compare_attention_backends.py --preset medium
    python compare_attention_backends.py --preset large --output-json runs/attention_backends_large.json

Is our FlashAttention-2-style kernel the fastest attention a user of this GPU has? The rows, all causal, all
reading q, k and v from the packed QKV layout [B, S, 3 * D] that version 4's QKV GEMM writes and writing the
output as [B, S, D]:
    version 4 (Triton)      packed_attention_forward / _backward (kernels/flash_attention.py); its backward also
                            rotates dq and dk back by RoPE as it stores them, as version 4's step needs
    sdpa: flash / cudnn /   torch.nn.functional.scaled_dot_product_attention under one backend
      efficient             (FlashAttention-2 is PyTorch's default where it runs; cuDNN's fused attention is
                            NVIDIA's own, written for Hopper; the memory-efficient one runs almost anywhere);
                            their backward has no RoPE to undo
    cudnn forward +         cuDNN's forward, whose log-sum-exp our backward reads as it is (both natural-log,
      version 4 backward    one float32 number per row), then our backward
A backend this GPU or this torch build cannot run is listed as unavailable, with the reason.

How it times: each row's forward, and its forward + backward, as a CUDA/HIP graph of 10 calls, replayed in 7
interleaved rounds (median; tinytransformer/kernel_bench/graph_timing.py). TFLOP/s counts the causal half of
the two matmuls of the forward (4 * B * H * S^2 * Dh / 2) and 2.5 times that for the backward. The sdpa rows'
forward + backward include what autograd adds around the kernels (gathering dq, dk and dv into the packed gradient).
Each row is checked before it is timed, against float64 attention of the same q, k and v (PyTorch's math
backend and autograd): its output, dq, dk and dv, each within the dtype's tolerance of the kernel tests (relative
error of the whole tensor). Our backward returns dq and dk rotated back by RoPE; the check turns them forward
again before comparing (the rotation is orthogonal: nothing is lost). Needs a GPU.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line  # noqa: E402
from tinytransformer.config import ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from tinytransformer.device import software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.correctness import relative_error  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms, time_interleaved  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import (prove_output_json, refuse_without_gpu,  # noqa: E402
                                                  why_unavailable)
from version3_triton.kernels.rope import rope_tables  # noqa: E402
from version4_triton_ultra.kernels.flash_attention import (packed_attention_backward,  # noqa: E402
                                                           packed_attention_forward)
from version4_triton_ultra.attention_check_problem import rotate  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative error of out and of the gradient, as the kernel tests allow (float32, which the tests use, through TF32).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}
CALLS_PER_GRAPH = 10
ROUNDS = 7


def parse_args(argv):
    parser = OneLineParser(prog="compare_attention_backends.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=available_presets(), default="medium",
                        help="the batch, heads, sequence and head dim of configs/PRESET.yaml [medium]")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="q, k and v's dtype [bfloat16]")
    parser.add_argument("--output-json", help="also write the table, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    model, train = preset_settings(args.preset)
    config = ModelConfig(**model)
    args.batch, args.seq_len = train["batch_size"], train["seq_len"]
    args.heads, args.head_dim = config.num_heads, config.head_dim
    refuse_without_gpu(parser)
    return args


class Shape:
    """The packed qkv, the incoming gradient and the RoPE tables of one preset's attention."""

    def __init__(self, args, dtype, device="cuda"):
        self.batch, self.heads, self.seq_len, self.head_dim = args.batch, args.heads, args.seq_len, args.head_dim
        self.dim = self.heads * self.head_dim
        self.qkv = torch.randn(self.batch, self.seq_len, 3 * self.dim, device=device).to(dtype)
        self.grad_out = torch.randn(self.batch, self.seq_len, self.dim, device=device).to(dtype)
        self.rope = rope_tables(self.seq_len, self.head_dim, device=device)

    def views(self, qkv):
        """q, k, v as [B, H, S, Dh] views of the packed layout (no copies)."""
        q, k, v = qkv.view(self.batch, self.seq_len, 3, self.heads, self.head_dim).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def packed(self, out):
        """[B, H, S, Dh] -> [B, S, D]."""
        return out.transpose(1, 2).reshape(self.batch, self.seq_len, self.dim)


def ours(shape):
    def forward():
        return packed_attention_forward(shape.qkv, shape.heads)[0]

    def forward_backward():
        out, lse = packed_attention_forward(shape.qkv, shape.heads)
        return packed_attention_backward(shape.qkv, out, lse, shape.grad_out, shape.heads, rope=shape.rope)
    return forward, forward_backward


def sdpa(shape, backend):
    from torch.nn.attention import sdpa_kernel
    leaf = shape.qkv.detach().clone().requires_grad_(True)

    def forward():
        with sdpa_kernel(backend):
            return shape.packed(torch.nn.functional.scaled_dot_product_attention(*shape.views(shape.qkv),
                                                                                 is_causal=True))

    def forward_backward():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*shape.views(leaf), is_causal=True)
            return torch.autograd.grad(shape.packed(out), leaf, shape.grad_out)[0]
    return forward, forward_backward


def cudnn_then_ours(shape):
    def cudnn_forward():
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(*shape.views(shape.qkv), None, True, 0.0,
                                                                      True, False)[:2]
        return shape.packed(out), lse.reshape(shape.batch * shape.heads, shape.seq_len)

    def forward_backward():
        out, lse = cudnn_forward()
        return packed_attention_backward(shape.qkv, out, lse.contiguous(), shape.grad_out, shape.heads,
                                         rope=shape.rope)
    return (lambda: cudnn_forward()[0]), forward_backward


def rows_of(shape) -> dict:
    """{row: (builder of its forward and forward + backward, whether its backward is ours)}. Ours returns dq and dk
    rotated back by RoPE: version 4's step needs the gradient of the q and k its QKV GEMM wrote before rotating."""
    from torch.nn.attention import SDPBackend
    return {"version 4 (Triton)": (lambda: ours(shape), True),
            "sdpa: flash": (lambda: sdpa(shape, SDPBackend.FLASH_ATTENTION), False),
            "sdpa: cudnn": (lambda: sdpa(shape, SDPBackend.CUDNN_ATTENTION), False),
            "sdpa: efficient": (lambda: sdpa(shape, SDPBackend.EFFICIENT_ATTENTION), False),
            "cudnn forward + version 4 backward": (lambda: cudnn_then_ours(shape), True)}


def reference(shape):
    """out and the gradient of the packed qkv, of causal attention in float64 (no RoPE: it is in neither forward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qkv = shape.qkv.double().requires_grad_(True)
    with sdpa_kernel(SDPBackend.MATH):
        out = shape.packed(torch.nn.functional.scaled_dot_product_attention(*shape.views(qkv), is_causal=True))
    out.backward(shape.grad_out.double())
    return out.detach(), qkv.grad


def turned_forward(shape, grad_qkv):
    """Our packed gradient with dq and dk rotated by RoPE again: the gradient of the q and k attention read."""
    cos, sin = (table.double() for table in shape.rope)
    q, k, v = shape.views(grad_qkv.double())
    return torch.cat([shape.packed(rotate(q, cos, sin)), shape.packed(rotate(k, cos, sin)), shape.packed(v)], -1)


def check(shape, forward, forward_backward, want, rotated_back: bool) -> dict:
    """The row's relative errors against `want` = reference(shape): of out, and of dq, dk and dv each (as the kernel
    tests check them: one error over the packed gradient would let a wrong third hide beside two right ones);
    rotated_back: the row's dq and dk come rotated back by RoPE (ours), so they are turned forward first."""
    want_out, want_grad = want
    grad = forward_backward()
    if rotated_back:
        grad = turned_forward(shape, grad)
    errors = {"out": relative_error(forward(), want_out)}
    for name, got, expected in zip(("dq", "dk", "dv"), grad.split(shape.dim, -1), want_grad.split(shape.dim, -1)):
        errors[name] = relative_error(got, expected)
    tolerance = TOLERANCE[shape.qkv.dtype]
    wrong = [f"{what} {error:.1e}" for what, error in errors.items() if not error <= tolerance]
    return {"errors": errors, "verdict": "ok" if not wrong else "WRONG (" + ", ".join(wrong) + ")"}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    shape = Shape(args, dtype)
    want = reference(shape)
    runs, checks, unavailable = {}, {}, {}
    for name, (build, rotated_back) in rows_of(shape).items():
        try:
            forward, forward_backward = build()
            checks[name] = check(shape, forward, forward_backward, want, rotated_back)
            graphs = (captured_launches(forward, CALLS_PER_GRAPH), captured_launches(forward_backward, CALLS_PER_GRAPH))
            # A graph does not keep the tensors it reads alive (sdpa's leaf copy of qkv lives in its closures):
            # each timing keeps its row's closures, so that no replay reads memory handed to someone else.
            keep = (forward, forward_backward)
            runs[f"{name}|forward"] = lambda g=graphs[0], keep=keep: graph_ms(g)
            runs[f"{name}|forward + backward"] = lambda g=graphs[1], keep=keep: graph_ms(g)
        except Exception as why:   # noqa: BLE001 - a backend this GPU or build cannot run is a row of its own
            unavailable[name] = why_unavailable(why)
    times = time_interleaved(runs, ROUNDS)
    forward_flops = 4 * args.batch * args.heads * args.seq_len ** 2 * args.head_dim / 2
    print(f"{torch.cuda.get_device_name()}: causal attention, {args.batch} x {args.heads} heads x {args.seq_len}, "
          f"head dim {args.head_dim} ({args.preset}), {args.dtype}; us per call (graph of {CALLS_PER_GRAPH}, "
          f"median of {ROUNDS} rounds)")
    print(f"{'':<36} {'forward':>9} {'TFLOP/s':>8} {'fwd + bwd':>10} {'TFLOP/s':>8}  check")
    results = []
    for name in rows_of(shape):
        if name in unavailable:
            print(f"{name:<36} unavailable: {unavailable[name]}")
            results.append({"row": name, "unavailable": unavailable[name]})
            continue
        forward_us = 1000.0 * times[f"{name}|forward"] / CALLS_PER_GRAPH
        both_us = 1000.0 * times[f"{name}|forward + backward"] / CALLS_PER_GRAPH
        print(f"{name:<36} {forward_us:9.1f} {forward_flops / forward_us / 1e6:8.0f} {both_us:10.1f} "
              f"{3.5 * forward_flops / both_us / 1e6:8.0f}  {checks[name]['verdict']}")
        results.append({"row": name, "forward_us": forward_us, "forward_backward_us": both_us,
                        "check": checks[name]["verdict"], "relative_errors": checks[name]["errors"]})
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "causal attention on the packed QKV layout: version 4's kernels against PyTorch's "
                         f"attention backends, graphs of {CALLS_PER_GRAPH} calls, median of {ROUNDS} interleaved "
                         "rounds",
            "command": "python version4_triton_ultra/" + command_line("compare_attention_backends.py", argv),
            "environment": software_and_gpu(), "preset": args.preset, "dtype": args.dtype,
            "shape": {"batch": args.batch, "heads": args.heads, "seq_len": args.seq_len, "head_dim": args.head_dim},
            "results": results})
        print(f"results: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
