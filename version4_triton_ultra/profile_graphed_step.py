"""Version 4's graph-captured training step alone: its median time, and every kernel it runs with its cost.

    python profile_graphed_step.py                                  (seed config, float32 with TF32)
    python profile_graphed_step.py --use-amp                        (bfloat16 autocast)
    python profile_graphed_step.py --use-amp --batch-size 32 --seq-len 512 --top 20
    python profile_graphed_step.py --use-amp --preset small         (a size preset's model, batch and sequence)
    python profile_graphed_step.py --no-weight-grad-stream          (weight gradients on the main stream)
    python profile_graphed_step.py --equal-stream-priority          (both streams at the same priority)
    python profile_graphed_step.py --rope-in-attention              (RoPE as attention loads q and k)
    python profile_graphed_step.py --rope-in-gemm                   (RoPE in the QKV GEMM at every size)
    python profile_graphed_step.py --use-amp --preset small --swiglu-in-gemms   (SwiGLU in the GEMMs' epilogues)
    python profile_graphed_step.py --use-amp --torch-adamw          (torch's fused AdamW + a separate weight copy)
    python profile_graphed_step.py --use-amp --preset large --triton-attention   (our attention, not cuDNN's)
    python profile_graphed_step.py --use-amp --cublas-workspace default   (a memset before many of cuBLAS's GEMMs)
    python profile_graphed_step.py --use-amp --no-programmatic-launch   (each Triton kernel after the last completes)

The training script (tiny_llama_v4.py) times the whole loop: the graph replay plus the copy of each batch into
the graph's input buffers. This script builds the same model and the same GraphedStep, replays it on one fixed
batch, and reports
  1. the median step time over --steps replays, each timed with device events (after 20 warm-up replays);
  2. a table of the kernels of one step, from the PyTorch profiler over 10 replays (after an unrecorded one): how
     many times each kernel runs per step, its mean duration and its total per step, largest first; plus the sum
     over all kernels and the device time from the first kernel to the last (under the profiler, so larger than
     the median of 1);
  3. the same kernel time summed per family (attention, vendor GEMMs, the QKV and feed-forward GEMMs with fused
     epilogues, norms, loss, optimizer, embedding, other), largest first;
  4. the time in which no kernel of any stream ran (GPU idle), and its gaps of 2 us or more grouped by the kernels
     around them, largest first: where the step waits on something other than a kernel (a memset node, a
     dependency between streams, the launch of the next kernel);
  5. the time in which one kernel ran, and two or more at once (the streams side by side): how much of the step
     overlaps at all. (Where two kernels share the GPU, each runs slower than alone: overlap saves time only
     where one of them leaves the GPU partly idle.)
That table is where the "what is left" of version 4 is read: GEMMs, attention, norms, the optimizer, casts.
With the weight-gradient stream (the default) kernels of the two streams overlap, and each one runs slower than
alone: per-kernel times then add up to more than the step. `--no-weight-grad-stream` gives the cleaner split.
Needs a GPU (CUDA or ROCm): a graph replay does not exist on the CPU.
"""
import contextlib
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, positive_int  # noqa: E402
from tinytransformer.config import ModelConfig, TrainConfig, available_presets, preset_settings  # noqa: E402
from tinytransformer.cublas_workspace import (  # noqa: E402
    add_cublas_workspace_argument, apply_cublas_workspace_argument, describe_cublas_workspace)
from tinytransformer.precision import set_tf32  # noqa: E402
from tinytransformer.profiling.kernel_names import LOSS_FAMILY  # noqa: E402


