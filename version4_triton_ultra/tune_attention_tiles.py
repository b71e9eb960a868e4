"""Time version 4's flash-attention kernels under other tiles at one shape, and check each against float64.

    python tune_attention_tiles.py                                     (the large preset's: 8 x 16 x 1024, Dh 128)
    python tune_attention_tiles.py --shape 16x16x512 --head-dim 64     (the medium preset's)
    python tune_attention_tiles.py --kernels dq,dkdv --dtype float16
    python tune_attention_tiles.py --others portable                   (the other kernels on version 3's tiles)
    python tune_attention_tiles.py --shape 16x16x512 --head-dim 64 --kernels dkdv --candidates 32,128,4,3 32,128,4,5

kernels/flash_attention.py launches its three kernels with FIXED tiles, warps and pipeline stages
(`_launch_config`). This script replaces one kernel's choice at a time (the other two keep theirs), times the
pass that kernel belongs to (the forward: one kernel; the backward: dq then dk/dv, RoPE rotated back as the
model's backward does) with the kernel benchmark's median of triton.testing.do_bench, and runs the same pass on a
one-sequence, two-head problem of the same length against attention computed in float64. A configuration is worth
adopting only if it is faster AND right: the "error" column is the largest relative error of out (forward) or of
dq, dk, dv (backward), and "WRONG" marks one above the tolerance the kernel tests use. The first row of each
kernel is the tiles it runs with now, the others a built-in list per kernel or --candidates (tried for every
kernel of --kernels). --others says what the kernels not being tuned run with: `current` (the
module's rule on this GPU) or `portable` (version 3's rule, as they ran when the Hopper tiles were chosen:
benchmarks/results/kernel_time/h100_attention_tiles_by_shape.json). Needs a GPU (version 3's
tune_flash_attention.py is the same idea for its kernels, timed from CUDA graphs).
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser  # noqa: E402
from tinytransformer.kernel_bench.correctness import dots_tolerance, relative_error  # noqa: E402
from tinytransformer.kernel_bench.timing import median_ms  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import candidates_from_flags, refuse_without_gpu  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from version4_triton_ultra.kernels import flash_attention as fa  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (BLOCK_M, BLOCK_N, num_warps, num_stages); for dk/dv BLOCK_N is the keys a program owns, BLOCK_M the query step.
CANDIDATES = {
    "forward": [(64, 32, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (128, 128, 8, 1), (64, 64, 4, 2), (64, 64, 4, 3),
                (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 4), (128, 64, 8, 4)],
    "dq": [(32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 4, 1), (64, 64, 8, 1), (128, 64, 8, 1), (128, 32, 8, 1),
           (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)],
    "dkdv": [(32, 32, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (64, 64, 8, 1), (64, 128, 8, 1), (32, 128, 8, 1),
             (32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
}


def tiles_of(text: str) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from "M,N,W,S"; ValueError saying what was expected otherwise.
    Blocks are powers of two from 16 (the smallest tile tl.dot takes) to 256, warps a power of two up to 16 (the
    most wavefronts of 64 an AMD workgroup holds), stages 1 to 8."""
    parts = text.split(",")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        block_m, block_n, warps, stages = (int(p) for p in parts)
        blocks_ok = all(16 <= b <= 256 and b & (b - 1) == 0 for b in (block_m, block_n))
        if blocks_ok and 1 <= warps <= 16 and warps & (warps - 1) == 0 and 1 <= stages <= 8:
            return block_m, block_n, warps, stages
    raise ValueError(f"expected BLOCK_M,BLOCK_N,WARPS,STAGES (blocks powers of two from 16 to 256, warps a power of "
                     f"two up to 16, stages 1 to 8; e.g. 64,64,4,2), got {text!r}")


def parse_args(argv):
    parser = OneLineParser(prog="tune_attention_tiles.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x16x1024", help="batch x heads x sequence [8x16x1024]")
    parser.add_argument("--head-dim", type=int, choices=fa.SUPPORTED_HEAD_DIMS, default=128)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--kernels", default="forward,dq,dkdv", help="comma-separated, from forward,dq,dkdv [all]")
    parser.add_argument("--others", choices=["current", "portable"], default="current",
                        help="tiles of the kernels not being tuned: this GPU's rule, or version 3's [current]")
    parser.add_argument("--candidates", nargs="+", metavar="M,N,W,S",
                        help="tiles to try for every kernel of --kernels: BLOCK_M,BLOCK_N,WARPS,STAGES (for dk/dv "
                             "BLOCK_N is the keys a program owns, BLOCK_M the query step) [a built-in list per kernel]")
    args = parser.parse_args(argv)
    args.candidates = candidates_from_flags(parser, args.candidates, tiles_of, [])
    parts = args.shape.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        parser.error(f"--shape: expected BATCHxHEADSxSEQ (e.g. 8x16x1024), got {args.shape!r}")
    args.batch, args.heads, args.seq_len = (int(p) for p in parts)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in CANDIDATES]
    if unknown or not args.kernels:
        parser.error(f"--kernels: choose from forward,dq,dkdv (got {args.kernels!r})")
    refuse_without_gpu(parser)
    return args


