#!/usr/bin/env bash
# rocprofv3 on tiny_llama_v3.py, tracing only the Triton kernels: --triton-only filters with the
# @triton.jit function names found here (Triton names each GPU kernel after its Python function).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/../profilers/run_rocprofv3.sh" --script "$here/tiny_llama_v3.py" --triton-only "$@"
