"""Time version 4's RoPE kernel (kernels/qk_rotation.py) under other launches at one preset's shape, and check each.

    python tune_qk_rotation.py --preset medium
    python tune_qk_rotation.py --preset large --dtype float32
    python tune_qk_rotation.py --preset small --candidates 16,4,4 32,8,8 --output-json runs/rotation_small.json

rotate_qk_ reads q and k of the packed qkv [N, 3D] once and writes them once: a streaming kernel, whose goal is
the memory bandwidth. Its launch (kernels/qk_rotation.py: _launch_config) is rows per program, heads per program
and warps. Each candidate here is ROWS,HEADS,WARPS (powers of two; HEADS at most the q and k heads of a row,
rounded up to a power of two) and replaces that rule for the kernel's whole grid. The first row of the table is
the rule's own launch.

How it times: as tune_norm_backward.py (tinytransformer/kernel_bench/graph_timing.py): one CUDA/HIP graph of 20
back-to-back launches per candidate, replayed in interleaved rounds (median of 5, microseconds per launch). The
launches take turns on copies of qkv that together hold three times the L2 cache, so each one reads from memory
(in the training step the QKV GEMM has just written qkv, and part of it may still be in the cache: faster than
here). GB/s counts q and k read and written once (the cos / sin tables are small and stay in the cache); the last
column is that against the GPU's data-sheet bandwidth, where the GPU is known.

Every candidate's output is compared with the rule's, bit for bit (each element's arithmetic is the same under
any tiling; tests/test_v4_qk_rotation.py checks the rule against a float64 reference), else the row says WRONG.
Candidates of more than 32,768 elements a program are skipped. Needs a GPU.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line  # noqa: E402
from tinytransformer.config import ModelConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

import triton  # noqa: E402

from tinytransformer.device import peak_bandwidth_tbs, software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import (buffer_count, captured_launches, graph_ms,  # noqa: E402
                                                     time_interleaved)
from tinytransformer.kernel_bench.tuner_cli import (candidates_from_flags, powers_of_two,  # noqa: E402
                                                  prove_output_json, refuse_without_gpu)
from version3_triton.kernels.rope import rope_tables  # noqa: E402
from version4_triton_ultra.kernels import qk_rotation as qk  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_PROGRAM_ELEMENTS = 32768
LAUNCHES_PER_GRAPH = 20
ROUNDS = 5


def default_candidates(rotated_heads: int, head_dim: int) -> list:
    """Programs of 1,024 to 8,192 elements, 1 to all of the q and k heads of a row (up to 1,024 columns), 2, 4 or
    8 warps."""
    candidates = []
    for columns in (64, 128, 256, 512, 1024):
        heads = columns // head_dim
        if heads < 1 or heads > triton.next_power_of_2(rotated_heads):
            continue
        for elements in (1024, 2048, 4096, 8192):
            if elements >= columns:
                candidates += [(elements // columns, heads, warps) for warps in (2, 4, 8)]
    return candidates


def candidate(text: str) -> tuple:
    return powers_of_two(text, "ROWS,HEADS,WARPS", "16,4,4")


def parse_args(argv):
    parser = OneLineParser(prog="tune_qk_rotation.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=available_presets(), default="medium",
                        help="the model width, heads, batch and sequence of configs/PRESET.yaml [medium]")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="qkv's dtype [bfloat16]")
    parser.add_argument("--candidates", nargs="+", metavar="R,H,W",
                        help="launches to try: rows, heads, warps per program [a built-in list]")
    parser.add_argument("--output-json", help="also write the table, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    model, train = preset_settings(args.preset)
    config = ModelConfig(**model)
    args.rows, args.dim, args.head_dim = train["batch_size"] * train["seq_len"], config.hidden_dim, config.head_dim
    args.seq_len, args.rotated_heads = train["seq_len"], 2 * config.hidden_dim // config.head_dim
    args.candidates = candidates_from_flags(parser, args.candidates, candidate,
                                            default_candidates(args.rotated_heads, args.head_dim))
    too_many = [c for c in args.candidates if c[1] > triton.next_power_of_2(args.rotated_heads)]
    if too_many:
        parser.error(f"--candidates: {too_many[0][1]} heads a program, and a row has {args.rotated_heads} q and k "
                     f"heads")
    args.candidates = [c for c in args.candidates if c[0] * c[1] * args.head_dim <= MAX_PROGRAM_ELEMENTS]
    refuse_without_gpu(parser)
    return args


def launch_of(candidate_or_none) -> dict | None:
    if candidate_or_none is None:
        return None
    rows, heads, warps = candidate_or_none
    return dict(BLOCK_M=rows, HEADS=heads, num_warps=warps)


def label(candidate_or_none) -> str:
    if candidate_or_none is None:
        return "the rule"
    return "{} rows x {} heads, {} warps".format(*candidate_or_none)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    source = torch.randn(args.rows, 3 * args.dim, device="cuda").to(dtype)   # never rotated itself
    cos, sin = rope_tables(args.seq_len, args.head_dim, device="cuda")
    rotate = lambda qkv, launch: qk.rotate_qk_(qkv, cos, sin, args.seq_len, args.head_dim,  # noqa: E731
                                               launch=launch_of(launch))
    want = rotate(source.clone(), None)
    bytes_moved = 2 * args.rows * 2 * args.dim * source.element_size()   # q and k, read and written
    buffers = [source.clone() for _ in range(buffer_count(bytes_moved // 2))]
    graphs, verdicts = {}, {}
    for launch in [None] + args.candidates:
        name = label(launch)
        try:
            verdicts[name] = "ok" if torch.equal(rotate(source.clone(), launch), want) else "WRONG"
            turns = itertools.cycle(buffers)
            graphs[name] = captured_launches(lambda launch=launch: rotate(next(turns), launch), LAUNCHES_PER_GRAPH)
        except Exception as why:   # noqa: BLE001 - a launch this GPU cannot compile or run is not a candidate
            print(f"{name:<30} fails: {str(why).splitlines()[0][:80]}")
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)
    peak = peak_bandwidth_tbs(torch.cuda.get_device_name())
    print(f"{torch.cuda.get_device_name()}: RoPE of q and k, {args.rows} rows x {args.rotated_heads} heads of "
          f"{args.head_dim} ({args.preset}), {args.dtype}; us per launch (graph of {LAUNCHES_PER_GRAPH}, median of "
          f"{ROUNDS} rounds)")
    rows = []
    for name, ms in sorted(times.items(), key=lambda item: (item[0] != label(None), item[1])):
        us = 1000.0 * ms / LAUNCHES_PER_GRAPH
        share = f"{bytes_moved / us / 1e6 / peak:6.1%}" if peak else "     -"
        print(f"{name:<30} {us:8.1f} us  {bytes_moved / us / 1e3:7.0f} GB/s {share}  {verdicts[name]}")
        rows.append({"launch": name, "us_per_launch": us, "gb_per_s": bytes_moved / us / 1e3,
                     "check": verdicts[name]})
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "version 4's RoPE kernel (rotate_qk_) under candidate launches, graph of "
                         f"{LAUNCHES_PER_GRAPH} launches, median of {ROUNDS} interleaved rounds",
            "command": "python version4_triton_ultra/" + command_line("tune_qk_rotation.py", argv),
            "environment": software_and_gpu(), "preset": args.preset, "dtype": args.dtype, "rows": args.rows,
            "rotated_heads": args.rotated_heads, "head_dim": args.head_dim, "bytes_per_launch": bytes_moved,
            "peak_bandwidth_tbs": peak, "results": rows})
        print(f"results: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
