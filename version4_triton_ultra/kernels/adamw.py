"""AdamW for every parameter in one Triton kernel, which also writes the 16-bit weight copies.

Under bfloat16 autocast, version 4's GEMMs multiply with 16-bit copies of the float32 projection weights
(tiny_llama_v4.Projection). torch.optim.AdamW(fused=True) updates every parameter in one multi-tensor kernel,
but the copies then need a second pass over the weights before the next forward pass can start: at batch 32 x
seq 512 on an H100 that copy took ~15 us and the forward pass waited ~16 us for it at the start of every step.
This optimizer writes each copy in the same pass that updates the weight, from the value still in registers.

The update is torch.optim.AdamW's, element by element (all in float32; a 16-bit gradient is widened first):

    p        = p - lr * weight_decay * p                              # decoupled weight decay
    exp_avg    = beta1 * exp_avg    + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    p        = p - lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
    copy     = p.to(bfloat16 or float16)                              # only for weights that have a copy

and every parameter's step counter goes up by one, by the last program to finish (so one launch per parameter
group, and no separate kernel for the counters).

One launch covers tensors of every shape. Each program updates BLOCK elements of ONE tensor; two small tables,
made once per set of shapes, say which tensor and which element range each program takes. A third table holds,
per tensor, the addresses of the weight, its gradient, the two moments, the step counter and the copy (0 for
none); the kernel turns an address back into a pointer. That is what torch's multi-tensor kernels do too, except
that they pass the addresses as kernel arguments; a Triton kernel reads them from memory.

16-bit gradients. In the graph-captured step under autocast, the second stream's weight-gradient GEMMs write each
projection's gradient in the GEMM's 16-bit dtype, into `sixteen_bit_gradients` ({parameter: gradient}, the model's
dict) instead of a float32 `.grad` (backward_overlap.WeightGradientStream). That is the gradient that autocast
itself gives a float32 weight (its backward rounds the 16-bit GEMM's result, then widens it), so version 1 under
autocast computes the same numbers, up to the GEMM's order of summation; and it moves 2 bytes a weight fewer out of
the GEMM and 2 fewer into this kernel, which reads, per parameter, whichever gradient it has (a table row says
which). A parameter has one or the other, never both; zero_grad clears both.

Addresses and graph capture. Gradients are new tensors at every eager step, so the address table is rewritten
(one small host-to-device copy) whenever an address changed. A CUDA/HIP graph replays the kernel with the table
it was captured with: the gradients the graph allocates during capture must be in it, but a copy from pageable
host memory cannot be captured (one from pinned memory could, and would then run at every replay). So under
capture `step()` only records the new addresses, and the caller writes them after the capture with
`finish_capture()` (graphed_step.GraphedStep does). The graph's gradients keep their addresses at every replay,
so the table stays right.

State, learning rate, checkpoints: the state of each parameter is torch's (`step`, `exp_avg`, `exp_avg_sq`;
`step` a float32 tensor on the device, as for torch's capturable AdamW), so checkpoints move between this
optimizer and torch's. The learning rate may be a float or a 0-dim float32 tensor on the parameters' device
(the trainer makes it one whenever the schedule varies, which a graph-captured step needs: a replay re-reads the
tensor, while a float would stay what it was at capture).
"""
import torch
import triton
import triton.language as tl

from tinytransformer.triton_support import interpreter_active, small_interpreter_blocks
from version4_triton_ultra.kernels.add_rmsnorm import is_last_to_arrive
from version4_triton_ultra.kernels.programmatic_launch import launch_options, wait_for_previous_kernel
from version4_triton_ultra.kernels.sixteen_bit_gradients import clear_16bit_gradients, refuse_two_gradients

