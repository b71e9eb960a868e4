"""Time the flash-attention kernels under many launch configs on this GPU, and show the fastest.

    python tune_flash_attention.py                            (head dim 32, float32 and bfloat16, 4 shapes)
    python tune_flash_attention.py --quick --dtype bfloat16   (12 configs per kernel instead of 60)
    python tune_flash_attention.py --head-dim 64 --shapes 4x16x2048 --kernels forward

kernels/flash_attention.py launches each of its three kernels (forward, dk/dv, dq) with FIXED block sizes,
warps and pipeline stages (`_launch_config`), chosen with this script on an H100. Another GPU (an AMD MI300
with 64-wide wavefronts and 64 KiB of shared memory per CU, an older NVIDIA part) may prefer others: run this,
compare the "current" row with the best ones, and edit `_launch_config` if they differ by more than noise.

What it measures: each kernel alone, on inputs laid out as version 3's model calls it (packed QKV, causal): 20 launches captured in one CUDA/HIP graph, the graph replayed 7 times, the median replay divided by 20.
So even the few-microsecond kernels of a short sequence are timed without the host's launch cost. Compiling 60 configs
per kernel and dtype takes a few minutes the first time (Triton caches them on disk afterwards).
Needs a GPU: the CPU interpreter's timings say nothing about one.
"""
import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from version3_triton.kernels import flash_attention as fa  # noqa: E402

