"""Per-kernel microbenchmarks: each Triton op of versions 3 and 4 against the PyTorch code it replaces.

version3_triton/run_triton_profiling.py and version4_triton_ultra/run_kernel_benchmarks.py only describe
their ops (how to make inputs, the PyTorch and the Triton implementation, a byte model) as `OpBench`
objects (ops.py) and call `main()` (cli.py), which does everything else: the command line, the correctness
check (correctness.py), the timing (timing.py), the tables (tables.py) and the JSON file. Both scripts therefore
measure in exactly the same way. (Whole training runs are compared by benchmarks/, not here.)

What one table row means
    op, direction (fwd / bwd, and fwd+bwd for an op whose forward already computes the gradients), the
    PyTorch implementation compared, PyTorch time, Triton time (median microseconds per call), speed-up
    (PyTorch time / Triton time) and the Triton kernel's achieved bandwidth: bytes of the op's byte model
    divided by the Triton time. The byte model counts the bytes an op must read and write at least once (each
    input read once, each output written once, nothing re-read); each op states its model in a comment and the
    table's footnote prints it. A kernel that reaches the device's peak bandwidth on that count is as fast as
    a copy of its data, which is the best a memory-bound op can do.

No GPU: there is nothing to time; the scripts say so in one line and, with --check, run the comparison in
Triton's CPU interpreter at a small size (the scripts enable the interpreter before triton is imported).
"""
