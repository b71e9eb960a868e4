"""The roofline plot of run_deepspeed_flops.py --generate-roofline: each matrix product of a layer at the ceiling
its arithmetic intensity allows, and the measured training step as a line.

The roof is min(peak FLOP/s, intensity x memory bandwidth); the ridge point, where the two meet, separates
memory-bound products (left) from compute-bound ones (right). The intensities are tinytransformer/flops.py's.
"""
from __future__ import annotations

from pathlib import Path

from ..outputs import load_pyplot


def write_roofline(path: Path, peak_tflops: float, bandwidth_tbs: float, rows: list[dict],
                   achieved_tflops: float | None, title: str) -> str | None:
    """Draw the roofline with each matrix product at its attainable ceiling; None when matplotlib is absent."""
    plt = load_pyplot()
    if plt is None:
        return None
    ridge = peak_tflops / bandwidth_tbs
    intensities = [row["flops_per_byte"] for row in rows]
    low, high = min(intensities + [ridge]) / 4, max(intensities + [ridge]) * 4
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    figure, axes = plt.subplots(figsize=(9, 6))
    axes.loglog(xs, [min(peak_tflops, x * bandwidth_tbs) for x in xs], color="black",
                label=f"roof: {bandwidth_tbs} TB/s x intensity, capped at {peak_tflops:g} TFLOP/s")
    # Products with the same intensity (q, k, v, o; gate, up, down) share one point and one label.
    names_at: dict[float, list[str]] = {}
    for row in rows:
        names_at.setdefault(round(row["flops_per_byte"], 6), []).append(row["matmul"])
    for intensity, names in sorted(names_at.items()):
        ceiling = min(peak_tflops, intensity * bandwidth_tbs)
        axes.scatter([intensity], [ceiling], zorder=3)
        axes.annotate(", ".join(names), (intensity, ceiling), fontsize=8, xytext=(8, -4),
                      textcoords="offset points")
    if achieved_tflops:
        axes.axhline(achieved_tflops, linestyle="--", color="tab:red",
                     label=f"measured: whole training step, {achieved_tflops:.3g} TFLOP/s")
    axes.axvline(ridge, linestyle=":", color="gray", label=f"ridge point {ridge:.0f} FLOP/byte")
    axes.set_xlabel("arithmetic intensity (FLOP/byte)")
    axes.set_ylabel("attainable TFLOP/s")
    axes.set_title(title)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return str(path)
