"""cuBLAS against a Triton GEMM written for Hopper, at every GEMM of one preset's training step.

    python benchmarks/compare_gemm_backends.py --preset medium
    python benchmarks/compare_gemm_backends.py --preset large --output-json runs/gemm_backends_large.json

Version 4 leaves its plain GEMMs to the vendor BLAS. Would a Triton GEMM written for the GPU beat it at the step's
own shapes? For each GEMM of the step (step_work.step_gemms: every projection's forward, input gradient and weight
gradient, and the fused head's, a chunk of rows at a time as the head computes them), in the operand layouts the
step gives it (x @ W.T, grad_y @ W, and grad_y.T @ x with a float32 output for a weight gradient), the rows are:
    cuBLAS                 torch.mm (out_dtype=torch.float32 for a weight gradient), with the cuBLAS workspace
                           version 4 runs with: none unless --cublas-workspace default
                           (tinytransformer/cublas_workspace.py)
    Triton (table launch)  benchmarks/tma_gemm.py: tensor descriptors, one program per SM, its launch rule's choice
    Triton (B,B,B,W,S)     the same kernel under each candidate launch: BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES
A launch this GPU cannot run (too much shared memory, for one) is listed with the reason and left out.

How it times: each row as a CUDA graph of 10 calls taking turns on 2 copies of the operands, replayed in 5
interleaved rounds (median; tinytransformer/kernel_bench/graph_timing.py): each GEMM alone, with the GPU to
itself (in the step, the weight gradients share it with the main stream's kernels; and the head's weight gradient
of every chunk after the first is added to the one before in cuBLAS's epilogue, beta = 1, timed here as a plain
product). The totals weight each GEMM by how many times a step runs it: the step's GEMM time with cuBLAS, with
the Triton table launch, and with the fastest row of each GEMM. Before it is timed, each row's product is checked
against float64 (relative error of the whole product within the kernel tests' tolerance for the output's dtype),
else the row says WRONG, is left out of the totals, and the command exits with status 1.

Needs an NVIDIA GPU (on ROCm it stops in one line: hipBLASLt is not what it compares); the Triton rows need
compute capability 9 or newer (elsewhere they are listed as unavailable, with the reason, and cuBLAS is timed
alone).
"""
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, also when run as a file

from benchmarks.step_work import step_gemms  # noqa: E402
from tinytransformer.cli import OneLineParser, command_line  # noqa: E402
from tinytransformer.config import ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.cublas_workspace import (add_cublas_workspace_argument,  # noqa: E402
                                              apply_cublas_workspace_argument, describe_cublas_workspace)
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from tinytransformer.device import software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms, time_interleaved  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import (candidates_from_flags, prove_output_json,  # noqa: E402
                                                  refuse_without_gpu, why_unavailable)
from version4_triton_ultra.kernels import linear_cross_entropy as lce  # noqa: E402
from benchmarks import tma_gemm as tg  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative error of the whole product, by the output's dtype: the kernel tests' (tests/v4_kernel_checks.py).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
CALLS_PER_GRAPH = 10
ROUNDS = 5
COPIES = 2
# Launches tried beside the table's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the runners-up of the sweep
# behind it (tma_gemm.py: HOPPER_LAUNCH).
DEFAULT_CANDIDATES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]


@dataclasses.dataclass
class StepGemm:
    """One GEMM of the step as the step runs it: out [m, n] = a [m, k] @ b [k, n], `count` times a step; a is the
    transpose of a row-major [k, m] where a_transposed, b of a row-major [n, k] where b_transposed."""
    name: str
    m: int
    n: int
    k: int
    count: int
    a_transposed: bool
    b_transposed: bool
    float32_output: bool


def head_chunks(tokens: int, vocab_size: int, dtype: torch.dtype) -> dict[int, int]:
    """{rows: how many chunks of that many rows}: the fused head's chunks of one batch (kernels/
    linear_cross_entropy.py: default_chunk_rows)."""
    rows = min(lce.default_chunk_rows(vocab_size, dtype), tokens)
    chunks = {rows: tokens // rows}
    if tokens % rows:
        chunks[tokens % rows] = 1
    return chunks


def as_the_step_runs_them(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> list[StepGemm]:
    """step_work.step_gemms in the step's operand layouts, the head's split into its chunks of rows."""
    tokens = batch * seq
    gemms = []
    for gemm in step_gemms(config, batch, seq):
        kind = "forward" if gemm.name.endswith("forward") else "input" if "input" in gemm.name else "weight"
        layout = {"forward": (False, True, False), "input": (False, False, False), "weight": (True, False, True)}[kind]
        if not gemm.name.startswith("head"):
            gemms.append(StepGemm(gemm.name, gemm.m, gemm.n, gemm.k, gemm.count, *layout))
            continue
        for rows, count in head_chunks(tokens, config.vocab_size, dtype).items():
            m, k = (gemm.m, rows) if kind == "weight" else (rows, gemm.k)
            gemms.append(StepGemm(f"{gemm.name} ({rows} rows)", m, gemm.n, k, count, *layout))
    return gemms


def candidate(text: str) -> tuple:
    """BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES: tiles and warps powers of two, stages 1 to 8."""
    parts = text.split(",")
    if len(parts) != 5 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"expected BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES (e.g. 128,256,64,8,3), got {text!r}")
    launch = tuple(int(part) for part in parts)
    powers = all(value & (value - 1) == 0 for value in launch[:4])
    if not powers or min(launch[:3]) < 16 or max(launch[:3]) > 256 or launch[3] > 16 or launch[4] > 8:
        raise ValueError(f"{text}: tiles of 16 to 256 and warps up to 16, each a power of two; 1 to 8 stages")
    return launch


def launch_of(values: tuple) -> dict:
    block_m, block_n, block_k, warps, stages = values
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)


