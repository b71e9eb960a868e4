"""The peer of the benchmarks: Hugging Face's LlamaForCausalLM trained by the workshop's own harness.

The model most practitioners would train instead of ours, from the same canonical weights (the same function:
tests/test_hf_peer.py), on the same data, schedule and timing as every version, so a row of it is comparable to a
row of ours. Options: torch.compile of the Hugging Face model, and Liger-Kernel's Triton RMSNorm, RoPE, SwiGLU
and fused linear cross-entropy patched in (Liger-Kernel's own `apply_liger_kernel_to_llama`).

    python benchmarks/hf_llama.py --preset small --use-amp                         (hf)
    python benchmarks/hf_llama.py --preset small --use-amp --enable-torch-compile  (hf+compile)
    python benchmarks/hf_llama.py --preset small --use-amp --liger                 (hf+liger)
    python benchmarks/hf_llama.py --preset small --use-amp --liger --enable-torch-compile
                                                  (hf+liger+compile: the decoder compiled, Liger's loss eager)

Needs `pip install -r requirements-peers.txt` (transformers; liger-kernel for --liger); without it, one line
says so. benchmarks/compare_versions.py runs it as the rows hf, hf+compile, hf+liger and hf+liger+compile.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import VersionSpec, run  # noqa: E402
from tinytransformer.config import ConfigError  # noqa: E402
from tinytransformer.hf.model import HFTinyLlama, apply_liger, require_liger, require_transformers  # noqa: E402
from tinytransformer.precision import (  # noqa: E402
    add_tf32_arguments, apply_tf32_argument, describe_float32_matmuls)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def add_arguments(group):
    group.add_argument("--liger", action="store_true", default=False,
                       help="patch in Liger-Kernel's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear "
                            "cross-entropy)")
    group.add_argument("--enable-torch-compile", action="store_true", default=False,
                       help="compile the Hugging Face model with torch.compile (first steps are slow: compilation)")
    group.add_argument("--torch-compile-mode", choices=COMPILE_MODES, default="default",
                       help="reduce-overhead replays CUDA/HIP graphs")
    # The same TF32 switch as versions 2 and 4, so that a float32 row of the peer does the arithmetic of theirs.
    add_tf32_arguments(group)


def check_arguments(args, device):
    require_transformers()   # one line with the install command, before anything is built
    apply_tf32_argument(args, device)
    if args.liger:
        require_liger()
        if device.type != "cuda":
            raise ConfigError("--liger needs a GPU: Liger-Kernel's Triton kernels do not run in Triton's CPU "
                              "interpreter")


def build_model(config, args):
    model = HFTinyLlama(config)
    if args.liger:
        apply_liger(model)
    if args.enable_torch_compile:
        # Compiles the module's forward (and, through AOTAutograd, its backward) in place. With Liger-Kernel, only
        # the decoder (embedding, layers, final norm): Liger's fused linear cross-entropy cannot be traced by
        # torch.compile on GPUs with PyTorch >= 2.8 (its float32 grad_weight accumulation dispatches to
        # aten.addmm.dtype_out, which fake tensors and Inductor reject: Liger-Kernel issue #1327), and it is
        # Liger's own Triton kernels either way, so it runs eagerly after the compiled decoder.
        target = model.hf.model if args.liger else model.hf
        target.compile(mode=args.torch_compile_mode)
    return model


def describe(args) -> dict:
    import transformers
    kernels = "Liger-Kernel (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)" if args.liger else "PyTorch's (SDPA)"
    compiled = f"torch.compile(mode={args.torch_compile_mode})" if args.enable_torch_compile else "eager"
    if args.enable_torch_compile and args.liger:
        compiled += " of the decoder; Liger's fused loss eager"
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    return {"model": f"transformers {transformers.__version__} LlamaForCausalLM", "kernels": kernels,
            "execution": compiled, "matmuls": describe_float32_matmuls(args, on_gpu)}


SPEC = VersionSpec(name="hf", title="Hugging Face LlamaForCausalLM", build_model=build_model,
                   add_arguments=add_arguments, check_arguments=check_arguments, describe=describe)


def main(argv=None):
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
