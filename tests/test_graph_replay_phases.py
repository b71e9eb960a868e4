"""Kernel families by name, and the phases of a CUDA/HIP graph replay (tinytransformer/profiling/kernel_names.py):
a replay hides the record_function ranges, so version 4's step is split by kernel name and order instead."""
import json
from pathlib import Path

import pytest

from tinytransformer.profiling.analysis import family_split, kernels_per_step, phase_split, summarize
from tinytransformer.profiling.attribution import analysis_of
from tinytransformer.profiling.kernel_names import FAMILY_NAMES, family_of, is_graph_launch, replay_phases
from tinytransformer.profiling.report_cli import main as report_main
from tinytransformer.profiling.tables import write_reports
from tinytransformer.profiling.trace import trace_of

from .trace_samples import FLAVOURS, GPU_PID, HOST_PID, MAIN, STREAM, TraceBuilder

SIDE_STREAM = STREAM + 1
GRAPH_LAUNCH = {"cuda": ("cuda_runtime", "cudaGraphLaunch"), "rocm": ("cuda_runtime", "hipGraphLaunch")}


@pytest.mark.parametrize("name, family", [
    # vendor BLAS
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "gemm"),
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x32_MI16x16x1_SN_1LDSB0_APM1_ABV0", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(cublasLt::cublasSplitKParams"
     "<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "gemm"),
    # attention: PyTorch's SDPA kernels name cutlass in their template arguments
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, "
     "4, 2, 2, false, false, cutlass::bfloat16_t>, true>(pytorch_flash::Flash_bwd_params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::"
     "Sm80, cutlass::bfloat16_t, true, false, false, 64, 64, 64, false>::Params)", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
     "(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "attention"),
    # the loss: log-softmax is not attention's softmax
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
     "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", "cross_entropy"),
    ("triton_red_fused__log_softmax_nll_loss_forward_0", "cross_entropy"),
    ("_cross_entropy_rows_kernel", "cross_entropy"),
    ("_scale_pair_kernel", "cross_entropy"),
    ("_inverse_count_kernel", "cross_entropy"),
    # our Triton kernels
    ("_flash_attention_backward_dkdv_kernel", "attention"),
    # cuDNN's fused attention (version 4 at head dim 128 on Hopper): its kernels and its backward pass's helpers
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*, void*, void*, "
     "unsigned int)", "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)", "attention"),
    ("_add_rms_norm_backward_kernel", "rmsnorm"),
    ("_qkv_rope_kernel", "rope"),
    ("_rotate_qk_kernel", "rope"),
    ("_gate_up_swiglu_kernel", "swiglu"),
    ("_embedding_backward_kernel", "embedding"),
    ("_adamw_kernel", "optimizer"),
    # torch.compile's fused kernels: by what they fused, the autocast casts (_to_copy) left out
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "rmsnorm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("triton_poi_fused__to_copy_add_mul_0", "element-wise"),
    ("triton_per_fused_sum_2", "reduction"),
    # PyTorch's own kernels
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, float*>",
     "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16, float, 2, 1, 1>, "
     "at::native::(anonymous namespace)::Copy<c10::BFloat16, float> >", "copy / layout"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<3>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 3, 2, 0>, "
     "std::plus<float>, float>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy DtoD (Device -> Device)", "copy / layout"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>",
     "copy / layout"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()>, unsigned int, float, 4, 4> >", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3> >",
     "element-wise"),
    ("some_kernel_nobody_named", "other"),
])
def test_family_of_a_kernel_name(name, family):
    assert family_of(name) == family


def test_every_family_is_named_once_in_table_order():
    assert FAMILY_NAMES[-1] == "other" and len(set(FAMILY_NAMES)) == len(FAMILY_NAMES)
    assert {family_of(name) for name in ("_adamw_kernel", "multi_tensor_apply_kernel")} == {"optimizer"}


