"""Data parallelism: the process group, ranks, the DDP wrapper and the collectives a run needs.

Data parallelism in one paragraph. Every rank (one process per GPU) holds a full copy of the model and
optimizer. At step t the GLOBAL batch (a function of seed and t, see data.BatchStream) is cut into equal
contiguous slices, one per rank; each rank computes the gradient of its slice, then an all-reduce averages the
gradients over the ranks, so every rank applies the same update to the same weights. Mathematically the run
is the single-process run with the global batch: the tests check that a 2-rank run with --batch-size 4 gives the
losses of a 1-rank run with --batch-size 8, step by step. What it costs: one all-reduce of every gradient
(parameters x 4 bytes in float32) per step, which pays only when the step's compute is long enough to hide it.

How a run becomes distributed. A launcher starts one process per GPU and tells each who it is through
environment variables; we never parse launcher flags ourselves:

    torchrun --nproc-per-node 2 tiny_llama_v1.py ...       RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    deepspeed --num_gpus 2 tiny_llama_v1.py --deepspeed    the same variables (and a --local_rank flag)
    srun torchrun --nnodes N ... (scripts/slurm_multinode.sbatch)   the same, across nodes

Rank r uses GPU cuda:LOCAL_RANK, talks to the others through NCCL (RCCL on ROCm, which PyTorch also calls
"nccl") or, on the CPU, through gloo. The model is wrapped in DistributedDataParallel (DDP), or handed to
DeepSpeed's engine with --deepspeed (deepspeed_engine.py). The trainer keeps a handle to the UNWRAPPED model for
everything that is not the training step: load_canonical, checkpoints, validation.

Conventions of a data-parallel run: --batch-size is per rank (the global batch is batch x ranks); reported
samples/s are global; memory is rank 0's GPU; timing is rank 0's device events; only rank 0 prints, writes the
metrics JSON, TensorBoard scalars and checkpoints; the logged training loss and the validation loss are
averages over all ranks, i.e. over the global batch.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError, TrainConfig

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun(env=os.environ) -> bool:
    """True inside a process started by torchrun / the deepspeed launcher / torch.distributed.run."""
    return all(name in env for name in LAUNCHER_VARIABLES)


def rank_from_environment(env=os.environ) -> int:
    """This process's global rank as the launcher set it (0 without a launcher), readable before any set-up."""
    try:
        return int(env.get("RANK", "0"))
    except ValueError:
        return 0


