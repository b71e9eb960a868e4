"""How fast can one training step be? The step's work (step_work.py) over this GPU's ceilings, family by family.

    python benchmarks/step_floor.py --preset medium large                    (on a GPU: measures its ceilings)
    python benchmarks/step_floor.py --preset large --ceilings-json benchmarks/results/kernel_time/h200_step_floor.json
    python benchmarks/step_floor.py --preset medium --gpu-name H100          (data-sheet peaks, no GPU needed)

The ceilings, measured on the GPU at the step's own shapes (bfloat16, random data, each timed as a CUDA/HIP graph
of back-to-back calls, after a few seconds of large GEMMs that bring the GPU to the clocks a training run
sustains; the GEMMs the median of interleaved rounds, the others the median of a graph's replays):
- every GEMM of the step through the vendor BLAS (torch.mm: cuBLAS, hipBLASLt), at its M, N and K;
- causal attention, forward + backward, through the fastest of PyTorch's scaled_dot_product_attention backends
  and version 4's Triton kernels at the preset's batch, heads, sequence and head dim (a backend that does not
  rotate dq and dk back by RoPE, as version 4's kernels do, pays RoPE's backward as a pass of its own);
- the streaming bandwidth (bytes read + written) for every memory-bound pass: the faster of a device-to-device
  copy and an element-wise kernel over 1 GiB.
The floor is the sum of each family's work at its ceiling: the step's time if its kernels ran one after another,
each as fast as the fastest measured kernel of its kind, and nothing else. A step can beat it only by running
kernels at the same time (two streams; a memory-bound pass beside a GEMM), or with kernels faster than those
measured. --step-ms and --target-ms say where a measured step and a goal stand against it.
--ceilings-json reads the ceilings a GPU run wrote (--output-json), so the table is remade on any machine.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, also when run as a file

from benchmarks.step_work import attention_flops, memory_passes, rope_pass_bytes, step_gemms  # noqa: E402
from tinytransformer.checks import check_number  # noqa: E402
from tinytransformer.cli import OneLineParser, command_line, run_command  # noqa: E402
from tinytransformer.config import ConfigError, ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.device import peak_bandwidth_tbs, peak_tflops, software_and_gpu  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import prove_output_file  # noqa: E402

OURS = "version 4 (Triton)"   # the attention candidate whose backward rotates dq and dk back itself
DATA_SHEET = "data-sheet peak"   # the ceiling of every GEMM and of attention with --gpu-name
# Attention ceilings that need no RoPE backward pass beside them: ours, and the data sheet's pure FLOP rate.
NO_ROPE_PASS = (OURS, DATA_SHEET)
ROUNDS = 5            # interleaved rounds of the GPU measurements
COPY_BYTES = 2 ** 30  # the copy that measures bandwidth: well past any L2 cache
WARM_SECONDS = 5.0    # of large GEMMs before the measurements (settle_clocks)


def preset_problem(name: str) -> tuple[ModelConfig, int, int]:
    model, train = preset_settings(name)
    return ModelConfig(**model), train["batch_size"], train["seq_len"]


# ----------------------------------------------------------------------------------------------------------
# Ceilings: measured on this GPU, read from a file, or the data sheet's
# ----------------------------------------------------------------------------------------------------------
def graph_call_ms(run, calls: int = 10, replays: int = ROUNDS) -> float:
    """Median milliseconds of one call of run(), from `replays` replays of a graph of `calls` calls."""
    from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms
    graph = captured_launches(run, calls)
    return statistics.median(graph_ms(graph) for _ in range(replays)) / calls


def settle_clocks(seconds: float = WARM_SECONDS) -> None:
    """Keep the GPU busy with large GEMMs for a few seconds first. A GPU that starts cold runs its first
    seconds faster than a training step sustains (seen on an H200: a GEMM 73 us in the first rounds, 79 us a few
    seconds later), so ceilings timed straight away would be too kind."""
    import time

    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize()


def measure_bandwidth_tbs() -> dict[str, float]:
    """TB/s (bytes read + written) of streaming 1 GiB: a device-to-device copy (in a graph, the copy engines'
    memcpy) and an element-wise kernel on the SMs (what the step's memory-bound kernels are)."""
    import torch
    source = torch.randn(COPY_BYTES // 4, device="cuda")
    target = torch.empty_like(source)
    streams = {"memcpy": lambda: target.copy_(source),
               "element-wise kernel": lambda: torch.mul(source, 2.0, out=target)}
    return {name: 2 * COPY_BYTES / (graph_call_ms(run, calls=5) * 1e-3) / 1e12 for name, run in streams.items()}


def measure_gemm_us(config: ModelConfig, batch: int, seq: int) -> dict[str, float]:
    """{GEMM name: microseconds a call} for every GEMM of the step, through torch.mm in bfloat16: the median of
    ROUNDS interleaved rounds, each GEMM timed once a round."""
    import torch
    operands = {gemm.name: (torch.randn(gemm.m, gemm.k, device="cuda", dtype=torch.bfloat16),
                            torch.randn(gemm.k, gemm.n, device="cuda", dtype=torch.bfloat16))
                for gemm in step_gemms(config, batch, seq)}
    rounds = {name: [] for name in operands}
    for _ in range(ROUNDS):
        for name, (a, b) in operands.items():
            rounds[name].append(1000 * graph_call_ms(lambda: torch.mm(a, b), replays=1))
    return {name: statistics.median(times) for name, times in rounds.items()}


def attention_candidates(config: ModelConfig, batch: int, seq: int) -> dict:
    """{name: forward + backward of causal attention at the preset's shape}, each a callable."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    shape = (batch, config.num_heads, seq, config.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(out, (q, k, v), grad)
        return run
    candidates = {f"sdpa {backend.name.lower()}": sdpa(backend)
                  for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION)}
    from version4_triton_ultra.kernels.flash_attention import flash_attention_packed
    qkv = torch.randn(batch, seq, 3 * config.hidden_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packed_grad = torch.randn(batch, seq, config.hidden_dim, device="cuda", dtype=torch.bfloat16)
    candidates[OURS] = lambda: torch.autograd.grad(
        flash_attention_packed(qkv, config.num_heads), (qkv,), packed_grad)
    return candidates


def measure_attention_us(config: ModelConfig, batch: int, seq: int) -> dict[str, float | None]:
    """{candidate: microseconds of forward + backward a layer}; None where it does not run on this GPU."""
    times = {}
    for name, run in attention_candidates(config, batch, seq).items():
        try:
            times[name] = 1000 * graph_call_ms(run, calls=5)
        except Exception:   # noqa: BLE001 - a backend this GPU, dtype or shape does not support, a kernel it cannot compile
            times[name] = None
    if not any(times.values()):
        raise ConfigError(f"no attention ran on this GPU at {batch} x {config.num_heads} x {seq}, head dim "
                          f"{config.head_dim}: nothing to take as its ceiling")
    return times


def measure_ceilings(presets: list[str]) -> dict:
    settle_clocks()
    streaming = measure_bandwidth_tbs()
    ceilings = {"bandwidth_tbs": max(streaming.values()), "streaming_tbs": streaming, "presets": {}}
    for name in presets:
        config, batch, seq = preset_problem(name)
        ceilings["presets"][name] = {"gemm_us": measure_gemm_us(config, batch, seq),
                                     "attention_us": measure_attention_us(config, batch, seq)}
    return ceilings


def data_sheet_ceilings(gpu_name: str, presets: list[str]) -> dict:
    """The data sheet's bfloat16 peak for every GEMM and attention, its HBM bandwidth for the rest."""
    tflops, bandwidth = peak_tflops(gpu_name, "bfloat16"), peak_bandwidth_tbs(gpu_name)
    if tflops is None or bandwidth is None:
        raise ConfigError(f"--gpu-name {gpu_name!r}: no data-sheet peak for it (tinytransformer/device.py); run on the "
                          f"GPU or give --ceilings-json")
    ceilings = {"bandwidth_tbs": bandwidth, "gemm_ceiling": DATA_SHEET, "presets": {}}
    for name in presets:
        config, batch, seq = preset_problem(name)
        ceilings["presets"][name] = {
            "gemm_us": {g.name: 2 * g.m * g.n * g.k / (tflops * 1e6) for g in step_gemms(config, batch, seq)},
            "attention_us": {DATA_SHEET: attention_flops(config, batch, seq) / config.num_layers
                             / (tflops * 1e6)}}
    return ceilings


def ceilings_from_file(path: str, presets: list[str]) -> dict:
    """The ceilings a GPU run of this command wrote (and the machine it names), checked: for each of `presets`
    every GEMM's time and at least one attention time, all numbers finite and positive."""
    try:
        recorded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"--ceilings-json {path}: cannot read it ({type(error).__name__})") from None
    ceilings = recorded.get("ceilings") if isinstance(recorded, dict) else None
    if not isinstance(ceilings, dict) or not isinstance(ceilings.get("presets"), dict):
        raise ConfigError(f"--ceilings-json {path}: not a file that step_floor.py --output-json wrote (no ceilings)")
    check_positive(path, "bandwidth_tbs", ceilings.get("bandwidth_tbs"))
    for name in presets:
        measured = ceilings["presets"].get(name)
        gemm_us = measured.get("gemm_us") if isinstance(measured, dict) else None
        attention_us = measured.get("attention_us") if isinstance(measured, dict) else None
        if not isinstance(gemm_us, dict) or not isinstance(attention_us, dict):
            raise ConfigError(f"--ceilings-json {path}: no ceilings for preset {name} (run step_floor.py on a GPU "
                              f"with --preset {name} --output-json FILE)")
        config, batch, seq = preset_problem(name)
        for gemm in step_gemms(config, batch, seq):
            check_positive(path, f"{name}: gemm_us: {gemm.name}", gemm_us.get(gemm.name))
        for candidate, us in attention_us.items():
            if us is not None:   # None: a candidate that did not run on that GPU
                check_positive(path, f"{name}: attention_us: {candidate}", us)
        if not any(us is not None for us in attention_us.values()):
            raise ConfigError(f"--ceilings-json {path}: {name}: no attention time")
    return {**ceilings, "environment": recorded.get("environment")}


def check_positive(path: str, key: str, value) -> None:
    """The project's rule for a positive number (tinytransformer/checks.py), said of the file's key."""
    try:
        check_number(key, value, positive=True)
    except ConfigError:
        raise ConfigError(f"--ceilings-json {path}: {key} must be a positive number, got {value!r}") from None


# ----------------------------------------------------------------------------------------------------------
# The floor: each family's work at its ceiling
# ----------------------------------------------------------------------------------------------------------
def floor_rows(name: str, ceilings: dict) -> list[dict]:
    """One row per family: its work, the ceiling it is timed at and its floor in milliseconds."""
    config, batch, seq = preset_problem(name)
    measured = ceilings["presets"][name]
    gemms = step_gemms(config, batch, seq)
    gemm_ms = sum(measured["gemm_us"][g.name] * g.count for g in gemms) / 1000
    gemm_flops = sum(g.flops for g in gemms)
    rows = [{"family": "GEMMs", "work": f"{gemm_flops / 1e12:.2f} TFLOP", "floor_ms": gemm_ms,
             "ceiling": f"{ceilings.get('gemm_ceiling', 'vendor BLAS at each shape')}, "
                        f"{gemm_flops / (gemm_ms * 1e9):.0f} TFLOP/s on average"}]
    bandwidth = ceilings["bandwidth_tbs"]
    # Per layer: the candidate's forward + backward, plus RoPE's backward pass where the candidate does not do it.
    rope_backward_us = rope_pass_bytes(config, batch, seq) / config.num_layers / (bandwidth * 1e6)
    runs = {k: us + (0.0 if k in NO_ROPE_PASS else rope_backward_us)
            for k, us in measured["attention_us"].items() if us is not None}
    fastest = min(runs, key=runs.get)
    flops = attention_flops(config, batch, seq)
    attention_ms = runs[fastest] * config.num_layers / 1000
    label = fastest if fastest in NO_ROPE_PASS else f"{fastest} + RoPE's backward pass"
    rows.append({"family": "attention", "work": f"{flops / 1e12:.3f} TFLOP", "floor_ms": attention_ms,
                 "ceiling": f"{label}, {flops / (attention_ms * 1e9):.0f} TFLOP/s"})
    for family, nbytes in memory_passes(config, batch, seq).items():
        rows.append({"family": family, "work": f"{nbytes / 1e9:.2f} GB", "floor_ms": nbytes / (bandwidth * 1e9),
                     "ceiling": f"streaming, {bandwidth:.2f} TB/s"})
    return rows


def print_table(name: str, rows: list[dict], source: str, step_ms: float | None, target_ms: float | None) -> None:
    config, batch, seq = preset_problem(name)
    floor = sum(row["floor_ms"] for row in rows)
    print(f"preset {name} (batch {batch}, seq {seq}, bfloat16), ceilings: {source}")
    print(f"  {'family':<30} {'work':>14} {'floor ms':>9}  ceiling")
    for row in rows:
        print(f"  {row['family']:<30} {row['work']:>14} {row['floor_ms']:9.3f}  {row['ceiling']}")
    print(f"  {'floor: the sum':<30} {'':>14} {floor:9.3f}")
    for label, ms in (("measured step", step_ms), ("target", target_ms)):
        if ms is not None:
            print(f"  {label:<30} {'':>14} {ms:9.3f}  {ms / floor:.3f} x the floor")


def parse_args(argv):
    parser = OneLineParser(prog="step_floor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", choices=available_presets(), default=["medium"],
                        help="the presets [medium]")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ceilings-json", help="the ceilings a GPU run of this command wrote (--output-json)")
    source.add_argument("--gpu-name", help="use the data sheet's peaks of this GPU (e.g. H100, H200, MI300X) "
                                           "instead of measuring [the GPU here]")
    parser.add_argument("--step-ms", type=float, help="a measured step to set against the floor (one --preset)")
    parser.add_argument("--target-ms", type=float, help="a goal to set against the floor (one --preset)")
    parser.add_argument("--output-json", help="also write the ceilings and the tables here")
    args = parser.parse_args(argv)
    if len(set(args.preset)) != len(args.preset):
        parser.error(f"--preset: each preset once; got {' '.join(args.preset)}")
    if (args.step_ms is not None or args.target_ms is not None) and len(args.preset) != 1:
        parser.error("--step-ms and --target-ms set one preset's times against its floor: give one --preset")
    for flag, value in (("--step-ms", args.step_ms), ("--target-ms", args.target_ms)):
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"{flag}: a positive number of milliseconds, got {value}")
    if args.output_json:
        prove_output_file(args.output_json, "--output-json")
    return args


