#!/usr/bin/env bash
# torch's CPU-only build: at the version constraints.txt pins (the command README's set-up shows,
#   pip install torch==VERSION --index-url https://download.pytorch.org/whl/cpu),
# or, with the argument `newest`, the newest release (scripts/update_constraints.sh moves the pins with it).
# A machine that keeps the pinned wheel in a local wheel directory (pip's find-links, e.g. PIP_FIND_LINKS) installs
# it from there without the network; otherwise it comes from PyTorch's CPU index. Without either, pip would take
# the default CUDA build (several GB), which a CPU-only machine does not need.
set -euo pipefail
cd "$(dirname "$0")/.."
cpu_index=https://download.pytorch.org/whl/cpu
if [ "${1:-}" = newest ]; then
    python3 -m pip install -q --upgrade torch --index-url "$cpu_index"
    exit 0
fi
torch_version="$(sed -n 's/^torch==//p' constraints.txt)"
if ! python3 -m pip install -q --no-index "torch==$torch_version" 2>/dev/null; then
    python3 -m pip install -q "torch==$torch_version" --index-url "$cpu_index"
fi
