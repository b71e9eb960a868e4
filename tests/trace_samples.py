"""Traces for the tests of tinytransformer/profiling/ (test_trace_*.py, test_report_cli.py) and of the workshop's
trace scripts:
- a hand-made GPU-style trace with known numbers, in three flavours: CUDA, ROCm, and one where every launch is a
  driver call; every expected number is worked out by hand in the comments;
- CPU_TRACE, recorded by tests/fixtures/make_cpu_trace.py with torch on the CPU;
- BAD_FILES, files that are not traces, each in its own way.
"""
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CPU_TRACE = FIXTURES / "cpu_trace.json.gz"

HOST_PID, MAIN, AUTOGRAD = 4242, 4242, 4250  # process, main thread, autograd's device thread
GPU_PID, STREAM = 0, 7

# How each vendor names things. The analysis must only rely on categories and links, never on these names.
FLAVOURS = {
    "cuda": {
        "launch": ("cuda_runtime", "cudaLaunchKernel"),
        "driver_launch": ("cuda_driver", "cuLaunchKernel"),
        "memcpy": ("cuda_runtime", "cudaMemcpyAsync"),
        "memset": ("cuda_runtime", "cudaMemsetAsync"),
        "gemm": "ampere_sgemm_128x64_tn",
    },
    "rocm": {
        "launch": ("cuda_runtime", "hipLaunchKernel"),
        "driver_launch": ("cuda_runtime", "hipModuleLaunchKernel"),
        "memcpy": ("cuda_runtime", "hipMemcpyWithStream"),
        "memset": ("cuda_runtime", "hipMemsetAsync"),
        "gemm": "Cijk_Ailk_Bljk_SB_MT64x64x16_SN_1LDSB0",
    },
    "driver_only": {  # e.g. a fully Triton model: every launch is a driver call
        "launch": ("cuda_driver", "cuLaunchKernel"),
        "driver_launch": ("cuda_driver", "cuLaunchKernel"),
        "memcpy": ("cuda_driver", "cuMemcpyAsync"),
        "memset": ("cuda_driver", "cuMemsetD32Async"),
        "gemm": "matmul_kernel_0d1d2d3d",
    },
}