def rope_tables(seq_len, head_dim, device):
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Problem:
    """A packed qkv [B, S, 3D] whose q and k are already rotated (as version 4's QKV GEMM hands them over)."""

    def __init__(self, batch, heads, seq_len, head_dim, dtype, device="cuda"):
        self.heads, self.dim = heads, heads * head_dim
        self.qkv = torch.randn(batch, seq_len, 3 * self.dim, device=device).to(dtype)
        self.grad_out = torch.randn(batch, seq_len, self.dim, device=device).to(dtype)
        self.cos, self.sin = rope_tables(seq_len, head_dim, device)

    def forward(self):
        return fa.packed_attention_forward(self.qkv, self.heads)

    def backward(self, out, lse):
        return fa.packed_attention_backward(self.qkv, out, lse, self.grad_out, self.heads, rope=(self.cos, self.sin))

    def reference(self):
        """out, and the gradient of the UNrotated q, k and v, in float64."""
        batch, seq_len, _ = self.qkv.shape
        head_dim = self.dim // self.heads
        rotated = self.qkv.double()
        heads = lambda t: t.view(batch, seq_len, self.heads, head_dim).transpose(1, 2)  # noqa: E731
        cos, sin = self.cos.double(), self.sin.double()
        # Undo the rotation to get the inputs whose gradient the backward pass returns.
        q0 = rotate(heads(rotated[..., :self.dim]), cos, -sin).detach().requires_grad_()
        k0 = rotate(heads(rotated[..., self.dim:2 * self.dim]), cos, -sin).detach().requires_grad_()
        v = heads(rotated[..., 2 * self.dim:]).detach().requires_grad_()
        scores = rotate(q0, cos, sin) @ rotate(k0, cos, sin).transpose(-1, -2) / math.sqrt(head_dim)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=self.qkv.device).triu(1)
        out = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(batch, seq_len, -1)
        out.backward(self.grad_out.double())
        grads = [g.transpose(1, 2).reshape(batch, seq_len, -1) for g in (q0.grad, k0.grad, v.grad)]
        return out.detach(), grads


def portable_launch_config(head_dim, dtype, seq_len, name, *rest, **options):
    """fa._launch_config's signature, version 3's choice on every GPU."""
    return fa._portable_launch_config(head_dim, dtype, name)


def with_tiles(kernel, tiles, others):
    """A stand-in for fa._launch_config: `tiles` for `kernel`, the launch rule `others` for the other kernels."""
    block_m, block_n, warps, stages = tiles

    def launch_config(head_dim, dtype, seq_len, name, *rest, **options):
        if name == kernel:
            return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        return others(head_dim, dtype, seq_len, name, *rest, **options)
    return launch_config


def measure(kernel, timed, checked, reference):
    """(microseconds, largest relative error) of the pass `kernel` belongs to, under the current _launch_config."""
    if kernel == "forward":
        us = 1000.0 * median_ms(timed.forward)
        out, _ = checked.forward()
        return us, relative_error(out, reference[0])
    out, lse = timed.forward()
    us = 1000.0 * median_ms(lambda: timed.backward(out, lse))
    small_out, small_lse = checked.forward()
    grads = checked.backward(small_out, small_lse).split(checked.dim, dim=-1)
    return us, max(relative_error(g, r) for g, r in zip(grads, reference[1]))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dtype = DTYPES[args.dtype]
    tolerance = dots_tolerance(dtype, torch.device("cuda"))   # float32 through TF32 on NVIDIA, as the kernels run
    torch.manual_seed(0)
    timed = Problem(args.batch, args.heads, args.seq_len, args.head_dim, dtype)
    checked = Problem(1, 2, args.seq_len, args.head_dim, dtype)
    reference = checked.reference()
    print(f"{torch.cuda.get_device_name()}: {args.shape}, head dim {args.head_dim}, {args.dtype}, causal; "
          f"us per call of the pass (do_bench's median); error against float64 (tolerance "
          f"{tolerance:.0e})")
    original = fa._launch_config
    others = portable_launch_config if args.others == "portable" else original
    print(f"the kernels not being tuned run with the {args.others} tiles")
    for kernel in args.kernels:
        current = original(args.head_dim, dtype, args.seq_len, kernel)
        current_tiles = (current["BLOCK_M"], current["BLOCK_N"], current["num_warps"], current["num_stages"])
        candidates = args.candidates or CANDIDATES[kernel]
        for tiles in [current_tiles] + [t for t in candidates if t != current_tiles]:
            fa._launch_config = with_tiles(kernel, tiles, others)
            try:
                us, error = measure(kernel, timed, checked, reference)
                verdict = "ok" if error < tolerance else "WRONG"
                shown = f"{us:9.1f} us  error {error:.1e}  {verdict}"
            except Exception as why:   # noqa: BLE001 - a config this GPU cannot compile or run is not a candidate
                shown = f"fails: {str(why).splitlines()[0][:80]}"
            finally:
                fa._launch_config = original
            name = "{}x{} w{} s{}".format(*tiles) + ("  (current)" if tiles == current_tiles else "")
            print(f"{kernel:<8} {name:<24} {shown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
