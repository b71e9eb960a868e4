#!/usr/bin/env bash
# Runs Nsight Compute (ncu) counters of a few GEMM/Triton kernels on tiny_llama_v3.py; options: --help.
# Usage: bash run_ncu.sh [OPTIONS] -- --batch-size 8 --seq-len 128 --num-steps 30
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_ncu.sh" --script "$here/tiny_llama_v3.py" "$@"