class TraceBuilder:
    """Writes events the way torch's exporter does (float us, args with correlation / External id)."""

    def __init__(self, flavour: dict):
        self.flavour = flavour
        self.events = [
            {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_name", "pid": GPU_PID, "tid": 0, "args": {"name": "GPU 0"}},
        ]
        self.external_id = 0

    def _x(self, cat, name, start, end, pid=HOST_PID, tid=MAIN, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": float(start), "dur": float(end - start), "args": args})

    def annotate(self, name, start, end, tid=MAIN):
        self.external_id += 1
        self._x("user_annotation", name, start, end, tid=tid, **{"External id": self.external_id})

    def op(self, name, start, end, tid=MAIN) -> int:
        self.external_id += 1
        self._x("cpu_op", name, start, end, tid=tid, **{"External id": self.external_id})
        return self.external_id

    def launch(self, correlation, start, tid=MAIN, which="launch", external_id=None):
        cat, name = self.flavour[which]
        args = {"correlation": correlation, "cbid": 211}
        if external_id is not None:
            args["External id"] = external_id
        self._x(cat, name, start, start + 5, tid=tid, **args)

    def memory(self, size, at, device=True, tid=MAIN):
        """An allocation (size > 0) or a free (size < 0), as profile_memory=True records them."""
        args = {"Bytes": size, "Device Type": 1 if device else 0, "Device Id": 0 if device else -1}
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                            "pid": HOST_PID, "tid": tid, "ts": float(at), "args": args})

    def kernel(self, name, correlation, dur, start, cat="kernel", external_id=None):
        name = self.flavour.get(name, name)
        args = {"device": 0, "stream": STREAM, "grid": [4, 1, 1], "block": [256, 1, 1]}
        if correlation is not None:
            args["correlation"] = correlation
        if external_id is not None:
            args["External id"] = external_id
        self._x(cat, name, start, start + dur, pid=GPU_PID, tid=STREAM, **args)
        # torch also writes a flow arrow from launch to kernel, and replays ranges on the GPU timeline
        self.events.append({"ph": "f", "id": correlation, "pid": GPU_PID, "tid": STREAM, "ts": float(start),
                            "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def launched_kernel(self, name, correlation, dur, at, tid=MAIN, which="launch", cat="kernel"):
        """A launch call at `at` on the host and its kernel 5 us later on the GPU."""
        self.launch(correlation, at, tid=tid, which=which)
        self.kernel(name, correlation, dur, start=at + 5, cat=cat)


def build_gpu_trace(flavour="cuda", with_backward_range=True, with_autograd_wrapper=True) -> dict:
    t = TraceBuilder(FLAVOURS[flavour])

    # ---- step 1: [0, 1000] --------------------------------------------------------------------------------
    t.annotate("ProfilerStep#1", 0, 1000)
    t.annotate("forward", 10, 400)
    t.op("aten::embedding", 12, 18)
    t.memory(64, at=12.5, device=False)  # CPU memory: aten::embedding +64 (before its launch call)
    t.launched_kernel("embedding_kernel", 1, dur=2, at=13)  # forward_other: 2
    t.annotate("rmsnorm", 20, 60)
    t.op("aten::mul", 25, 55)
    t.launched_kernel("mul_kernel", 2, dur=4, at=30)  # rmsnorm: 4
    t.annotate("rope", 70, 90)
    # A Triton kernel launched straight from Python: no op around it, the launch call owns it.
    t.launched_kernel("triton_rope_kernel", 14, dur=7, at=75, which="driver_launch")  # rope: 7
    t.annotate("attention", 100, 300)
    t.op("aten::mm", 110, 200)
    t.memory(4096, at=115)  # device memory: aten::mm +4096
    t.launched_kernel("gemm", 3, dur=50, at=120)  # attention: 50
    t.op("aten::softmax", 210, 290)
    t.op("aten::_softmax", 220, 280)
    t.memory(1024, at=225)  # aten::_softmax +1024 (self and total), aten::softmax +1024 (total)
    t.launched_kernel("softmax_kernel", 4, dur=10, at=230, which="driver_launch")  # attention: 10
    t.memory(-1024, at=285)  # after aten::_softmax ended: aten::softmax -1024 (self and total)
    t.annotate("ffn", 300, 390)
    t.op("aten::mm", 310, 380)
    t.launched_kernel("gemm", 5, dur=30, at=320)  # ffn: 30
    if with_backward_range:
        t.annotate("backward", 400, 800)
    # The autograd engine runs the backward pass on its own thread: the range above does not enclose it.
    if with_autograd_wrapper:
        t.op("autograd::engine::evaluate_function: MmBackward0", 410, 500, tid=AUTOGRAD)
    t.op("MmBackward0", 412, 498, tid=AUTOGRAD)
    t.op("aten::mm", 420, 490, tid=AUTOGRAD)
    t.launched_kernel("gemm", 6, dur=60, at=430, tid=AUTOGRAD)  # backward: 60
    t.annotate("optimizer", 800, 900)
    t.op("aten::_foreach_add_", 810, 850)
    t.launched_kernel("multi_tensor_apply_kernel", 7, dur=8, at=820)  # optimizer: 8
    t.op("aten::zero_", 860, 880)
    t.launched_kernel("Memset (Device)", 8, dur=1, at=865, which="memset", cat="gpu_memset")  # optimizer: 1
    t.op("aten::copy_", 950, 970)
    t.launched_kernel("Memcpy HtoD (Pageable -> Device)", 9, dur=3, at=955, which="memcpy",
                      cat="gpu_memcpy")  # other: 3
    t.launch(99, 980)  # a runtime call that launches nothing (think cudaDeviceSynchronize)

    # ---- step 2: [1000, 2000] -----------------------------------------------------------------------------
    t.annotate("ProfilerStep#2", 1000, 2000)
    t.annotate("forward", 1010, 1420)
    t.annotate("attention", 1100, 1300)
    mm_id = t.op("aten::mm", 1110, 1200)
    t.launched_kernel("gemm", 10, dur=50, at=1120)  # attention: 50
    # A kernel whose launch is missing from the trace: linked to its op through "External id".
    t.kernel("gemm", 11, dur=40, start=1190, external_id=mm_id)  # attention: 40
    t.annotate("rope", 1210, 1260)  # nested inside attention: the innermost range wins
    t.op("aten::mul", 1215, 1255)
    t.launched_kernel("mul_kernel", 17, dur=4, at=1220)  # rope: 4
    t.annotate("output_head", 1300, 1350)
    t.op("aten::mm", 1305, 1345)
    t.launched_kernel("gemm", 15, dur=20, at=1310)  # output_head: 20
    t.annotate("loss", 1350, 1400)
    t.op("aten::nll_loss", 1355, 1395)
    t.launched_kernel("nll_loss_kernel", 16, dur=3, at=1360)  # loss: 3
    # A kernel linked to nothing: it keeps its own start time (1500, inside step 2).
    t.kernel("mystery_kernel", 12, dur=5, start=1500)  # other: 5, charged to no operator

    # ---- after the last step ------------------------------------------------------------------------------
    t.op("aten::add", 2100, 2150)
    t.launched_kernel("add_kernel", 13, dur=6, at=2110)  # other: 6, in no step

    # ---- noise the analysis must ignore ------------------------------------------------------------------
    t.events += [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": GPU_PID, "tid": STREAM,
         "ts": 0.0, "dur": 1000.0, "args": {}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "attention", "pid": GPU_PID, "tid": STREAM,
         "ts": 120.0, "dur": 500.0, "args": {}},
        {"ph": "X", "cat": "python_function", "name": "train.py(10): step", "pid": HOST_PID, "tid": MAIN,
         "ts": 5.0, "dur": 990.0, "args": {"Python id": 1}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 0.0, "dur": 3000.0, "args": {"Op count": 0}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": HOST_PID, "tid": MAIN, "ts": 50.0,
         "s": "t", "args": {}},
        {"ph": "s", "id": 3, "pid": HOST_PID, "tid": MAIN, "ts": 120.0, "cat": "ac2g", "name": "ac2g"},
        {"ph": "X", "cat": "kernel", "name": "broken_kernel", "pid": GPU_PID, "tid": STREAM, "ts": "n/a",
         "dur": 1.0, "args": {}},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Test GPU"}], "displayTimeUnit": "ms",
            "traceEvents": t.events}


# Worked out by hand from the comments above.
EXPECTED_DEVICE_US = 303.0  # 2+4+7+50+10+30+60+8+1+3 (step 1) + 50+40+4+20+3+5 (step 2) + 6 (after)
EXPECTED_KERNELS_PER_STEP = 7.0  # step 1: 8 kernels (the memset and memcpy are not kernels), step 2: 6
EXPECTED_OPERATORS_PER_STEP = 6.5  # step 1: 9 top-level aten ops (aten::_softmax is nested), step 2: 4
EXPECTED_PHASE_US = {
    "attention": 150.0,  # 50 + 10 + 50 + 40
    "ffn": 30.0,
    "rmsnorm": 4.0,
    "rope": 11.0,  # 7 + 4
    "output_head": 20.0,
    "loss": 3.0,
    "forward_other": 2.0,
    "backward": 60.0,
    "optimizer": 9.0,  # 8 + 1 (memset)
    "other": 14.0,  # 3 (memcpy) + 5 (unlinked) + 6 (after the steps)
}
# operator -> (calls, self device us, total device us)
EXPECTED_OPERATORS = {
    "aten::mm": (5, 250.0, 250.0),  # 50 + 30 + 60 + 50 + 40 (via External id) + 20
    "aten::softmax": (1, 0.0, 10.0),
    "aten::_softmax": (1, 10.0, 10.0),
    "aten::mul": (2, 8.0, 8.0),
    "aten::embedding": (1, 2.0, 2.0),
    "MmBackward0": (1, 0.0, 60.0),
    "autograd::engine::evaluate_function: MmBackward0": (1, 0.0, 60.0),
    "aten::_foreach_add_": (1, 8.0, 8.0),
    "aten::zero_": (1, 1.0, 1.0),
    "aten::copy_": (1, 3.0, 3.0),
    "aten::nll_loss": (1, 3.0, 3.0),
    "aten::add": (1, 6.0, 6.0),
}
EXPECTED_UNATTRIBUTED_US = 5.0  # the mystery kernel
# operator -> (self device bytes, total device bytes); aten::mm's 4096 were allocated in step 1 only
EXPECTED_DEVICE_MEMORY = {
    "aten::mm": (4096, 4096),
    "aten::_softmax": (1024, 1024),
    "aten::softmax": (-1024, 0),
}

BAD_FILES = {
    "missing.json": None,
    "random.bin": bytes(range(256)) * 4,
    "not_utf8.json": b"\xff\xfe\x00garbage",
    "truncated.json": b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1',
    "object.json": b'{"hello": "world"}',
    "numbers.json": b"[1, 2, 3]",
    "no_events.json": b'{"traceEvents": []}',
    "only_metadata.json": b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {}}]}',
    "bad_gzip.json.gz": b"\x1f\x8b" + b"not really gzip",
}
