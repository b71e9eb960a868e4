"""What the kernel benchmark scripts describe: an op (OpBench), its inputs (InputSet), the shape they are cut to
(BenchShape), and the helpers the op descriptions use to make inputs and the PyTorch reference."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The model's seed configuration: what is timed unless a flag says otherwise.
SEED_SHAPE = dict(batch_size=8, seq_len=128, hidden_dim=256, num_heads=8, intermediate_size=512,
                  vocab_size=1000)
# Without a GPU the kernels run in Triton's interpreter, which executes every block in NumPy: a small shape
# keeps the check to seconds. Sizes that are not powers of two exercise the kernels' masks.
INTERPRETER_SHAPE = dict(batch_size=2, seq_len=40, hidden_dim=64, num_heads=4, intermediate_size=96,
                         vocab_size=130)


@dataclass(frozen=True)
class BenchShape:
    """The model sizes the inputs are cut to. The one-letter properties are the symbols of the byte models
    (printed in the footnote), so that each model's code reads exactly like its printed formula."""
    batch_size: int
    seq_len: int
    hidden_dim: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype

    @property
    def B(self):   # noqa: N802 (the byte models' symbols)
        return self.batch_size

    @property
    def S(self):   # noqa: N802
        return self.seq_len

    @property
    def N(self):   # noqa: N802  tokens: one row of every [N, D] activation
        return self.batch_size * self.seq_len

    @property
    def D(self):   # noqa: N802
        return self.hidden_dim

    @property
    def H(self):   # noqa: N802
        return self.num_heads

    @property
    def Dh(self):  # noqa: N802  head dim; q, k and v of all heads hold B*H*S*Dh = N*D elements
        return self.hidden_dim // self.num_heads

    @property
    def F(self):   # noqa: N802
        return self.intermediate_size

    @property
    def V(self):   # noqa: N802
        return self.vocab_size

    @property
    def e(self):
        """Bytes per element of the benchmark's dtype."""
        return self.dtype.itemsize

    def describe(self) -> str:
        return (f"batch {self.B}, seq {self.S}, hidden {self.D}, heads {self.H} (head dim {self.Dh}), "
                f"FFN {self.F}, vocab {self.V}, {dtype_name(self.dtype)}")


@dataclass
class InputSet:
    """One set of inputs: `differentiable` leaves (requires_grad) and `constants` (tables, targets).

    Every implementation is called as fn(*differentiable, *constants). grad_outputs (one random tensor per
    output, the gradients a backward receives) are drawn once per set and shared by every implementation.
    """
    differentiable: list
    constants: list = field(default_factory=list)
    grad_outputs: list | None = None

    def args(self):
        return (*self.differentiable, *self.constants)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.args() if isinstance(t, torch.Tensor))

    def to_float64(self) -> InputSet:
        """The same values in float64 (fresh leaves), for the exact reference. Integer tensors are kept."""
        def widen(t, grad):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                return t
            return t.detach().to(torch.float64).requires_grad_(grad)
        return InputSet([widen(t, True) for t in self.differentiable], [widen(t, False) for t in self.constants],
                        None if self.grad_outputs is None else [widen(g, False) for g in self.grad_outputs])


@dataclass
class OpBench:
    """One op to benchmark: inputs, the Triton op, the PyTorch code it replaces, and a byte model.

    pytorch: label -> implementation; the first one is also the reference of --check.
    byte_model: direction -> (formula as printed, function of a BenchShape giving bytes).
    """
    name: str
    make_inputs: Callable[[BenchShape, torch.device], InputSet]
    triton: Callable
    pytorch: dict[str, Callable]
    output_names: tuple[str, ...]
    input_names: tuple[str, ...]
    byte_model: dict[str, tuple[str, Callable[[BenchShape], int]]]
    validate: Callable[[BenchShape], str | None] = lambda shape: None   # a message when the shape is unusable
    uses_tl_dot: bool = False        # bfloat16 tl.dot is wrong in Triton's interpreter: not checkable there
    tf32_dots: bool = False          # float32 tl.dot through TF32 on NVIDIA: the TF32 tolerance applies
    note: str = ""                   # printed under the table, e.g. what a direction contains

    @property
    def directions(self) -> tuple[str, ...]:
        return tuple(self.byte_model)

    def bytes_moved(self, shape: BenchShape, direction: str) -> int:
        return self.byte_model[direction][1](shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(shape, dtype, device, scale=1.0, requires_grad=True) -> torch.Tensor:
    """Normal(0, scale) values (never zeros: a kernel that forgets to load would still look right on zeros),
    drawn in float32 from the global generator and rounded once to dtype."""
    t = (scale * torch.randn(shape, device=device, dtype=torch.float32)).to(dtype)
    return t.requires_grad_(requires_grad)


def random_norm_weight(dim, dtype, device) -> torch.Tensor:
    """A norm weight near 1 as in a trained model, but not exactly 1 (that would hide a missing multiply)."""
    return (1.0 + 0.1 * torch.randn(dim, device=device)).to(dtype).requires_grad_()


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs (what the model uses), float64 for the float64 reference."""
    return torch.promote_types(dtype, torch.float32)


def torch_rms_norm(x, weight, eps):
    """Version 1's RMSNorm written as a function: statistics in (at least) float32, result in x's dtype."""
    x_wide = x.to(statistics_dtype(x.dtype))
    variance = x_wide.pow(2).mean(-1, keepdim=True)
    return (weight * (x_wide * torch.rsqrt(variance + eps))).to(x.dtype)


def as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)