# Kernel families, by kernel name; the first pattern that matches names the family. The vendor libraries' GEMM
# kernels carry names such as nvjet_*, cutlass_*, sm90_xmma_gemm_* (cuBLAS on NVIDIA), Cijk_* (hipBLASLt / Tensile
# on AMD), plus cuBLAS's split-K reductions. These families are version 4's own, grouped by what a kernel is FOR
# in its step (the norms' weight-gradient sums count as norms, the loss's scaling kernel as loss), which is how
# MEASUREMENTS.md's "Where the seed step's time went" table reads. run_ultra_profiling.py keeps a coarser table
# that fits all four versions (PyTorch's element-wise, copy and reduction kernels by kind), for the census.
KERNEL_FAMILIES = (
    ("attention", r"flash_attention|sdpa|fmha"),   # ours; cuDNN's fused attention (names with sdpa or fmha)
    ("SwiGLU between vendor GEMMs (Triton)", r"separate_swiglu"),   # the feed-forward's form from ~1 G multiply-adds
    ("feed-forward GEMMs + SwiGLU (Triton)", r"swiglu"),
    ("QKV GEMM + RoPE (Triton)", r"qkv_rope"),
    ("RoPE after a vendor GEMM (Triton)", r"rotate_qk"),   # --separate-rope
    ("GEMMs (vendor BLAS)", r"gemm|nvjet|cutlass|Cijk_|splitKreduce|cublas"),
    ("norms", r"rms_norm|native::reduce_kernel"),   # reduce_kernel: norm weight-gradient sums, in older versions
    ("loss", LOSS_FAMILY),   # the profilers' own pattern (tinytransformer/profiling/kernel_names.py)
    ("optimizer and weight copies", r"multi_tensor_apply|adamw"),
    ("embedding", r"embedding|gather|indexFunc"),   # since the first norm does the lookup: none in version 4
)


# The profile: replays recorded (after one unrecorded, see profiled_kernels).
PROFILED_REPLAYS = 10
# The idle-gap table (idle_gaps): gaps from this long are listed, the few largest groups of them printed. Between
# two dependent kernels of a graph the GPU idles about a microsecond anyway; what is longer has a cause to find.
MIN_IDLE_GAP_US = 2.0
IDLE_ROWS = 6


def kernel_family(name: str) -> str:
    """The family of a kernel name (see KERNEL_FAMILIES); "other" when none matches."""
    for family, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return family
    return "other"


def family_totals(rows) -> list[tuple[str, float]]:
    """[(family, us per step)] from kernel_table's rows, largest first."""
    totals = defaultdict(float)
    for name, _, _, step_us in rows:
        totals[kernel_family(name)] += step_us
    return sorted(totals.items(), key=lambda item: -item[1])


def parse_args(argv, prog: str = "profile_graphed_step.py"):
    """The flags, checked: prog names the script in the one-line errors (compare_step_forms.py parses its forms'
    steps here under its own name)."""
    # The training script's switches between each fusion and the form it replaces.
    from version4_triton_ultra.tiny_llama_v4 import (add_attention_arguments, add_launch_arguments, add_rope_arguments,
                                                     add_swiglu_arguments, add_weight_gradient_dtype_arguments)
    parser = OneLineParser(prog=prog,
                           description="Median time and kernel table of version 4's graph-captured step.")
    parser.add_argument("--preset", choices=available_presets(),
                        help="the model, batch size and sequence length of configs/PRESET.yaml (default: the "
                             "seed model); --batch-size and --seq-len still override the preset's")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="[the preset's, else 8]")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="[the preset's, else 128]")
    parser.add_argument("--use-amp", action="store_true", help="bfloat16 autocast (default: float32 with TF32)")
    parser.add_argument("--no-weight-grad-stream", dest="weight_grad_stream", action="store_false",
                        help="weight-gradient GEMMs on the main stream (default: on a second stream)")
    parser.add_argument("--equal-stream-priority", action="store_true",
                        help="the main stream at the second stream's priority (default: above it)")
    add_weight_gradient_dtype_arguments(parser)
    add_rope_arguments(parser)
    add_swiglu_arguments(parser)
    add_attention_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument("--torch-adamw", action="store_true",
                        help="torch.optim.AdamW(fused=True) and a separate bfloat16 weight copy (default: version "
                             "4's Triton AdamW, which writes the copies)")
    add_cublas_workspace_argument(parser)
    parser.add_argument("--steps", type=positive_int, default=200, help="timed replays [200]")
    parser.add_argument("--top", type=positive_int, default=45, help="kernel rows to print [45]")
    args = resolve_sizes(parser.parse_args(argv))
    # Sizes the kernels cannot take are refused first, on any machine, in one line.
    problem = shape_problem(args)
    if problem:
        parser.error(problem)
    if not torch.cuda.is_available():
        parser.error("needs a GPU (CUDA or ROCm): the step is a CUDA/HIP graph replay")
    from version4_triton_ultra import tiny_llama_v4 as v4
    problem = v4.forced_attention_problem(args, torch.device("cuda"), v4.gemm_dtype_of(train_config(args)),
                                          model_config(args).head_dim)
    if problem:
        parser.error(problem)
    return args


