#!/usr/bin/env bash
# Runs rocprofv3 kernel trace + top-kernels table on tiny_llama_v3.py; options: --help.
# Usage: bash run_rocprofv3.sh [OPTIONS] -- --batch-size 8 --seq-len 128 --num-steps 30
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_rocprofv3.sh" --script "$here/tiny_llama_v3.py" "$@"