def test_graph_launch_calls():
    assert all(is_graph_launch(n) for n in ("cudaGraphLaunch", "cuGraphLaunch", "hipGraphLaunch"))
    assert not any(is_graph_launch(n) for n in ("cudaLaunchKernel", "cuLaunchKernel", "hipLaunchKernel"))


def test_replay_phases_forward_then_backward_and_the_optimizer_anywhere():
    names = ["_add_rms_norm_forward_kernel", "_qkv_rope_kernel", "_flash_attention_forward_kernel",
             "nvjet_gemm", "_gate_up_swiglu_kernel", "_cross_entropy_rows_kernel", "some_kernel",
             "_scale_pair_kernel", "nvjet_gemm", "_adamw_kernel", "_flash_attention_forward_kernel",
             "_add_rms_norm_backward_kernel", "_adamw_kernel"]
    assert replay_phases(names) == [
        "rmsnorm", "attention", "attention", "forward_other", "ffn", "loss", "forward_other",
        "backward",   # version 4's backward pass starts by scaling the gradients its fused loss computed
        "backward", "optimizer",
        "backward",   # after the first backward kernel, even a forward-looking name (a recomputation) is backward
        "backward", "optimizer"]
    # Not every multi-tensor kernel is the optimizer's: version 4's 16-bit weight copies run in the forward pass.
    copies = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
              "::TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16, float, 2, 1, 1>>")
    assert replay_phases([copies, "_qkv_rope_kernel"]) == ["forward_other", "attention"]
    assert replay_phases(["_rope_kernel", "vectorized_elementwise_kernel"]) == ["rope", "forward_other"]
    assert replay_phases([]) == []
    # cuDNN's attention (version 4 at head dim 128 on Hopper) names its passes fprop and bprop
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_{}_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0"
    assert replay_phases([cudnn.format("fprop"), cudnn.format("bprop")]) == ["attention", "backward"]


def replayed_step_trace(flavour: str) -> dict:
    """Two profiled steps of a graph-captured training step (version 4's shape: one replay per step, launched
    outside every range), kernels on two streams; then a graph launched inside a "backward" range, as
    torch.compile's reduce-overhead mode does, which keeps its range's phase."""
    t = TraceBuilder(FLAVOURS[flavour])
    cat, launch_name = GRAPH_LAUNCH[flavour]
    # (name, start offset, duration, stream): the order on the device, as a replay runs it.
    step = [("_add_rms_norm_forward_kernel", 10, 4, STREAM),        # rmsnorm 4
            ("_qkv_rope_kernel", 20, 10, STREAM),                    # attention 10
            ("_flash_attention_forward_kernel", 35, 20, STREAM),     # attention 20
            ("nvjet_sm90_gemm", 60, 8, STREAM),                      # forward_other 8
            ("_cross_entropy_rows_kernel", 70, 6, STREAM),           # loss 6
            ("_add_rms_norm_backward_kernel", 80, 5, STREAM),        # backward 5
            ("nvjet_sm90_gemm", 86, 9, SIDE_STREAM),                 # backward 9 (weight-gradient stream)
            ("_adamw_kernel", 96, 3, SIDE_STREAM),                   # optimizer 3 (the early update)
            ("_flash_attention_backward_dq_kernel", 90, 12, STREAM),  # backward 12
            ("_adamw_kernel", 105, 2, STREAM)]                       # optimizer 2
    for number, base, correlation in ((1, 0, 100), (2, 1000, 200)):
        t.annotate(f"ProfilerStep#{number}", base, base + 900)
        t._x(cat, launch_name, base + 5, base + 8, correlation=correlation)
        # The exporter writes the events stream by stream, not in time order: the side stream's kernels come
        # first in the file here, so only the sort by start time puts the backward GEMM after the forward pass.
        for name, offset, duration, stream in sorted(step, key=lambda kernel: -kernel[3]):
            t._x("kernel", name, base + offset, base + offset + duration, pid=GPU_PID, tid=stream,
                 correlation=correlation)
    # torch.compile's graphs, launched inside the "forward" and "backward" ranges of a third step: their kernels
    # keep the range's phase, whatever their names say
    t.annotate("ProfilerStep#3", 2000, 2900)
    t.annotate("forward", 2005, 2009)
    t._x(cat, launch_name, 2006, 2008, correlation=299)
    t._x("kernel", "triton_poi_fused_silu_backward_0", 2010, 2013, pid=GPU_PID, tid=STREAM, correlation=299)  # 3
    t.annotate("backward", 2010, 2500)
    t._x(cat, launch_name, 2020, 2023, correlation=300)
    t._x("kernel", "triton_poi_fused_mul_silu_0", 2030, 2037, pid=GPU_PID, tid=STREAM, correlation=300)   # 7
    return {"traceEvents": t.events}


