"""How long does the HOST take to launch one GPU kernel? PyTorch op vs Triton kernel vs graph replay.

At the workshop's seed configuration every kernel is tiny (microseconds of GPU work), so a training step's time
is set by how fast Python can issue kernels, not by how fast the GPU runs them. This measures the host cost of
one launch of each kind on small tensors, so the "launch-bound" explanation of the version table is a number.

    python benchmarks/launch_overhead.py            (needs a GPU)
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def host_us_per_call(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Median over repeats of (host wall time of `calls` launches) / calls, GPU synchronised around it."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    if not torch.cuda.is_available():
        print("launch_overhead.py measures GPU kernel launches: it needs a GPU (none found).", file=sys.stderr)
        return 2
    from version3_triton.kernels.rmsnorm import rms_norm
    x = torch.randn(1024, 256, device="cuda")
    w = torch.ones(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            rms_norm(x, w)
    rows = [
        ("torch.add (one ATen kernel)", host_us_per_call(lambda: torch.add(x, x))),
        ("PyTorch RMSNorm (6 ATen kernels)",
         host_us_per_call(lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))),
        ("Triton RMSNorm (1 kernel + autograd.Function)", host_us_per_call(lambda: rms_norm(x, w))),
        ("graph replay of 10 Triton RMSNorms, per kernel", host_us_per_call(graph.replay) / 10),
    ]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'launch':<50} host us/call")
    for name, us in rows:
        print(f"{name:<50} {us:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