def is_main_process() -> bool:
    """Rank 0 (or a single process): the one that prints and writes files."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return rank_from_environment() == 0


# ----------------------------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------------------------
@dataclass
class DistributedContext:
    """Who this process is in the job. A single-process run is a context with enabled=False and world 1."""
    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None           # "nccl" (NCCL or RCCL) or "gloo"
    engine: str = "single"               # single | ddp | deepspeed
    device: torch.device = torch.device("cpu")
    grad_reduce_dtype: str = "float32"   # what the gradients are summed in: float32 | bfloat16 (--grad-reduce-dtype)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """For the run's header, e.g. 'DistributedDataParallel over 2 rank(s) (nccl (RCCL))'."""
        if not self.enabled:
            return "single process"
        label = {"ddp": "DistributedDataParallel", "deepspeed": "DeepSpeed engine"}.get(self.engine, self.engine)
        return f"{label} over {self.world_size} rank(s) ({self.backend_label}){self.reduce_dtype_note}"

    @property
    def reduce_dtype_note(self) -> str:
        """', gradients summed in bfloat16' for the header when they are; nothing for the exact float32 sums."""
        return "" if self.grad_reduce_dtype == "float32" else f", gradients summed in {self.grad_reduce_dtype}"

    @property
    def backend_label(self) -> str | None:
        """The backend as the header names it: PyTorch's ROCm build calls RCCL "nccl" too."""
        return "nccl (RCCL)" if self.backend == "nccl" and torch.version.hip else self.backend

    # -- collectives the trainer needs (all of them no-ops in a single process) --------------------------------
    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` (on this rank's device) by its mean over the ranks, in place."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world_size
        return tensor

    def average(self, value: float) -> float:
        """The mean of a Python number over the ranks (e.g. the validation loss of each rank's slice)."""
        if not self.enabled:
            return value
        return self.average_(torch.tensor([value], dtype=torch.float64, device=self.device)).item()

    def max_over_ranks(self, value: int) -> int:
        """The largest of the ranks' integers, on every rank (e.g. a signal number that reached only some)."""
        return self.max_over_ranks_each([value])[0]

    def max_over_ranks_each(self, values: list[int]) -> list[int]:
        """max_over_ranks of several integers at once: one all-reduce, one synchronisation."""
        if not self.enabled:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def weights_identical(self, params) -> bool | None:
        """Whether every rank holds bit for bit the same weights (None in one process). Data parallelism rests on
        it: every rank applies the same averaged gradient to the same weights. A sum whose last bits differ from
        rank to rank (atomic additions in a varying order) would break it slowly and silently, each step's
        difference feeding the next. Each rank fingerprints each parameter (bit_pattern_fingerprint); one
        all-reduce compares the fingerprints."""
        if not self.enabled:
            return None
        fingerprints = [bit_pattern_fingerprint(param).to(self.device) for param in params]
        fingerprints = torch.cat(fingerprints) if fingerprints else torch.zeros(1, dtype=torch.int64,
                                                                                device=self.device)
        lowest, highest = self._lowest_and_highest(fingerprints)
        return bool(torch.equal(lowest, highest))

    def _lowest_and_highest(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of these int64 values' smallest and largest over the ranks, with one all-reduce: the MAX of the
        values and of their negatives."""
        both = torch.cat([values, -values])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return -both[len(values):], both[:len(values)]

    def check_same(self, value: int, what: str, hint: str = "") -> None:
        """Raise ConfigError on every rank if the ranks disagree on an integer (e.g. the step a resume starts at)."""
        if not self.enabled:
            return
        lowest, highest = (int(v) for v in self._lowest_and_highest(
            torch.tensor([value], dtype=torch.int64, device=self.device)))
        if highest != lowest:
            raise ConfigError(f"the ranks disagree on {what} ({lowest} .. {highest}){hint}")


def bit_pattern_fingerprint(tensor: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """A fingerprint of a tensor's exact bits, [2] int64: its bytes read as integers of its element's width (at most
    32 bits: a float64 is two int32s), summed, and summed again each times a weight that depends on its position.
    The plain sum sees any one changed bit (a float sum would miss a change lost in rounding, and -0.0 = 0.0); the
    weighted one sees changes that cancel in the plain sum, e.g. +1 and -1 in the last bits of two elements
    (what sums added in an order that varies make) or two elements swapped. Integer sums wrap around the same way
    whatever the order of the additions, so equal bits give equal fingerprints on every rank and device. Chunked:
    the weights of one chunk at a time, not of the whole tensor."""
    as_integers = {1: torch.int8, 2: torch.int16}.get(tensor.element_size(), torch.int32)
    bits = tensor.detach().reshape(-1).contiguous().view(as_integers)
    plain = bits.sum(dtype=torch.int64)
    weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        position_weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=bits.device)
        weighted += (part * (position_weights * 0x9E3779B1 + 1)).sum()   # an odd multiplier spreads the weights
    return torch.stack([plain, weighted])


def choose_backend(device: torch.device, requested: str) -> str:
    """NCCL between GPUs (PyTorch's ROCm build maps the name "nccl" to RCCL), gloo between CPU processes."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("--dist-backend nccl needs GPUs (NCCL / RCCL), but this run is on the CPU; "
                          "use --dist-backend gloo (or auto)")
    return requested


def launcher_int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer "
                          f"(set by torchrun; do not set it by hand)") from None


def free_port() -> int:
    """A TCP port nobody listens on right now (for a rendezvous on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _pretend_single_process_launch(env) -> None:
    """--deepspeed without a launcher: a world of one process, as if started by `torchrun --nproc-per-node 1`."""
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))


def setup(train: TrainConfig, device: torch.device, env=os.environ) -> DistributedContext:
    """Join the job the launcher started (if any); returns this process's context with its device.

    Every check here runs identically on every rank BEFORE the first collective, so a bad input stops all ranks
    with the same one-line error instead of leaving some of them waiting for the others.
    """
    if not launched_by_torchrun(env):
        if not train.uses_deepspeed:
            return DistributedContext(device=device)
        _pretend_single_process_launch(env)
    rank, local_rank = launcher_int(env, "RANK"), launcher_int(env, "LOCAL_RANK")
    world_size = launcher_int(env, "WORLD_SIZE")
    backend = choose_backend(device, train.dist_backend)
    if device.type == "cuda":
        # One GPU per process. torchrun's LOCAL_WORLD_SIZE (processes on this node) is the same on every rank
        # of the node, so too many processes fail on all of them at once.
        local_processes = launcher_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else local_rank + 1
        visible = torch.cuda.device_count()
        if max(local_processes, local_rank + 1) > visible:
            raise ConfigError(f"{local_processes} processes per node but only {visible} GPU(s) visible on this "
                              f"node; use --nproc-per-node {visible} (one process per GPU)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)   # before any CUDA work: kernels, NCCL and the allocator use this GPU
    # device_id binds NCCL's communicator to this GPU at once (instead of at the first collective).
    init_kwargs = {"device_id": device} if backend == "nccl" else {}
    options = nccl_options(env) if backend == "nccl" else None
    if options is not None:
        init_kwargs["pg_options"] = options
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **init_kwargs)
    engine = "deepspeed" if train.uses_deepspeed else "ddp"
    return DistributedContext(True, rank, local_rank, world_size, backend, engine, device, train.grad_reduce_dtype)


def nccl_high_priority(env=os.environ) -> bool:
    """Whether NCCL's (RCCL's) collectives run on a high-priority stream: yes unless TORCH_NCCL_HIGH_PRIORITY says
    0, false, no or off. The variable is PyTorch's own, whose default is a normal-priority stream; ours is high."""
    return env.get("TORCH_NCCL_HIGH_PRIORITY", "1").strip().lower() not in ("0", "false", "no", "off")


def nccl_options(env=os.environ):
    """The NCCL (RCCL) process group's options: its collectives on a high-priority stream (nccl_high_priority),
    for every version's data parallelism (DDP's buckets, version 4's all-reduces in its graph, DeepSpeed).
    None where this PyTorch has no NCCL process group (torch then reports the missing backend itself).

    Why. A collective overlapped with the backward pass competes for the GPU's SMs with the compute kernels
    queued beside it. The block scheduler hands out SMs in priority order, so from a normal-priority stream a
    collective whose inputs are ready can wait until a large kernel launched just before it (the optimizer's
    update of the embedding, a GEMM) has started all of its blocks; the gradient sums behind it wait too, and so
    do the updates that need them. Measured on two H200s (version 4, medium preset): layer 0's all-reduces sat
    behind the embedding's update at the end of the step. Untimed on AMD GPUs (a HIP graph may not keep the
    stream's priority)."""
    process_group = getattr(dist, "ProcessGroupNCCL", None)
    if process_group is None:
        return None
    options = process_group.Options()
    options.is_high_priority_stream = nccl_high_priority(env)
    return options


def finish_together() -> None:
    """Wait until every rank has finished its run. Then no rank tears its connections down while another one is
    still using them, which can abort a process at exit instead of letting it end cleanly."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (at the end of a run, or after an error), so the process exits cleanly."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_for_data_parallel(model: torch.nn.Module, context: DistributedContext) -> torch.nn.Module:
    """The module the training step calls: DDP around the model (whose weights are already loaded and on the
    device), or the model itself in a single process.

    DDP broadcasts rank 0's weights at construction (all ranks loaded the same ones anyway), then all-reduces
    gradients in buckets (~25 MB each) DURING the backward pass, overlapping communication with the remaining
    backward compute (in bfloat16 under --grad-reduce-dtype bfloat16). Buffers are not re-broadcast before every
    forward: the models' buffers (RoPE tables, causal mask) are constants, identical on every rank, so that would
    be wasted traffic.

    torch.compile (version 2): the model arrives already compiled in place (Module.compile), and DDP wraps the
    compiled module. That is correct; note that the compiled backward then produces all gradients at its end, so
    the all-reduce overlaps less than in eager mode. (Compiling the DDP wrapper instead lets TorchDynamo's
    DDPOptimizer split the graph at bucket boundaries; see the torch.compiler FAQ on DDP.)
    """
    if not context.enabled:
        return model
    import inspect
    from torch.nn.parallel import DistributedDataParallel
    device_ids = [context.local_rank] if context.device.type == "cuda" else None
    # Newer torch renamed the switch (and warns about the old name); both still sync buffers once, at init.
    no_buffer_sync = ("forward_sync_buffers" if "forward_sync_buffers" in
                      inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers")
    wrapped = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                      **{no_buffer_sync: False})
    if context.grad_reduce_dtype == "bfloat16":
        wrapped.register_comm_hook(None, bfloat16_average_hook)
    return wrapped


def bfloat16_average_hook(process_group, bucket):
    """A DDP communication hook: each bucket of gradients divided by the world size, cast to bfloat16, summed over
    the ranks in bfloat16, and written back into the float32 bucket. What PyTorch's bf16_compress_hook does, which
    accepts only NCCL; this one runs on gloo too (the CPU tests)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.div_(dist.get_world_size(group)).to(torch.bfloat16)   # the bucket is overwritten below
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def write_back(done):
        buffer.copy_(done.value()[0])
        return buffer
    return future.then(write_back)


def graph_capture_note(args, device: torch.device, context: DistributedContext,
                       averages_gradients=None) -> str | None:
    """Versions 2 (with --cuda-graph) and 4 replay their whole step from a CUDA/HIP graph; what becomes of that
    step under data parallel, decided here, early (before the model is built: its optimizer is made capturable
    only for a graph).

    Under DDP, a version whose own step averages the gradients (its spec's `averages_gradients(args, device)`
    hook, gradient_sync.py) keeps its graph: the all-reduces are captured in it, without the DDP wrapper.
    DeepSpeed's engine (and DDP, for a version without that hook) starts communication from Python hooks during
    the backward pass, which a replayed graph would skip: there --cuda-graph is switched off and the version runs
    its eager step. Returns the note to print, or None (no --cuda-graph, a single process, the CPU)."""
    if not context.enabled or not getattr(args, "cuda_graph", False):
        return None
    if context.engine == "ddp" and averages_gradients is not None:
        if not averages_gradients(args, device):
            return None   # no graph for these arguments anyway (e.g. float16 AMP), as in a single process
        return ("version 4 averages gradients inside its CUDA/HIP-graph step (NCCL/RCCL all-reduce captured in "
                "the graph), without the DDP wrapper")
    args.cuda_graph = False
    if device.type != "cuda":
        return None   # on the CPU the graph was never going to be used
    if context.engine == "deepspeed":
        return ("DeepSpeed's engine launches its communication from Python hooks, which a CUDA/HIP graph cannot "
                "replay; --cuda-graph is switched off: the eager step under DeepSpeed")
    return ("the CUDA/HIP-graph step cannot capture DDP's communication; --cuda-graph is switched off: the eager "
            "step under DDP")