@pytest.mark.parametrize("flavour", ["cuda", "rocm"])
def test_a_replayed_step_is_split_by_kernel_name_and_order(flavour):
    phases = phase_split(replayed_step_trace(flavour))
    per_step = {"rmsnorm": 4, "attention": 30, "forward_other": 8, "loss": 6, "backward": 26, "optimizer": 5}
    expected = {phase: 2.0 * us for phase, us in per_step.items()}
    expected["forward_other"] += 3.0   # the graphs launched inside a range keep its phase
    expected["backward"] += 7.0
    assert {phase: us for phase, us in phases["us"].items() if us} == expected
    assert phases["us"]["other"] == 0.0
    assert "20 events of CUDA/HIP graph replays by kernel name and order" in phases["label"]


def test_family_split_adds_up_to_the_device_time():
    rows = family_split(replayed_step_trace("cuda"))
    by_family = {row["family"]: row["us"] for row in rows}
    assert by_family == {"attention": 64.0, "gemm": 34.0, "optimizer": 10.0, "rmsnorm": 18.0,
                         "rope": 20.0, "cross_entropy": 12.0, "swiglu": 10.0}
    assert [row["us"] for row in rows] == sorted((row["us"] for row in rows), reverse=True)
    assert sum(row["pct"] for row in rows) == pytest.approx(100.0)
    assert rows[0]["us_per_step"] == pytest.approx(64.0 / 3)


def test_reports_carry_the_family_table(tmp_path, capsys):
    paths = write_reports(replayed_step_trace("cuda"), tmp_path)
    families = paths["families.csv"].read_text().splitlines()
    assert families[0] == "family,calls,us,pct,us_per_step" and families[1].startswith("attention,4,64.0,")
    assert "## Device time per kernel family (by kernel name)" in paths["summary.md"].read_text()
    trace_file = tmp_path / "replay.json"
    trace_file.write_text(json.dumps(replayed_step_trace("cuda")))
    assert report_main([str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "Device time per kernel family (by kernel name):" in out and "by kernel name and order" in out


def test_a_launch_that_is_not_a_graph_keeps_other():
    """Only replays are split by name: a plain kernel launched outside every range stays "other"."""
    t = TraceBuilder(FLAVOURS["cuda"])
    t.annotate("ProfilerStep#1", 0, 100)
    t.launched_kernel("_add_rms_norm_backward_kernel", 1, dur=5, at=10)
    phases = phase_split({"traceEvents": t.events})
    assert phases["us"]["other"] == 5.0 and phases["us"]["backward"] == 0.0
    assert "graph replays" not in phases["label"]


def with_work_launched_before_the_recording(flavour: str, external_id=None, correlation=40) -> dict:
    """replayed_step_trace, and on the GPU at its start three kernels of a replay launched before the recording:
    their launch is not in the trace, their correlation number is below the first recorded launch's (100)."""
    trace = replayed_step_trace(flavour)
    earlier = [("_add_rms_norm_backward_kernel", 5, STREAM), ("nvjet_sm90_gemm", 9, SIDE_STREAM),
               ("_adamw_kernel", 3, STREAM)]
    for offset, (name, duration, stream) in enumerate(earlier):
        args = {"correlation": correlation, **({"External id": external_id} if external_id is not None else {})}
        trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": name, "ts": 1 + offset, "dur": duration,
                                     "pid": GPU_PID, "tid": stream, "args": args})
    return trace