KERNELS = ("forward", "dkdv", "dq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHAPES = "8x8x128,16x8x256,32x8x512,8x8x1024"   # batch x heads x sequence: the benchmark's grid
TILES = [(16, 32), (32, 16), (32, 32), (64, 32), (32, 64), (64, 64), (128, 32), (128, 64), (64, 128), (128, 128)]
QUICK_TILES = [(32, 32), (64, 64), (128, 64)]


def candidate_configs(quick: bool) -> list[dict]:
    """Block sizes x warps x stages. 60 configs (12 with quick)."""
    tiles, warps = (QUICK_TILES, (4, 8)) if quick else (TILES, (2, 4, 8))
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for (m, n), w, s in itertools.product(tiles, warps, (1, 2))]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected BATCHxHEADSxSEQ (e.g. 8x8x128), got {item.strip()!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_list(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items
    return parse


def parse_args(argv):
    parser = OneLineParser(prog="tune_flash_attention.py",
                           description="Time the flash-attention kernels under many launch configs.")
    parser.add_argument("--dtype", type=parse_list(tuple(DTYPES)), default=["float32", "bfloat16"],
                        help="comma-separated, from float32,bfloat16,float16 [float32,bfloat16]")
    parser.add_argument("--head-dim", type=int, choices=fa.SUPPORTED_HEAD_DIMS, default=32)
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"batch x heads x sequence, comma-separated [{DEFAULT_SHAPES}]")
    parser.add_argument("--kernels", type=parse_list(KERNELS), default=list(KERNELS),
                        help="comma-separated, from forward,dkdv,dq [all]")
    parser.add_argument("--quick", action="store_true", help="12 configs per kernel instead of 60")
    parser.add_argument("--top", type=int, default=5, help="how many of the fastest configs to show [5]")
    args = parser.parse_args(argv)
    for batch, heads, seq_len in args.shapes:   # laid out as the model calls the kernels: rows 3 * D apart
        problem = fa.shape_problem(batch * heads, seq_len, args.head_dim, 3 * heads * args.head_dim)
        if problem:
            parser.error(f"shape {batch}x{heads}x{seq_len}: {problem}")
    if not torch.cuda.is_available():
        parser.error("needs a GPU (CUDA or ROCm): the CPU interpreter's timings say nothing about one")
    return args


class Problem:
    """Inputs and outputs of the three kernels for one shape, laid out as the model uses them (the same memory;
    k and v are passed as views of qkv with offsets 0, where the library passes qkv with k_offset, v_offset)."""

    def __init__(self, fa, batch, heads, seq_len, head_dim, dtype, device="cuda"):
        dim = heads * head_dim
        qkv = torch.randn(batch, seq_len, 3 * dim, device=device, dtype=dtype)
        self.q, self.k, self.v = qkv.split(dim, dim=-1)
        self.problem = fa._Problem(batch, heads, seq_len, head_dim,
                                   qkv_strides=(seq_len * 3 * dim, head_dim, 3 * dim),
                                   out_strides=(seq_len * dim, head_dim, dim), causal=True,
                                   sm_scale=1.0 / math.sqrt(head_dim), precision=fa._dot_precision(dtype, False))
        self.out = torch.empty(batch, seq_len, dim, device=device, dtype=dtype)
        self.lse = fa._run_forward(self.problem, self.q, self.k, self.v, self.out)
        self.grad_out = torch.randn_like(self.out)
        per_head = (self.out.float() * self.grad_out.float()).view(batch, seq_len, heads, head_dim).sum(-1)
        self.delta = per_head.transpose(1, 2).reshape(batch * heads, seq_len).contiguous()  # dq rewrites it (same values)
        self.grad_qkv = torch.empty_like(qkv)
        self.dq, self.dk, self.dv = self.grad_qkv.split(dim, dim=-1)
        self.fa = fa

    def launcher(self, kernel: str, config: dict):
        """A no-argument function that launches `kernel` once with `config`."""
        import triton
        fa, p, bh = self.fa, self.problem, self.problem.batch * self.problem.heads
        flags = dict(HEAD_DIM=p.head_dim, CAUSAL=True, DOT_PRECISION=p.precision, **config)
        blocks = triton.cdiv(p.seq_len, config["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"])
        if kernel == "forward":
            args = (self.q, self.k, self.v, self.out, self.lse)
            kernel_fn = fa._flash_attention_forward_kernel
        elif kernel == "dkdv":
            args = (self.q, self.k, self.v, self.grad_out, self.lse, self.delta, self.dk, self.dv)
            kernel_fn = fa._flash_attention_backward_dkdv_kernel
        else:
            args = (self.q, self.k, self.v, self.out, self.grad_out, self.lse, self.delta, self.dq)
            kernel_fn = fa._flash_attention_backward_dq_kernel
        return lambda: kernel_fn[(blocks, bh)](*args, *p.scalar_args(), **flags)


def time_us(launch, launches_per_graph: int = 20, replays: int = 7) -> float | None:
    """Median time of one launch in microseconds, replayed from a graph; None if the config does not compile
    or run (too much shared memory, too many registers)."""
    try:
        launch()   # compile (and fail, if it must) outside the graph
        torch.cuda.synchronize()
    except Exception:   # noqa: BLE001 - a config this GPU cannot run is simply not a candidate
        return None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches_per_graph):
            launch()
    graph.replay()   # warm-up
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches_per_graph)
    return sorted(times)[len(times) // 2]


def describe(config: dict) -> str:
    return f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configs = candidate_configs(args.quick)
    print(f"{torch.cuda.get_device_name()}: {len(configs)} configs per kernel, head dim {args.head_dim}, causal; "
          f"times are medians of graph replays (us)")
    print(f"{'dtype':<9} {'B x H x S':<12} {'kernel':<8} {'current':>22}   fastest")
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        for batch, heads, seq_len in args.shapes:
            problem = Problem(fa, batch, heads, seq_len, args.head_dim, dtype)
            for kernel in args.kernels:
                current = fa._launch_config(args.head_dim, dtype, seq_len, kernel)
                timed = [(us, c) for c in configs if (us := time_us(problem.launcher(kernel, c))) is not None]
                timed.sort(key=lambda item: item[0])
                current_us = time_us(problem.launcher(kernel, current))
                best = " ; ".join(f"{us:.2f} {describe(c)}" for us, c in timed[:args.top])
                shown = f"{current_us:.2f} {describe(current)}" if current_us is not None else "fails"
                print(f"{dtype_name:<9} {f'{batch}x{heads}x{seq_len}':<12} {kernel:<8} {shown:>22}   {best}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
