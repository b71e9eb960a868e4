"""TinyTransformer's shared harness: everything that is not the model (CLI, data, timing, profiling)."""
