"""Version 4's attention kernels under their 16-bit launch choices, compiled for a GPU this machine need not have.

    python -m benchmarks.kernel_report.attention_tiles                  (sm_90, head dims 64 and 128, bfloat16)
    python -m benchmarks.kernel_report.attention_tiles --targets sm_90,sm_80,gfx942

The kernel report (python -m benchmarks.kernel_report) compiles what a float32 training step launches. The size
presets are benchmarked in bfloat16 (--use-amp), where version 4's attention picks other tiles on Hopper-class
GPUs: pipelined 64 x 64 tiles (kernels/flash_attention.py: _hopper_launch_config), whose shared memory grows with
every stage. This command records the launches of the packed attention's forward (with and without RoPE on load)
and backward at the medium and large presets' head dims, exactly as the kernels' own rule chooses them for each
target, compiles each for that target and says whether it fits the target's shared memory. A GPU would refuse
a launch that does not fit only when it runs: here it is found on any machine.

It runs in a process of its own (see discovery.py); tests start it as a process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, also when run as a file

from benchmarks.kernel_report import discovery  # noqa: E402
from benchmarks.kernel_report.compile import compile_one, distinct_launches  # noqa: E402
from benchmarks.kernel_report.report import OK, analyse  # noqa: E402
from benchmarks.kernel_report.targets import TARGETS, targets_from_flag  # noqa: E402
from tinytransformer.cli import OneLineParser  # noqa: E402

HEAD_DIMS = (64, 128)   # the medium and large presets' (hidden / heads)


def record_attention_launches(gpu, head_dim: int, dtype: torch.dtype, fa) -> list:
    """The kernel launches of one packed forward without RoPE, one with RoPE on load, and one backward."""
    launches, label = [], [f"head dim {head_dim}"]
    heads, seq_len = 2, 256
    with discovery.recording(gpu, launches, label):
        qkv = torch.empty(1, seq_len, 3 * heads * head_dim, dtype=dtype)
        grad_out = torch.empty(1, seq_len, heads * head_dim, dtype=dtype)
        rope = (torch.empty(seq_len, head_dim), torch.empty(seq_len, head_dim))
        out, lse = fa.packed_attention_forward(qkv, heads)
        fa.flash_attention_packed(qkv, heads, rope=rope)      # the forward with RoPE on load
        fa.packed_attention_backward(qkv, out, lse, grad_out, heads, rope=rope)
    return launches


def rows_for(target_name: str, dtype: torch.dtype, fa) -> list[dict]:
    target = TARGETS[target_name]
    compiled = {}
    for head_dim in HEAD_DIMS:
        distinct_launches(record_attention_launches(target.gpu, head_dim, dtype, fa), target,
                          f"head dim {head_dim}", compiled)
    return [analyse(compile_one(result, arguments, target), target) for result, arguments in compiled.values()]


def describe(row: dict) -> str:
    config = row["config"]
    tiles = f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"
    used = f"{row['shared_bytes'] // 1024} KiB shared" if "shared_bytes" in row else row["error"]
    rope = "RoPE on load" if config.get("ROPE") else "no RoPE"
    return (f"{row['target']:<7} {row['kernel']:<38} Dh {config['HEAD_DIM']:<4} {rope:<13} {tiles:<13} "
            f"{row['status']:<13} {used}")


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.kernel_report.attention_tiles",
                           description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="sm_90", help=f"comma-separated, from {','.join(TARGETS)} [sm_90]")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    targets = targets_from_flag(parser, args.targets)
    discovery.import_versions()   # defines the kernels for a GPU, not for the interpreter
    from version4_triton_ultra.kernels import flash_attention as fa
    rows = [row for target in targets for row in rows_for(target, getattr(torch, args.dtype), fa)]
    for row in rows:
        print(describe(row))
    failed = [row for row in rows if row["status"] != OK]
    print(f"{len(rows) - len(failed)} of {len(rows)} launch configurations compile and fit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
