#!/usr/bin/env bash
# Runs rocprof-compute (modes: profile, roofline, analyze) on tiny_llama_v4.py; options: --help.
# Usage: bash run_rocprof_compute.sh [OPTIONS] -- --batch-size 8 --seq-len 128 --num-steps 30
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_rocprof_compute.sh" --script "$here/tiny_llama_v4.py" "$@"