def parse_args(argv):
    parser = OneLineParser(prog="compare_gemm_backends.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=available_presets(), default="medium",
                        help="the model sizes, batch and sequence of configs/PRESET.yaml [medium]")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the operands' dtype [bfloat16]")
    parser.add_argument("--candidates", nargs="+", metavar="M,N,K,W,S",
                        help="Triton launches to try beside the table's: BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES "
                             "(tiles and warps powers of two) [the sweep's runners-up]")
    add_cublas_workspace_argument(parser)
    parser.add_argument("--output-json", help="also write the table, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    args.candidates = candidates_from_flags(parser, args.candidates, candidate, DEFAULT_CANDIDATES)
    refuse_without_gpu(parser)
    if torch.version.hip is not None:
        parser.error("compares cuBLAS with a Triton GEMM for NVIDIA's Hopper GPUs; this is a ROCm build")
    return args


class Operands:
    """COPIES sets of one GEMM's operands, stored as the step stores them, and the float64 product of the first."""

    def __init__(self, gemm: StepGemm, dtype: torch.dtype, seed: int):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        a_shape = (gemm.k, gemm.m) if gemm.a_transposed else (gemm.m, gemm.k)
        b_shape = (gemm.n, gemm.k) if gemm.b_transposed else (gemm.k, gemm.n)
        self.sets = []
        for _ in range(COPIES):
            a = torch.randn(a_shape, device="cuda", generator=generator).to(dtype)
            b = torch.randn(b_shape, device="cuda", generator=generator).to(dtype)
            self.sets.append((a.T if gemm.a_transposed else a, b.T if gemm.b_transposed else b))
        self.out_dtype = torch.float32 if gemm.float32_output else dtype
        self.turn = 0

    def next(self) -> tuple:
        self.turn = (self.turn + 1) % COPIES
        return self.sets[self.turn]

    def reference(self) -> torch.Tensor:
        a, b = self.sets[0]
        return a.double() @ b.double()


def cublas(operands: Operands):
    out_dtype = operands.out_dtype

    def run(pair=None):
        a, b = pair or operands.next()
        # A weight gradient as the step computes it: one GEMM with a float32 output where torch has it.
        return lce.matmul_to_float32(a, b) if out_dtype == torch.float32 else torch.mm(a, b)
    return run


def triton_gemm(operands: Operands, launch: dict | None):
    def run(pair=None):
        a, b = pair or operands.next()
        return tg.tma_gemm(a, b, operands.out_dtype, launch=launch)
    return run


def check(run, operands: Operands, want: torch.Tensor) -> tuple[float, str]:
    """(relative error of the whole product against float64, "ok" or "WRONG")."""
    got = run(operands.sets[0]).double()
    error = ((got - want).norm() / want.norm()).item() if torch.isfinite(got).all() else float("inf")
    return error, "ok" if error <= TOLERANCE[operands.out_dtype] else "WRONG"


def rows_of(operands: Operands, gemm: StepGemm, candidates: list, triton_problem: str | None) -> dict:
    """{row name: its callable, or the reason it is unavailable}; a candidate that is the table's launch for this
    GEMM is not timed twice."""
    rows = {"cuBLAS": cublas(operands)}
    names = {"Triton (table launch)": None}
    if not triton_problem:
        table = tg.launch_for(operands.out_dtype, gemm.m, gemm.n, gemm.k, torch.device("cuda"))
        names.update({f"Triton {values}": launch_of(values) for values in candidates if launch_of(values) != table})
    for name, launch in names.items():
        rows[name] = triton_problem or triton_gemm(operands, launch)
    return rows


def measure(gemm: StepGemm, dtype: torch.dtype, candidates: list, triton_problem: str | None, seed: int) -> dict:
    """{row: {"us": ..., "tflops": ..., "error": ..., "check": ...} or {"unavailable": why}} for one GEMM."""
    operands = Operands(gemm, dtype, seed)
    want = operands.reference()
    results, graphs = {}, {}
    for name, run in rows_of(operands, gemm, candidates, triton_problem).items():
        if isinstance(run, str):
            results[name] = {"unavailable": run}
            continue
        try:
            error, verdict = check(run, operands, want)
            graphs[name] = captured_launches(run, CALLS_PER_GRAPH)
            results[name] = {"error": error, "check": verdict}
        except Exception as why:   # noqa: BLE001 - a launch this GPU cannot compile or run is not a candidate
            results[name] = {"unavailable": why_unavailable(why)}
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)
    for name, ms in times.items():
        us = 1000.0 * ms / CALLS_PER_GRAPH
        results[name].update(us=us, tflops=2.0 * gemm.m * gemm.n * gemm.k / us / 1e6)
    return results


