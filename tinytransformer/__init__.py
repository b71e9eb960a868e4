"""TinyTransformer's shared harness: everything that is not the model (CLI, data, timing, profiling)."""

# The workshop's edition (year.month.patch); pyproject.toml reads it from here, and the README quotes it.
__version__ = "2026.11.0"
