"""FLOPs of version 4 counted by DeepSpeed and by formula, then achieved TFLOP/s and MFU of timed steps.

Run:   python run_deepspeed_flops.py [training flags] [--output-dir DIR] [--timing-steps N]
                                     [--computational-intensity] [--generate-roofline]
       python run_deepspeed_flops.py --analyze-results flops_analysis/flops_profile.json
All the work is shared by every version: tinytransformer/profiling/deepspeed_flops_cli.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.profiling.deepspeed_flops_cli import deepspeed_flops_main  # noqa: E402
from version4_triton_ultra.tiny_llama_v4 import SPEC  # noqa: E402

if __name__ == "__main__":
    sys.exit(deepspeed_flops_main(SPEC, sys.argv[1:]))