def checked_us(row: dict) -> float | None:
    """A row's time if it was timed and passed its check, else None."""
    return row.get("us") if row.get("check") == "ok" else None


def fastest_triton(results: dict) -> str | None:
    timed = [name for name, row in results.items() if name != "cuBLAS" and checked_us(row) is not None]
    return min(timed, key=lambda name: results[name]["us"]) if timed else None


def step_totals(gemms: list[StepGemm], measured: dict) -> dict:
    """The step's GEMM milliseconds (each GEMM times its count) with cuBLAS, with the Triton table launch, and with
    the fastest row of each GEMM; None where a GEMM lacks a timed row that passed its check."""
    def total(pick):
        times = [pick(measured[gemm.name]) for gemm in gemms]
        if any(us is None for us in times):
            return None
        return sum(us * gemm.count for us, gemm in zip(times, gemms)) / 1000.0

    def fastest(results):
        timed = [us for us in map(checked_us, results.values()) if us is not None]
        return min(timed) if timed else None
    return {"cuBLAS": total(lambda results: checked_us(results["cuBLAS"])),
            "Triton (table launch)": total(lambda results: checked_us(results["Triton (table launch)"])),
            "fastest row per GEMM": total(fastest)}


def print_gemm(gemm: StepGemm, results: dict) -> None:
    base, best = results["cuBLAS"], fastest_triton(results)
    shape = f"{gemm.m:>6} x {gemm.n:>6} x {gemm.k:>6}"
    if "us" not in base:
        print(f"{gemm.name:<34} x{gemm.count:<3} {shape}  cuBLAS: {base.get('unavailable', 'not timed')}")
        return
    text = f"{gemm.name:<34} x{gemm.count:<3} {shape}  cuBLAS {base['us']:8.1f} us ({base['tflops']:4.0f} TF/s)"
    if best is None:
        reasons = {row.get("unavailable") for row in results.values() if "unavailable" in row}
        print(f"{text}  Triton: {'; '.join(sorted(reasons)) or 'no launch passed its check'}")
        return
    table = results["Triton (table launch)"]
    table_text = f"{table['us']:8.1f}" if "us" in table else "       -"
    print(f"{text}  table {table_text}  fastest {results[best]['us']:8.1f} us ({results[best]['tflops']:4.0f} TF/s, "
          f"{best[7:]})  {results[best]['us'] / base['us']:.3f}x cuBLAS's time")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    apply_cublas_workspace_argument(args, torch.device("cuda"))   # before the first GEMM of the process
    dtype = DTYPES[args.dtype]
    model, train = preset_settings(args.preset)
    config = ModelConfig(**model)
    gemms = as_the_step_runs_them(config, train["batch_size"], train["seq_len"], dtype)
    triton_problem = tg.tma_gemm_problem(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: the {args.preset} preset's step GEMMs, {args.dtype}; cuBLAS workspace: "
          f"{describe_cublas_workspace(on_gpu=True)}; us per GEMM (graph of {CALLS_PER_GRAPH}, median of {ROUNDS} "
          f"rounds), each GEMM alone")
    measured = {}
    for seed, gemm in enumerate(gemms):
        measured[gemm.name] = measure(gemm, dtype, args.candidates, triton_problem, seed)
        print_gemm(gemm, measured[gemm.name])
        torch.cuda.empty_cache()
    wrong = sorted(f"{gemm} {row}" for gemm, rows in measured.items() for row, result in rows.items()
                   if result.get("check") == "WRONG")
    totals = step_totals(gemms, measured)
    print("step's GEMMs: " + ", ".join(f"{name} {ms:.2f} ms" if ms is not None else f"{name} -"
                                       for name, ms in totals.items()))
    if wrong:
        print("WRONG (left out of the totals): " + "; ".join(wrong))
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "every GEMM of one preset's training step, cuBLAS against a TMA GEMM in Triton "
                         f"(benchmarks/tma_gemm.py), graph of {CALLS_PER_GRAPH} calls, median of {ROUNDS} interleaved "
                         "rounds, each GEMM alone",
            "command": "python benchmarks/" + command_line("compare_gemm_backends.py", argv),
            "environment": software_and_gpu(), "preset": args.preset, "dtype": args.dtype,
            "cublas_workspace": describe_cublas_workspace(on_gpu=True),
            "gemms": [{**dataclasses.asdict(gemm), "rows": measured[gemm.name]} for gemm in gemms],
            "step_gemm_ms": totals})
        print(f"results: {args.output_json}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
