"""Does version 4's norm backward keep one layout in its loop? Compiled for GPUs this machine need not have.

    python -m benchmarks.kernel_report.norm_layouts                    (sm_90 and gfx942, the presets' widths)
    python -m benchmarks.kernel_report.norm_layouts --targets sm_90

Triton gives each tensor of a kernel a layout: which thread holds which elements. A load or store gets the layout
that moves 16 bytes a thread, so a float32 tensor gets 4 columns a thread and a bfloat16 one 8. Under bfloat16
autocast the add + RMSNorm backward's tile mixes both (the float32 residual stream and its gradient, the bfloat16
gradient of the norm's output and the bfloat16 copy it writes), and when two layouts meet, the compiler moves the
tensor from one to the other through shared memory (a `ttg.convert_layout` in the IR, with a barrier). Once per
program that costs little; once per tile of the program's loop it costs every tile. kernels/add_rmsnorm.py gives
the whole tile one vector width (`_shared_vector`) to keep such moves out of the loop.

This command records the backward's launch in the bfloat16 step's form at each preset's width, exactly as the
kernel's rules choose it for each target, compiles it, and counts the layout moves inside loops in Triton's
GPU-level IR (ttgir), with the registers and the occupancy they allow. It exits 1 if a loop has a move.
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

WIDTHS = (256, 512, 1024, 2048)   # the tiny, small, medium and large presets' hidden sizes
ROWS = 8192                       # the medium and large presets' batch x sequence
LAYOUT_MOVE = "ttg.convert_layout"


def layout_moves_in_loops(ttgir: str) -> int:
    """How many layout moves lie inside a loop (`scf.for` or `scf.while`) of the ttgir text. Every region of the IR
    opens with a line ending in '{' and closes with a line starting with '}' (`} else {` does both), so a stack of
    the open regions tells whether a line is inside a loop."""
    regions, moves = [], 0
    for line in (raw.strip() for raw in ttgir.splitlines()):
        if line.startswith("}"):
            regions.pop()
        if LAYOUT_MOVE in line and any(regions):
            moves += 1
        if line.endswith("{"):
            regions.append("scf.for" in line or "scf.while" in line)
    return moves


def record_backward_launches(gpu, norm) -> list:
    """The backward's launch at each width, as version 4's bfloat16 step makes it: h and the residual's gradient
    in float32, the norm output's gradient in bfloat16, and the bfloat16 copy of grad_h written."""
    launches = []
    for width in WIDTHS:
        with discovery.recording(gpu, launches, [f"{width} features"]):
            h, grad_residual = torch.empty(ROWS, width), torch.empty(ROWS, width)
            grad_normed = torch.empty(ROWS, width, dtype=torch.bfloat16)
            norm._rms_norm_backward(h, torch.empty(width), torch.empty(ROWS), grad_normed, grad_residual,
                                    copy_dtype=torch.bfloat16)
    return launches


def rows_for(target_name: str, norm) -> list[dict]:
    target = TARGETS[target_name]
    compiled = distinct_launches(record_backward_launches(target.gpu, norm), target, "bfloat16 step", {})
    rows = []
    for result, arguments in compiled.values():
        result = compile_one(result, arguments, target)
        row = analyse(result, target)
        row["layout_moves_in_loops"] = layout_moves_in_loops(result.asm.get("ttgir", ""))
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    config = row["config"]
    launch = f"{config['BLOCK_ROWS']}x{config['BLOCK_D']} w{config['num_warps']} vector {config.get('VECTOR', 0)}"
    if row["status"] != OK:
        return f"{row['target']:<7} {launch:<24} {row['status']}: {row['error']}"
    occupancy = f"{row['occupancy']['value']}/{row['occupancy']['max']} {row['occupancy']['unit']}"
    return (f"{row['target']:<7} {launch:<24} registers {row['registers']:<4} {occupancy:<24} "
            f"layout moves in the loop: {row['layout_moves_in_loops']}")


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.kernel_report.norm_layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="sm_90,gfx942", help=f"comma-separated, from {','.join(TARGETS)} "
                                                                  "[sm_90,gfx942]")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    targets = targets_from_flag(parser, args.targets)
    discovery.import_versions()   # defines the kernels for a GPU, not for the interpreter
    from version4_triton_ultra.kernels import add_rmsnorm as norm
    rows = [row for target in targets for row in rows_for(target, norm)]
    for row in rows:
        print(describe(row))
    failed = [row for row in rows if row["status"] != OK or row["layout_moves_in_loops"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} launches compile with no layout move inside a loop")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