# Elements per program, and warps: 4 elements per thread on NVIDIA (32-thread warps), 2 on AMD CDNA (64-thread
# wavefronts; not tuned there). Small programs stream best: on an H200, the whole update alone (tune_adamw.py;
# benchmarks/results/kernel_time/h200_adamw_launch.json) took 6-7% less time at the small, medium and large
# presets with 512 elements and 4 warps than with 1,024 and 8 (the choice made on an H100 for the seed model alone,
# where 256 to 1,024 elements timed within 2%; 9% less there on the H200), at 77-78% of the GPU's bandwidth from the
# medium preset up; programs of 256 or 2,048 elements, or 8 elements a thread, were slower at every size.
BLOCK = 512
NUM_WARPS = 4
# A parameter group of fewer than SMALL_PROGRAMS_FROM elements keeps the launch chosen before (1,024 elements, 8
# warps): in the graph-captured step of the seed model (groups of under a million parameters, most updated on the
# second stream beside the backward pass) the small programs made the bfloat16 step slower on an H200, 0.406 ->
# 0.413 ms in two separate runs of interleaved rounds, although the kernel alone was faster (30.1 -> 27.3 us). The
# small preset's step timed the same under the old launch, the new one everywhere and this rule (2.03 ms; its layer
# groups hold 3.2 M elements, the last layer's with the output head 5.3 M: the only one above); the medium preset's
# (layer groups of 12.8 M) 22.56 -> 22.44 ms with the small programs.
SMALL_GROUP_LAUNCH = (1024, 8)
SMALL_PROGRAMS_FROM = 2 ** 22
# Elements per program in Triton's CPU interpreter, where a CPU run pays per program (kernel tests keep the launch's
# block, so that their parameters span several programs): about one program per parameter of a small model.
INTERPRETER_BLOCK = 65536
# Rows of the per-tensor address table, in this order: addresses, then 1 where the gradient is 16-bit (else 0).
ADDRESS_ROWS = ("param", "grad", "exp_avg", "exp_avg_sq", "step", "copy", "grad_is_16_bit")


@triton.jit
def _adamw_kernel(
    block_tensor_ptr,    # [programs] int32: the tensor program b updates
    block_start_ptr,     # [programs] int64: the first element of that tensor it updates
    numel_ptr,           # [tensors] int64
    addresses_ptr,       # [len(ADDRESS_ROWS), tensors] int64 addresses (a copy address of 0: no copy), and flags
    ticket_ptr,          # int32 zero: counts the programs that are done (see the end of the kernel)
    n_tensors, n_programs,
    lr, lr_ptr,          # the learning rate: the float `lr`, or read from lr_ptr when LR_IN_MEMORY
    beta1, beta2, eps, weight_decay,
    LR_IN_MEMORY: tl.constexpr,
    COPY_DTYPE: tl.constexpr,   # the copies' dtype (all copies share one)
    GRAD16_DTYPE: tl.constexpr,   # the 16-bit gradients' dtype (all share one)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,   # wait for the kernel before (programmatic_launch.py)
):
    wait_for_previous_kernel(PDL)
    block = tl.program_id(0)
    tensor = tl.load(block_tensor_ptr + block)
    offsets = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numel_ptr + tensor)

    param_ptr = tl.load(addresses_ptr + tensor).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(addresses_ptr + n_tensors + tensor).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(addresses_ptr + 2 * n_tensors + tensor).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(addresses_ptr + 3 * n_tensors + tensor).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(addresses_ptr + 4 * n_tensors + tensor).to(tl.pointer_type(tl.float32))
    copy_address = tl.load(addresses_ptr + 5 * n_tensors + tensor)
    grad_is_16_bit = tl.load(addresses_ptr + 6 * n_tensors + tensor)

    if LR_IN_MEMORY:
        lr = tl.load(lr_ptr)
    step = tl.load(step_ptr) + 1.0   # this step's number; the counters are advanced at the end
    # beta^step as exp2(step * log2(beta)): vendor-neutral, and within float32 rounding of pow().
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))

    p = tl.load(param_ptr + offsets, mask=mask)
    if grad_is_16_bit != 0:   # the same address, read as 16-bit numbers and widened
        g = tl.load(grad_ptr.to(tl.pointer_type(GRAD16_DTYPE)) + offsets, mask=mask).to(tl.float32)
    else:
        g = tl.load(grad_ptr + offsets, mask=mask)
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)

    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)

    tl.store(param_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if copy_address != 0:
        tl.store(copy_address.to(tl.pointer_type(COPY_DTYPE)) + offsets, p.to(COPY_DTYPE), mask=mask)

    # Count the step in every tensor's counter. Only once all programs have read them: the last program to
    # finish does it (torch's AdamW launches a separate kernel for this). With an atomic add, which one thread
    # of the program performs: a load and a store would be run by every thread, and a thread that loads after
    # another one's store would count the step twice.
    if is_last_to_arrive(ticket_ptr, n_programs):
        for t in range(0, n_tensors):
            counter_ptr = tl.load(addresses_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.float32))
            tl.atomic_add(counter_ptr, 1.0, sem="relaxed")


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# The 16-bit gradients this optimizer reads (what the weight-gradient stream may write: backward_overlap.py).
SIXTEEN_BIT_GRADIENT_DTYPES = tuple(_TRITON_DTYPES)


class TritonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update in one Triton kernel per parameter group, writing 16-bit weight copies too.

    `sixteen_bit_copies` is a dict {parameter: bfloat16 or float16 tensor of its shape} that the model fills
    (tiny_llama_v4.TinyLlama.refresh_16bit_weights) and may change between steps; after every step each copy
    in it equals its updated weight, rounded. Parameters and gradients must be contiguous float32 tensors on
    the GPU (or on the CPU under Triton's interpreter), except that a parameter's gradient may instead be a 16-bit
    tensor in `sixteen_bit_gradients` ({parameter: gradient}; see the module docstring). `launch`: (elements a
    program, warps), both powers of two, for a tuner to time; None: launch_for each group's size. The update is
    the same under any launch, bit for bit.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 sixteen_bit_copies=None, launch=None, sixteen_bit_gradients=None):
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must be in [0, 1): {betas}")
        if isinstance(lr, torch.Tensor) and (lr.dim() != 0 or lr.dtype != torch.float32):
            raise ValueError("a tensor lr must be a 0-dim float32 tensor")
        if not isinstance(lr, torch.Tensor) and lr < 0.0:
            raise ValueError(f"lr must be >= 0: {lr}")
        if launch is not None and (not isinstance(launch, (tuple, list)) or len(launch) != 2
                                   or not all(isinstance(n, int) and n > 0 and n & (n - 1) == 0 for n in launch)):
            raise ValueError(f"launch must be (elements a program, warps), powers of two: {launch}")
        # capturable: load_state_dict then keeps `step` on the parameter's device (torch's convention), and the
        # trainer gives this group a tensor learning rate when the schedule varies (make_learning_rate_a_tensor).
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True))
        self.sixteen_bit_copies = {} if sixteen_bit_copies is None else sixteen_bit_copies
        self.sixteen_bit_gradients = {} if sixteen_bit_gradients is None else sixteen_bit_gradients
        # (elements a program, warps) of every launch when a tuner (tune_adamw.py) times one; None: by group size.
        # Set here only: a group's launch is fixed with its launch tables, at its first step.
        self.launch = launch
        self._launches = {}   # group index -> (address key, launch tables) of the last step
        self._pending = {}    # group index -> (address key, addresses) recorded under graph capture

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_groups(range(len(self.param_groups)))
        return loss

    @torch.no_grad()
    def step_groups(self, indices) -> None:
        """Update the parameter groups with these indices only (one launch each): a training step may update
        the weights whose gradients are complete before the backward pass has ended (graphed_step.GraphedStep)."""
        for index in indices:
            group = self.param_groups[index]
            gradient_of = {p: self.gradient_of(p) for p in group["params"]}   # looked up once a step
            params = [p for p, g in gradient_of.items() if g is not None]
            if not params:
                continue
            grads = [gradient_of[p] for p in params]
            states = [self._state_of(p) for p in params]
            tables = self._tables(index, params, grads, states)
            self._launch(group, tables)

    def gradient_of(self, param):
        """The parameter's gradient: its float32 .grad, or its 16-bit one in sixteen_bit_gradients, or None."""
        sixteen_bit = self.sixteen_bit_gradients.get(param)
        refuse_two_gradients(param, sixteen_bit)
        return param.grad if sixteen_bit is None else sixteen_bit

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, for the 16-bit gradients too: dropped, or set to zero (then the next backward pass adds
        to them in float32, as a second backward pass does: WeightGradientStream.queue)."""
        super().zero_grad(set_to_none=set_to_none)
        clear_16bit_gradients(self.sixteen_bit_gradients, [p for g in self.param_groups for p in g["params"]],
                              set_to_none)

    def finish_capture(self) -> None:
        """After a CUDA/HIP graph captured step(): write the addresses the capture recorded (see the module
        docstring). Call it before the first replay."""
        for index, (key, addresses) in self._pending.items():
            tables = self._launches[index][1]
            tables["addresses"].copy_(addresses)
            self._launches[index] = (key, tables)
        self._pending.clear()

    def _state_of(self, param):
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _address_columns(self, params, grads, states):
        columns = []
        for param, grad, state in zip(params, grads, states):
            copy = self.sixteen_bit_copies.get(param)
            tensors = (param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
            for row, tensor in zip(ADDRESS_ROWS, tensors):
                allowed = (torch.float32, *_TRITON_DTYPES) if row == "grad" else (torch.float32,)
                if tensor.dtype not in allowed or not tensor.is_contiguous() or tensor.device != param.device:
                    raise ValueError(f"TritonAdamW needs contiguous float32 parameters, gradients (or 16-bit ones) "
                                     f"and state on one device; a parameter of shape {tuple(param.shape)} has a {row} "
                                     f"of dtype {tensor.dtype} on {tensor.device} (version 4's --torch-adamw uses "
                                     f"torch's AdamW instead)")
            if copy is not None and (copy.shape != param.shape or not copy.is_contiguous()
                                     or copy.dtype not in _TRITON_DTYPES or copy.device != param.device):
                raise ValueError(f"a 16-bit copy must be a contiguous bfloat16/float16 tensor of its parameter's "
                                 f"shape {tuple(param.shape)} on its device {param.device}")
            if grad.shape != param.shape:
                raise ValueError(f"a gradient of shape {tuple(grad.shape)} for a parameter of shape "
                                 f"{tuple(param.shape)}")
            columns.append([t.data_ptr() for t in tensors] + [copy.data_ptr() if copy is not None else 0]
                           + [int(grad.dtype != torch.float32)])
        return columns

    def _tables(self, index, params, grads, states):
        """The launch tables of this group: reused while every address is the same as at the last step."""
        columns = self._address_columns(params, grads, states)
        copies = [self.sixteen_bit_copies.get(p) for p in params]
        copy_dtypes = {c.dtype for c in copies if c is not None}
        if len(copy_dtypes) > 1:
            raise ValueError("all 16-bit copies must share one dtype")
        grad16_dtypes = {g.dtype for g in grads} - {torch.float32}
        if len(grad16_dtypes) > 1:
            raise ValueError("all 16-bit gradients of a parameter group must share one dtype")
        key = (tuple(map(tuple, columns)), tuple(p.numel() for p in params), tuple(copy_dtypes),
               tuple(grad16_dtypes))
        cached = self._launches.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        device = params[0].device
        addresses = torch.tensor(columns, dtype=torch.int64).t().contiguous()   # [rows, tensors]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Same shapes as the eager steps before the capture: reuse their tables; write the addresses later.
            if cached is None or cached[0][1:] != key[1:]:
                raise RuntimeError("TritonAdamW: run one eager step with the same parameters before capturing")
            self._pending[index] = (key, addresses)
            return cached[1]
        block, num_warps = self.launch or launch_for(sum(p.numel() for p in params))
        tables = _block_tables([p.numel() for p in params], device, block)
        tables["num_warps"] = num_warps
        tables["addresses"] = addresses.to(device)
        tables["copy_dtype"] = _TRITON_DTYPES[copy_dtypes.pop()] if copy_dtypes else tl.bfloat16
        tables["grad16_dtype"] = _TRITON_DTYPES[grad16_dtypes.pop()] if grad16_dtypes else tl.bfloat16
        self._launches[index] = (key, tables)
        return tables

    @staticmethod
    def _launch(group, tables):
        lr = group["lr"]
        lr_in_memory = isinstance(lr, torch.Tensor)
        if lr_in_memory and (lr.device != tables["numel"].device or lr.dtype != torch.float32):
            raise ValueError("a tensor lr must be float32 on the parameters' device")
        beta1, beta2 = group["betas"]
        _adamw_kernel[(tables["programs"],)](
            tables["block_tensor"], tables["block_start"], tables["numel"], tables["addresses"], tables["ticket"],
            tables["numel"].numel(), tables["programs"],
            0.0 if lr_in_memory else float(lr), lr if lr_in_memory else tables["numel"],
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            LR_IN_MEMORY=lr_in_memory, COPY_DTYPE=tables["copy_dtype"], GRAD16_DTYPE=tables["grad16_dtype"],
            BLOCK=tables["block"],
            num_warps=tables["num_warps"], **launch_options(tables["numel"].device))


def launch_for(group_elements: int) -> tuple:
    """(elements a program, warps) for a parameter group of this many elements (see BLOCK)."""
    return (BLOCK, NUM_WARPS) if group_elements >= SMALL_PROGRAMS_FROM else SMALL_GROUP_LAUNCH


def _block_tables(numels, device, block) -> dict:
    """Which tensor and which first element each program takes: ceil(numel / block) programs per tensor
    (INTERPRETER_BLOCK elements a program in a CPU run of the interpreter instead)."""
    if interpreter_active() and not small_interpreter_blocks():
        block = INTERPRETER_BLOCK
    block_tensor, block_start = [], []
    for tensor, numel in enumerate(numels):
        for start in range(0, numel, block):
            block_tensor.append(tensor)
            block_start.append(start)
    return {"programs": len(block_tensor), "block": block,
            "block_tensor": torch.tensor(block_tensor, dtype=torch.int32, device=device),
            "block_start": torch.tensor(block_start, dtype=torch.int64, device=device),
            "numel": torch.tensor(numels, dtype=torch.int64, device=device),
            "ticket": torch.zeros(1, dtype=torch.int32, device=device)}
