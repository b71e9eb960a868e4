"""The candidate launches a tuner of version 4 takes on its command line: "A,B,C", each a power of two.

tune_qk_rotation.py (ROWS,HEADS,WARPS), tune_adamw.py (ELEMENTS,WARPS) and tune_cross_entropy.py (BLOCK_V,WARPS)
read their --candidates with these two functions, and tune_norm_backward.py (whose candidates have a field that
is not a power of two) with the second, so a bad one is refused the same way by each: one line naming the flag,
exit status 2, before anything is built or compiled.
"""
from __future__ import annotations

from typing import Callable


def powers_of_two(text: str, fields: str, example: str) -> tuple:
    """The integers of `text`, one per comma-separated name of `fields` (e.g. "ELEMENTS,WARPS"), each a power of
    two; ValueError otherwise, saying what was expected (`example` is a good value)."""
    parts = text.split(",")
    if len(parts) != len(fields.split(",")) or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0
                                                       for p in parts):
        raise ValueError(f"expected {fields}, each a power of two (e.g. {example}), got {text!r}")
    return tuple(int(p) for p in parts)


def candidates_from_flags(parser, texts: list[str] | None, parse: Callable[[str], tuple], default: list) -> list:
    """--candidates parsed one by one with `parse` (the default list when the flag is absent); a bad one is the
    parser's one-line error."""
    if not texts:
        return list(default)
    try:
        return [parse(text) for text in texts]
    except ValueError as why:
        parser.error(f"--candidates: {why}")