def resolve_sizes(args):
    """The preset's model settings (args.model_settings), and its batch size and sequence length where the flags
    gave none; without --preset, the seed model at batch 8 and sequence 128."""
    preset_model, preset_train = preset_settings(args.preset) if args.preset else ({}, {})
    args.model_settings = preset_model
    args.batch_size = args.batch_size or preset_train.get("batch_size", 8)
    args.seq_len = args.seq_len or preset_train.get("seq_len", 128)
    return args


def model_config(args) -> ModelConfig:
    """The preset's model (the seed model without --preset), with room for --seq-len."""
    settings = dict(args.model_settings)
    settings["max_seq_len"] = max(args.seq_len, settings.get("max_seq_len", ModelConfig().max_seq_len))
    return ModelConfig(**settings)


def shape_problem(args) -> str | None:
    """Version 4's shape rules (tiny_llama_v4.shape_problem) for the model at this batch and sequence."""
    from version4_triton_ultra import tiny_llama_v4 as v4
    return v4.shape_problem_of_run(args, model_config(args), train_config(args))


def train_config(args) -> TrainConfig:
    """The batch, sequence and precision of the step: bfloat16 autocast with --use-amp, else float32."""
    return TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, use_amp=args.use_amp, amp_dtype="bfloat16")


def build_step(args):
    """The model, its optimizer and version 4's GraphedStep, as the training script builds them."""
    from version4_triton_ultra import graphed_step
    from version4_triton_ultra import tiny_llama_v4 as v4
    # The training script's cuBLAS setting, before the process's first GEMM: it holds for every step built in this
    # process (compare_step_forms.py builds several; their forms share it).
    apply_cublas_workspace_argument(args, torch.device("cuda"))
    set_tf32(True)    # the training script's default (--tf32)
    config, train = model_config(args), train_config(args)
    model = v4.TinyLlama(config)
    model.capturable_optimizer = True
    model.use_triton_adamw = not args.torch_adamw
    model.use_rope_in_attention(args.rope_in_attention)
    model.use_separate_rope(args.separate_rope)
    model.use_separate_swiglu(args.separate_swiglu)
    model.use_vendor_attention(args.vendor_attention)
    use_launches_of(args)
    model.cuda()
    step = graphed_step.GraphedStep(model, model.configure_optimizer(train), torch.device("cuda"), train,
                                    weight_gradient_stream=args.weight_grad_stream,
                                    main_stream_first=not args.equal_stream_priority,
                                    sixteen_bit_weight_gradients=args.sixteen_bit_weight_grads,
                                    sixteen_bit_head_gradient=args.sixteen_bit_head_grad)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), device="cuda")
    return step, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def use_launches_of(args) -> None:
    """Launch the Triton kernels as args say (--no-programmatic-launch). A process-wide setting that a CUDA graph
    records as it captures: build_step sets it, and compare_step_forms.py holds each form's (launches_of) until
    that form's step is captured."""
    from version4_triton_ultra.kernels.programmatic_launch import set_programmatic_launch
    set_programmatic_launch(args.programmatic_launch)


@contextlib.contextmanager
def launches_of(args):
    """use_launches_of(args) inside the block; the setting from before it again afterwards."""
    from version4_triton_ultra.kernels.programmatic_launch import programmatic_launch_enabled, set_programmatic_launch
    before = programmatic_launch_enabled()
    use_launches_of(args)
    try:
        yield
    finally:
        set_programmatic_launch(before)


