"""Formatting shared by the benchmark scripts: numbers that may be missing, markdown table rows, the no-plot note.

The plots themselves load matplotlib through tinytransformer.outputs.load_pyplot.
"""


def fmt(value, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec` (plus suffix), or "n/a" when it is missing (None, or not a number)."""
    return format(value, spec) + suffix if isinstance(value, (int, float)) else "n/a"


def percent(fraction) -> str:
    """A fraction as a percentage with one decimal ("89.8%"), or "n/a" when it is missing."""
    return fmt(100 * fraction if isinstance(fraction, (int, float)) else None, ".1f", "%")


def markdown_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_header(columns, align: str = "---") -> list[str]:
    """The header row and the separator row of a markdown table."""
    return [markdown_row(columns), "|" + f"{align}|" * len(columns)]


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): no plot written"
