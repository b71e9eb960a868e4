#!/usr/bin/env bash
# Runs Nsight Systems (nsys) timeline + GPU-kernel summary on tiny_llama_v4.py; options: --help.
# Usage: bash run_nsys.sh [OPTIONS] -- --batch-size 8 --seq-len 128 --num-steps 30
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_nsys.sh" --script "$here/tiny_llama_v4.py" "$@"
