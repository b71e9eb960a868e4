"""The benchmark's tables: the correctness table, the timing table, and the footnote that says how to read it."""
from __future__ import annotations

import textwrap

import torch

from ..device import peak_bandwidth_tbs
from ..precision import tf32_enabled
from .ops import BenchShape, OpBench, dtype_name
from .timing import MAX_INPUT_SETS, REP_MS, WARMUP_MS

SMALL_OP_BYTES = 32 * 2**20   # below this an op's HBM time (~10 us on an H100) is comparable to launch costs
FOOTNOTE_WIDTH = 110


def format_timing_table(rows: list[dict]) -> str:
    header = (f"{'op':<22}{'dir':<9}{'PyTorch':<26}{'PyTorch us':>12}{'Triton us':>12}{'speed-up':>10}"
              f"{'Triton GB/s':>13}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:<22}{r['direction']:<9}{r['pytorch']:<26}{r['pytorch_us']:>12.1f}"
                     f"{r['triton_us']:>12.1f}{r['speedup']:>9.2f}x{r['triton_gbps']:>13.1f}")
    return "\n".join(lines)


def format_check_table(rows: list[dict]) -> str:
    header = f"{'op':<22}{'tensor':<20}{'Triton err':>12}{'PyTorch err':>13}{'tolerance':>11}  result"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['op']:<22}{r['tensor']:<20}  {r['skipped']}")
            continue
        lines.append(f"{r['op']:<22}{r['tensor']:<20}{r['triton_error']:>12.2e}{r['pytorch_error']:>13.2e}"
                     f"{r['tolerance']:>11.0e}  {'ok' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def footnote(ops: list[OpBench], shape: BenchShape, device_name: str, set_counts: dict) -> str:
    """How to read the table: the timing method, the input rotation and every byte model, with its bytes."""
    def paragraph(text, indent="  "):
        return textwrap.fill(text, width=FOOTNOTE_WIDTH, subsequent_indent=indent)

    peak = peak_bandwidth_tbs(device_name)
    peak_text = (f"this device's data-sheet peak is {peak * 1000:.0f} GB/s" if peak
                 else "this device's peak bandwidth is not in tinytransformer/device.py")
    lines = [
        paragraph(f"Times: median of triton.testing.do_bench (warmup {WARMUP_MS} ms, rep {REP_MS} ms, L2 "
                  "flushed before every call). fwd = the forward with autograd recording; bwd = "
                  "torch.autograd.grad(..., retain_graph=True) on a graph built outside the timed call. "
                  "speed-up = PyTorch us / Triton us."),
        paragraph("Input sets: where the data one call reads (inputs; for bwd also the saved tensors and "
                  "incoming gradients) fits in L2, the calls rotate through enough fresh sets to fill twice "
                  f"the L2 cache, at most {MAX_INPUT_SETS}. Most sets used per op: "
                  + ", ".join(f"{name} {count}" for name, count in set_counts.items())
                  + " (per row in --output-json)."),
        paragraph(f"Triton GB/s = byte model / Triton time; {peak_text}. Byte models: N = B*S tokens, "
                  f"e = {shape.e} bytes per {dtype_name(shape.dtype)} element, q/k/v of all heads hold N*D "
                  "elements; rstd, lse and grad_weight sums are float32 (4 bytes), targets int64 (8 bytes):"),
    ]
    for op in ops:
        for direction, (formula, _) in op.byte_model.items():
            lines.append(f"  {op.name} {direction}: {formula} = {op.bytes_moved(shape, direction):,} bytes")
        if op.note:
            lines.append(paragraph(f"  note ({op.name}): {op.note}", indent="    "))
    if shape.dtype == torch.float32 and any(op.tf32_dots for op in ops):
        lines.append(paragraph(
            "float32: Triton's flash attention multiplies through TF32 tensor cores on NVIDIA (as in versions 3 "
            "and 4); the PyTorch matmuls keep torch's setting (TF32 "
            f"{'on' if tf32_enabled() else 'off'}). Compare float16/bfloat16 for equal matmul precision."))
    largest = max(op.bytes_moved(shape, d) for op in ops for d in op.directions)
    if largest < SMALL_OP_BYTES:
        lines.append(paragraph(
            f"No op here moves more than {largest / 2**20:.3g} MiB per call, a few microseconds of HBM time: "
            "fixed launch and ramp-up costs weigh heavily and GB/s stays well below peak; a larger "
            "--batch-size / --seq-len shows each kernel's bandwidth limit."))
    return "\n".join(lines)