def add_operator(trace: dict, external_id: int) -> None:
    """A recorded host operator (aten::add) carrying this External id, early in the trace."""
    trace["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 2, "dur": 1,
                                 "pid": HOST_PID, "tid": MAIN, "args": {"External id": external_id}})


@pytest.mark.parametrize("flavour", ["cuda", "rocm"])
def test_work_launched_before_the_recording_is_left_out(flavour):
    """The host runs ahead of the GPU: the replay it launched a step before the recording began still runs when
    the recording starts. It is no part of the profiled steps, so it is left out of their time, phases and kernel
    count (kept, it would be 17 us of "other" and 2 more kernels a step)."""
    trace = with_work_launched_before_the_recording(flavour)
    # An operator whose External id happens to equal that correlation number changes nothing: the two count
    # different things.
    add_operator(trace, external_id=40)
    phases = phase_split(trace)
    assert phases["us"] == phase_split(replayed_step_trace(flavour))["us"]
    assert "left out: 3 events (0.0 ms) launched before the recording began" in phases["label"]
    assert kernels_per_step(trace) == kernels_per_step(replayed_step_trace(flavour))


@pytest.mark.parametrize("external_id, correlation", [(7, 40), (None, 0)],
                         ids=["an operator's External id", "no correlation number"])
def test_work_without_proof_of_an_earlier_launch_is_kept(external_id, correlation):
    """Kept as before (charged by its own start time, here "other"): an event a recorded operator's External id
    claims, whatever its correlation number (External ids are numbered apart from correlations), and one whose
    correlation number is 0."""
    trace = with_work_launched_before_the_recording("cuda", external_id=external_id, correlation=correlation)
    if external_id is not None:
        add_operator(trace, external_id)
    phases = phase_split(trace)
    assert "left out" not in phases["label"] and phases["us"]["other"] > 0


# Version 4's graph-captured step as torch.profiler recorded it on an H100 (bfloat16, 3 profiled steps, both
# streams): cd version4_triton_ultra && python run_pytorch_profiler.py --preset medium --use-amp --num-steps 12
# --warmup-steps 6 (and --preset large), the trace's name shortened. The recording starts while the step before
# the first profiled one still runs on the GPU (288 and 458 events).
V4_TRACES = {preset: Path(__file__).parent / "fixtures" / f"gpu_trace_v4_{preset}_h100.json.gz"
             for preset in ("medium", "large")}


def one_replay_of(trace) -> int:
    """Kernels of the first recorded graph replay, counted through their launch (the correlation number)."""
    analysis = analysis_of(trace_of(trace))
    first = min(dev.anchor.start for dev in analysis.device if dev.anchor is not None and is_graph_launch(dev.anchor.name))
    return sum(1 for dev in analysis.device if dev.kind == "kernel" and dev.anchor is not None
               and dev.anchor.start == first)


@pytest.mark.parametrize("preset", V4_TRACES)
def test_a_recorded_version_4_step_is_charged_to_its_phases_and_families(preset):
    trace = trace_of(V4_TRACES[preset])
    phases = phase_split(trace)
    assert phases["us"]["other"] < 0.001 * phases["total_us"]   # the run's own eager copies and the loss's .item()
    assert phases["us"]["backward"] > phases["us"]["forward_other"] > 0 and phases["us"]["optimizer"] > 0
    assert "left out:" in phases["label"] and "launched before the recording began" in phases["label"]
    families = {row["family"]: row["us"] for row in family_split(trace)}
    assert "other" not in families
    assert {"gemm", "attention", "rmsnorm", "swiglu", "rope", "optimizer", "cross_entropy"} <= set(families)
    loop_kernels = 4   # a step's eager copies and casts around the replay (the batch in, the loss out)
    assert summarize(trace)["kernels_per_step"] == one_replay_of(trace) + loop_kernels
