"""PyTorch profiler of version 3: a short training run with tables of operators, kernels and phases.

Run:   python run_pytorch_profiler.py [training flags] [--profile-dir DIR] [--sort-by KEY] [--limit N]
       python run_pytorch_profiler.py --analyze-existing pytorch_profiles/     (no training, no GPU needed)
All the work is shared by every version: tinytransformer/profiling/pytorch_profiler_cli.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.profiling.pytorch_profiler_cli import pytorch_profiler_main  # noqa: E402
from version3_triton.tiny_llama_v3 import SPEC  # noqa: E402

if __name__ == "__main__":
    sys.exit(pytorch_profiler_main(SPEC, sys.argv[1:]))
