"""The command line that version 4's tuners and kernel comparisons share, so that each refuses bad input the same way:
one line naming the flag, exit status 2, before anything is built or compiled.

Candidate launches ("A,B,C", each a power of two): tune_qk_rotation.py (ROWS,HEADS,WARPS), tune_adamw.py
(ELEMENTS,WARPS) and tune_cross_entropy.py (BLOCK_V,WARPS) read their --candidates with powers_of_two and
candidates_from_flags; tune_norm_backward.py and tune_attention_tiles.py (whose candidates have a field that is not
a power of two) with the second only. --output-json is proven writable up front (prove_output_json), and a machine
without a GPU is refused (refuse_without_gpu) by every one of them. A row that cannot run (a backend this build
lacks, a launch too large for the GPU) says why in one line: why_unavailable (compare_attention_backends.py,
benchmarks/compare_gemm_backends.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from tinytransformer.config import ConfigError
from tinytransformer.paths import prove_output_file


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


def prove_output_json(parser, path: str | None) -> None:
    """--output-json, when given, proven writable now (before minutes of compiling and timing); else the parser's
    one-line error."""
    if path:
        try:
            prove_output_file(path, "--output-json")
        except ConfigError as why:
            parser.error(str(why))


def refuse_without_gpu(parser) -> None:
    """The parser's one-line error on a machine without a GPU: timings in Triton's CPU interpreter mean nothing."""
    if not torch.cuda.is_available():
        parser.error("needs a GPU (CUDA or ROCm): timings in Triton's CPU interpreter say nothing about one")


def why_unavailable(why: Exception) -> str:
    """Why a row could not run, in one line for its table: the error's first line (at most 120 characters), or
    the error's type when it has no message."""
    text = str(why).strip()
    return text.splitlines()[0][:120] if text else type(why).__name__
