"""How long does the HOST take to launch one GPU kernel? PyTorch op vs Triton kernel vs graph replay.

At the workshop's seed configuration every kernel is tiny (microseconds of GPU work), so a training step's time
is set by how fast Python can issue kernels, not by how fast the GPU runs them. This measures the host cost of
one launch of each kind on small tensors, so the "launch-bound" explanation of the version table is a number.

    python benchmarks/launch_overhead.py            (needs a GPU)
    python benchmarks/launch_overhead.py --in-step  (the same costs inside a real training step)

--in-step trains versions 1 and 3 at the seed configuration (float32, a plain forward / backward / AdamW loop)
and reports the host's time per phase, then, for version 3, the host time spent inside each autograd Function
(its forward and its backward, per call) and inside each Triton kernel launch (Triton's own launcher). Inside a
step every call costs more than in a tight loop of one call (the host's caches hold the whole step's code, not
one call's), and the gap between a Function and its kernel launch is the Python around the launch: views,
allocations, checks. The timers themselves add about a microsecond per call.
"""
import collections
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


def single_launch_table() -> None:
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


# ----------------------------------------------------------------------------------------------------------
# --in-step: host time inside a training step
# ----------------------------------------------------------------------------------------------------------
class HostClock:
    """Accumulates host seconds and calls per label, from wrappers put around functions."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)

    def wrap(self, label, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


def instrument_version3(clock: HostClock) -> None:
    """Time every version 3 autograd Function's forward and backward, and every Triton launch."""
    from triton.runtime.jit import JITFunction
    from version3_triton.kernels import flash_attention, rmsnorm, rope, swiglu
    for function in (rmsnorm.RMSNormFunction, rope.RoPEPackedFunction, flash_attention.FlashAttentionPackedFunction,
                     swiglu.SwiGLUFusedFunction):
        for phase in ("forward", "backward"):
            timed = clock.wrap(f"{function.__name__}.{phase}", getattr(function, phase))
            setattr(function, phase, staticmethod(timed))
    launch = JITFunction.run

    def timed_launch(self, *args, **kwargs):
        return clock.wrap(f"launch {self.fn.__name__}", launch)(self, *args, **kwargs)
    JITFunction.run = timed_launch


IN_STEP_WARMUP = 20   # untimed steps before the timed ones: compilation, allocator growth


def host_ms_per_phase(model, steps: int) -> dict:
    """Median host milliseconds of zero_grad + forward, backward and the optimizer step over `steps` steps
    (after IN_STEP_WARMUP untimed ones)."""
    from tinytransformer.config import ModelConfig
    config = ModelConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = torch.randint(0, config.vocab_size, (8, 129), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    phases = collections.defaultdict(list)
    for step in range(IN_STEP_WARMUP + steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if step >= IN_STEP_WARMUP:
            for phase, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
                phases[phase].append(seconds * 1e3)
    torch.cuda.synchronize()
    return {phase: statistics.median(ms) for phase, ms in phases.items()}


def in_step_tables(steps: int) -> None:
    from tinytransformer.config import ModelConfig
    from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama as V1
    from version3_triton.tiny_llama_v3 import TinyLlama as V3
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; seed configuration, float32")
    print(f"{'version':<8} {'forward ms':>11} {'backward ms':>12} {'optimizer ms':>13} {'step ms':>8}   (host time)")
    for name, model_class in (("v1", V1), ("v3", V3)):
        ms = host_ms_per_phase(model_class(ModelConfig()).cuda(), steps)
        print(f"{name:<8} {ms['forward']:11.2f} {ms['backward']:12.2f} {ms['optimizer']:13.2f} "
              f"{sum(ms.values()):8.2f}")
    clock = HostClock()
    instrument_version3(clock)
    model = V3(ModelConfig()).cuda()
    host_ms_per_phase(model, 5)   # warm the wrappers
    clock.reset()
    host_ms_per_phase(model, steps)
    steps_timed = IN_STEP_WARMUP + steps   # the wrappers count every step, warm-up included
    print(f"\nversion 3, host time inside each call (instrumented run, {steps_timed} steps):")
    print(f"{'':<52} {'calls/step':>10} {'us/call':>8} {'ms/step':>8}")
    for label in sorted(clock.seconds, key=lambda key: -clock.seconds[key]):
        calls, seconds = clock.calls[label], clock.seconds[label]
        print(f"{label:<52} {calls / steps_timed:10.1f} {seconds / calls * 1e6:8.1f} "
              f"{seconds / steps_timed * 1e3:8.2f}")


def main(argv=None) -> int:
    from tinytransformer.cli import OneLineParser, positive_int
    parser = OneLineParser(prog="launch_overhead.py", description="Host cost of kernel launches.")
    parser.add_argument("--in-step", action="store_true",
                        help="host time per phase of a v1 and a v3 training step, and per v3 Function and launch")
    parser.add_argument("--steps", type=positive_int, default=200, help="timed steps for --in-step [200]")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("launch_overhead.py measures GPU kernel launches: it needs a GPU (none found).", file=sys.stderr)
        return 2
    if args.in_step:
        in_step_tables(args.steps)
    else:
        single_launch_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
