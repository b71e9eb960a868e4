"""Helpers to prove two versions compute the same model: same canonical weights in, same logits, loss, gradients out.

They live in tinytransformer/equivalence.py, shared with benchmarks/validate_numerical_accuracy.py.
"""
from tinytransformer.equivalence import (canonical, compare, forward_backward, random_batch,  # noqa: F401
                                         rel_err, relative_errors)