def main(argv=None) -> int:
    def body() -> int:
        args = parse_args(argv)
        import torch
        if args.ceilings_json:
            ceilings, source = ceilings_from_file(args.ceilings_json, args.preset), f"measured ({args.ceilings_json})"
        elif args.gpu_name:
            ceilings, source = data_sheet_ceilings(args.gpu_name, args.preset), f"{args.gpu_name}'s data sheet"
        elif torch.cuda.is_available():
            ceilings, source = measure_ceilings(args.preset), f"measured on this {torch.cuda.get_device_name()}"
        else:
            raise ConfigError("no GPU to measure the ceilings on: give --ceilings-json (a GPU run's file) or "
                              "--gpu-name (the data sheet's peaks)")
        tables = {}
        for name in args.preset:
            tables[name] = floor_rows(name, ceilings)
            print_table(name, tables[name], source, args.step_ms, args.target_ms)
        if args.output_json:
            write_json(args.output_json, {
                "benchmark": "one training step's work at this GPU's ceilings, by family (step_floor.py)",
                "command": "python benchmarks/" + command_line("step_floor.py", argv),
                "environment": ceilings.get("environment") or software_and_gpu(), "source": source,
                "ceilings": {k: v for k, v in ceilings.items() if k != "environment"},
                "floors": {name: {"rows": rows, "floor_ms": sum(r["floor_ms"] for r in rows)}
                           for name, rows in tables.items()}})
            print(f"results: {args.output_json}")
        return 0
    return run_command("step_floor.py", body)


if __name__ == "__main__":
    sys.exit(main())