def median_step_ms(step, inputs, targets, steps: int) -> float:
    for _ in range(20):   # eager warm-up steps, the capture, and some replays
        step(inputs, targets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step(inputs, targets)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def profiled_kernels(step, inputs, targets, replays: int = PROFILED_REPLAYS) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel, memset and copy of `replays` replays under the PyTorch profiler,
    all streams, in order of start.

    One more replay runs first, unrecorded (the profiler's warm-up): the profiler's own start-up falls there, where
    it would show as idle time that a training run does not have. The GPU finishes it before the recorded replays
    start, and finishes those before the recording stops; in between, the host queues replays as the training
    script does."""
    from torch.profiler import ProfilerActivity, profile, schedule
    recording = schedule(wait=0, warmup=1, active=replays, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=recording) as prof:
        for index in range(replays + 1):
            step(inputs, targets)
            if index in (0, replays):
                torch.cuda.synchronize()
            prof.step()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]   # HIP kernels are "CUDA" too
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in kernels), key=lambda k: k[1])


def kernel_table(kernels, replays: int) -> tuple[list, float, float]:
    """([(name, launches per step, mean us, us per step)], sum of kernel time per step, device span per step)."""
    per_name = defaultdict(lambda: [0, 0.0])
    for name, start, end in kernels:
        per_name[name][0] += 1
        per_name[name][1] += end - start
    rows = sorted(((name, count / replays, total / count, total / replays)
                   for name, (count, total) in per_name.items()), key=lambda row: -row[3])
    span = (max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)) / replays
    return rows, sum(row[3] for row in rows), span


def idle_gaps(kernels, replays: int, min_gap_us: float = MIN_IDLE_GAP_US) -> tuple[float, list]:
    """Time in which no kernel of any stream ran: (idle us per step, [(us per step, gaps per step, kernel before,
    kernel after)] of the gaps of at least min_gap_us, grouped by the kernels around them, largest first).

    The kernels of all streams are merged on one time line; a gap is time between two busy stretches, named by
    the kernel that ended the stretch before it and the one that starts the next."""
    idle, grouped = 0.0, defaultdict(lambda: [0.0, 0])
    busy_until, last_name = None, None   # the end of the current busy stretch, and the kernel that ends it
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle += gap
            if gap >= min_gap_us:
                grouped[(last_name, name)][0] += gap
                grouped[(last_name, name)][1] += 1
        if busy_until is None or end > busy_until:
            busy_until, last_name = end, name
    rows = sorted(((total / replays, count / replays, before, after)
                   for (before, after), (total, count) in grouped.items()), key=lambda row: -row[0])
    return idle / replays, rows


def kernels_at_once(kernels, replays: int) -> tuple[float, float]:
    """(us per step in which exactly one kernel, memset or copy ran; us per step in which two or more did), any
    streams: a sweep over every start and end, in time order."""
    edges = sorted([(start, 1) for _, start, _ in kernels] + [(end, -1) for _, _, end in kernels])
    one, several, running, last = 0.0, 0.0, 0, None
    for time, change in edges:   # at equal times the ends (-1) come first
        if running == 1:
            one += time - last
        elif running >= 2:
            several += time - last
        running, last = running + change, time
    return one / replays, several / replays


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    step, inputs, targets = build_step(args)
    ms = median_step_ms(step, inputs, targets, args.steps)
    precision = "bfloat16 autocast" if args.use_amp else "float32 (TF32 GEMMs)"
    model = f"preset {args.preset}" if args.preset else "seed model"
    print(f"{torch.cuda.get_device_name()}, {model}, batch {args.batch_size}, seq {args.seq_len}, {precision}: "
          f"median {ms * 1000:.1f} us per step = {args.batch_size / ms * 1000:,.0f} samples/s")
    workspace = describe_cublas_workspace(on_gpu=True)
    if workspace:
        print(f"cuBLAS workspace: {workspace}")
    kernels = profiled_kernels(step, inputs, targets, PROFILED_REPLAYS)
    if not kernels:
        print("profile_graphed_step.py: the profiler recorded no GPU kernel (is its GPU tracing available here?)",
              file=sys.stderr)
        return 1
    rows, total_us, span_us = kernel_table(kernels, PROFILED_REPLAYS)
    launches = sum(row[1] for row in rows)
    print(f"under the profiler: {launches:.0f} kernels per step, {total_us:.1f} us of kernel time, "
          f"{span_us:.1f} us from first kernel to last")
    print(f"{'per step':>9} {'mean us':>8} {'us/step':>8}  kernel")
    for name, count, mean_us, step_us in rows[:args.top]:
        print(f"{count:9.1f} {mean_us:8.2f} {step_us:8.1f}  {name[:100]}")
    print(f"{'us/step':>9} {'share':>8}  kernel family")
    for family, step_us in family_totals(rows):
        print(f"{step_us:9.1f} {step_us / total_us:8.1%}  {family}")
    idle_us, gaps = idle_gaps(kernels, PROFILED_REPLAYS)
    print(f"GPU idle (no kernel of any stream running): {idle_us:.1f} us a step; gaps of {MIN_IDLE_GAP_US:g} us or "
          f"more by the kernels around them:")
    print(f"{'us/step':>9} {'gaps':>6}  kernel before -> kernel after")
    for gap_us, count, before, after in gaps[:IDLE_ROWS]:
        print(f"{gap_us:9.1f} {count:6.1f}  {before[:50]} -> {after[:50]}")
    one_us, several_us = kernels_at_once(kernels, PROFILED_REPLAYS)
    print(f"kernels running at once: one for {one_us:.1f} us a step, two or more for {several_us:.1f} us (the "
          f"streams side by side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
