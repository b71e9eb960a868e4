"""README's data-parallel table, from the weak-scaling results that benchmarks/scaling.py wrote.

Every row of every JSON file in benchmarks/results/scaling/ becomes one line: what ran (version, torch.compile,
how the gradients were averaged), the machine, and the figures scaling.py measured. make_readme_table.py puts the
table between README's scaling markers, so no scaling figure in the README is typed by hand.
"""
from pathlib import Path

from result_formats import read_scaling
from table_format import fmt, markdown_header, markdown_row, percent

PRESET_ORDER = ("tiny", "small", "medium", "large")


def averaging(results: dict, row: dict) -> str:
    """How the gradients were averaged over the ranks: DDP, DeepSpeed's ZeRO stage, or version 4's own
    all-reduces inside its graph-captured step; nothing for a plain process (no torchrun)."""
    if row.get("launcher") == "none":
        return "one process, nothing to average"
    if results["engine"] == "deepspeed":
        return f"DeepSpeed ZeRO-{results['zero_stage']}"
    if row.get("gradients_averaged_by") == "step":
        return "all-reduce in its graph"
    return "DDP"


def flag_value(flags: list, name: str) -> str | None:
    """The value of `name` among flags passed through to the runs ('--name value' or '--name=value'), or None."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def what_ran(results: dict, row: dict) -> str:
    flags = results.get("extra_flags", [])
    compiled = " + torch.compile" if "--enable-torch-compile" in flags else ""
    reduce_dtype = flag_value(flags, "--grad-reduce-dtype")
    summed = f", summed in {reduce_dtype}" if reduce_dtype and reduce_dtype != "float32" else ""
    return f"{row['version']}{compiled}, {averaging(results, row)}{summed}"


def machine(results: dict) -> str:
    """'2 x H100' from the GPU's name ('NVIDIA H100 80GB HBM3') and how many the run could see."""
    env = results["environment"]
    name = env.get("gpu", "CPU").replace("NVIDIA ", "").replace("AMD ", "").split()[0]
    return f"{env.get('gpus_visible', 1)} x {name}"


def gpus_cell(row: dict) -> str:
    return "1 (no torchrun)" if row.get("launcher") == "none" else str(row["gpus"])


def runs_cell(row: dict) -> str:
    """'1', or 'median of 3' where scaling.py --repeats ran the point several times."""
    runs = len(row.get("repeats_samples_per_s") or [None])
    return f"median of {runs}" if runs > 1 else "1"


def table_line(results: dict, row: dict, file_name: str) -> str:
    if "error" in row:
        return f"| {what_ran(results, row)} | {row['preset']} | {gpus_cell(row)} | failed: {row['error']} |"
    cells = (what_ran(results, row), row["preset"], gpus_cell(row), str(row["global_batch_size"]),
             fmt(row["samples_per_s"], ",.0f"), fmt(row["median_step_ms"], ".2f"), fmt(row.get("speedup"), ".2f", "x"),
             percent(row.get("efficiency")), percent(row.get("mfu")),
             fmt(row.get("peak_memory_mib_per_gpu"), ",.0f"), machine(results), runs_cell(row),
             f"`{file_name}`")
    return markdown_row(cells)


def scaling_table(directory: Path) -> str:
    """One markdown table of every row in directory/*.json, by preset, then machine, then what ran."""
    entries = []
    for path in sorted(directory.glob("*.json")):
        results = read_scaling(path)
        for row in results["rows"]:
            order = PRESET_ORDER.index(row["preset"]) if row["preset"] in PRESET_ORDER else len(PRESET_ORDER)
            key = (order, machine(results), what_ran(results, row), row["gpus"], row.get("launcher") != "none")
            entries.append((key, table_line(results, row, path.name)))
    if not entries:
        return "No committed scaling results yet: run `benchmarks/scaling.py --output-dir ...`."
    header = ("what ran, gradients averaged by", "preset", "GPUs", "global batch", "samples/s", "step ms",
              "speed-up", "efficiency", "MFU", "MiB/GPU", "machine", "runs", "file")
    return "\n".join(markdown_header(header) + [line for _, line in sorted(entries, key=lambda e: e[0])])
