"""Test set-up: Triton's interpreter on CPU-only machines, the repository root on sys.path, the gpu and
interpreter markers."""
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tinytransformer import triton_support  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

# Before any test module imports triton: on a machine without a GPU, kernels run in the interpreter.
enable_interpreter_if_no_gpu()

import torch  # noqa: E402

from tinytransformer.precision import restore_state, saved_state  # noqa: E402

HAS_GPU = torch.cuda.is_available()
# Triton chooses once per process, when a kernel is defined, between compiling for the GPU and interpreting on the
# CPU. Where this process sees a GPU, it compiles, and a Triton kernel handed CPU tensors cannot run.
INTERPRETER_ON = triton_support.interpreter_active()

RUN_INTERPRETER_TESTS = "CUDA_VISIBLE_DEVICES= python -m pytest -q -m interpreter"


def pytest_collection_modifyitems(config, items):
    if not HAS_GPU:
        skip_gpu = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm); none found")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    if not INTERPRETER_ON:
        skip_interpreter = pytest.mark.skip(
            reason="runs Triton kernels on the CPU in this process, and this process compiles Triton for its GPU; "
                   f"these run with: {RUN_INTERPRETER_TESTS}")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip_interpreter)


# ----------------------------------------------------------------------------------------------------------
# Where a test's Triton kernels run must be said, so that the same suite passes on a GPU machine
# ----------------------------------------------------------------------------------------------------------
# A test that launches Triton kernels in its own process either follows the machine (it asks for the `device`
# fixture: the GPU where there is one, else the interpreter) or runs them on the CPU whatever the machine has (it
# is marked `interpreter`, and skipped where Triton compiles for a GPU). On a machine without a GPU both kinds run
# in the interpreter and look alike, so the interpreter counts launches here, and a test that launched kernels
# without saying which kind it is fails: on a GPU machine it would have handed CPU tensors to compiled kernels.
# A test that starts a child process running version 3 or 4 with --device cpu gives it TRITON_INTERPRET=1 in its
# environment itself. Here, without a GPU, the child inherits the variable from this process and passes either way;
# on a GPU machine this process never sets it, and the child, compiling for the GPU, refuses the CPU run.
interpreted_launches = [0]

if INTERPRETER_ON:
    from triton.runtime.interpreter import InterpretedFunction

    _interpret = InterpretedFunction.run

    def _counted_interpret(self, *args, **kwargs):
        interpreted_launches[0] += 1
        return _interpret(self, *args, **kwargs)

    InterpretedFunction.run = _counted_interpret


@pytest.fixture(autouse=True)
def triton_launches_say_where_they_run(request):
    # Every test is held to it, the slow ones included: a test that launches Triton kernels in its own process
    # says whether they run on the GPU (the `device` fixture, or the gpu mark) or on CPU tensors (interpreter).
    said = ({"gpu", "interpreter"} & set(request.node.keywords)) or "device" in request.fixturenames
    before = interpreted_launches[0]
    yield
    if INTERPRETER_ON and not said and interpreted_launches[0] > before:
        pytest.fail("this test launched Triton kernels without saying where they run: ask for the `device` "
                    "fixture (the GPU where there is one) or mark it @pytest.mark.interpreter (CPU tensors, "
                    "skipped where Triton compiles for a GPU)", pytrace=False)


@pytest.fixture
def device():
    """The device kernel tests run on: the GPU when there is one, else the CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture
def small_interpreter_blocks(monkeypatch):
    """In Triton's interpreter, every kernel takes its smallest blocks instead of blocks that fit the problem
    (tinytransformer/triton_support.py): the tests of the kernels themselves use it, so that their small problems
    span several blocks and cover the loops and masks that a GPU's large blocks cover on large problems. Tests of
    models and scripts run without it, with the blocks a CPU run gets."""
    monkeypatch.setattr(triton_support, "SMALL_INTERPRETER_BLOCKS", True)


@pytest.fixture
def known_gpu(monkeypatch):
    """use_known_gpu, for tests of launch choices made for a GPU this machine need not have (the kernel report's
    stand-in: meta tensors, the GPU's published limits), with the interpreter switched off so that the GPU rules
    answer; the process's own GPU again afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    yield triton_support.use_known_gpu
    triton_support.use_known_gpu(None)


@pytest.fixture
def graph_counting_backend():
    """(backend, graphs): a torch.compile backend that only records each graph dynamo hands it and runs it
    unchanged (no code generation, so tracing tests stay fast), and the list it records into."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()   # graphs cached by an earlier test would not be handed over again
    yield backend, graphs
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def restore_tf32_switches():
    """Each test starts and ends with the same TF32 settings. The training scripts switch TF32 on for their whole
    process (version 4's --tf32 default); run inside pytest, that would leak into the float32 kernel tests that
    follow, whose tolerances assume IEEE float32 matmuls."""
    state = saved_state()
    yield
    restore_state(state)
