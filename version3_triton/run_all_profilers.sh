#!/usr/bin/env bash
# Runs every profiler (timed run, PyTorch, DeepSpeed, rocprofv3, rocprof-sys, rocprof-compute, nsys, ncu) on tiny_llama_v3.py; options: --help.
# Usage: bash run_all_profilers.sh [OPTIONS] -- --batch-size 8 --seq-len 128 --num-steps 30
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_all_profilers.sh" --script "$here/tiny_llama_v3.py" "$@"
