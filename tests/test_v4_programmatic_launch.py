"""Programmatic dependent launch (version4_triton_ultra/kernels/programmatic_launch.py).

Which GPUs get it, that every kernel of version 4 waits for the kernel before it before anything else and that
every launch passes the options (read from the source, so a new kernel without them fails here), what the
compiler makes of it for Hopper and for AMD, and on a GPU that a chain of dependent kernels in a CUDA graph, each
launched early, still sees every write of the one before it.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer import triton_support
from version4_triton_ultra.kernels import programmatic_launch as pl

REPO = Path(__file__).resolve().parent.parent
KERNEL_DIR = REPO / "version4_triton_ultra" / "kernels"
# Every file of kernels/ but the helpers that kernels call (no kernels, no launches of their own).
HELPER_FILES = ("__init__.py", "programmatic_launch.py", "sixteen_bit_gradients.py", "whole_tiles.py")
KERNEL_FILES = sorted(path for path in KERNEL_DIR.glob("*.py") if path.name not in HELPER_FILES)


@pytest.fixture
def launch_switch():
    """The process-wide switch, restored after the test."""
    yield pl.set_programmatic_launch
    pl.set_programmatic_launch(True)


@pytest.mark.parametrize("target, expected", [("sm_90", True), ("sm_80", False), ("gfx942", False),
                                              ("gfx90a", False)])
def test_only_hopper_and_later_nvidia_gpus_launch_early(known_gpu, target, expected):
    known_gpu(triton_support.KNOWN_GPUS[target])
    options = pl.launch_options(torch.device("meta"))
    assert options == ({"PDL": True, "launch_pdl": True} if expected else {})


def test_the_switch_turns_it_off(known_gpu, launch_switch):
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    launch_switch(False)
    assert pl.launch_options(torch.device("meta")) == {}
    launch_switch(True)
    assert pl.launch_options(torch.device("meta")) == {"PDL": True, "launch_pdl": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_the_cpu_and_the_interpreter_launch_as_always():
    assert pl.launch_options(torch.device("cpu")) == {}


def _jit_kernels(tree):
    """The @triton.jit functions of a module whose names end in _kernel: the ones launched from the host."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                ast.unparse(decorator) == "triton.jit" for decorator in node.decorator_list):
            yield node


def _first_statement(function):
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if has_docstring else body[0]


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda path: path.name)
def test_every_kernel_waits_for_the_previous_one_first(path):
    kernels = list(_jit_kernels(ast.parse(path.read_text())))
    assert kernels, f"{path.name}: no kernels found"
    for kernel in kernels:
        arguments = kernel.args
        names = [argument.arg for argument in arguments.args]
        assert "PDL" in names, f"{kernel.name} has no PDL parameter"
        defaults = dict(zip(names[len(names) - len(arguments.defaults):], arguments.defaults))
        default = ast.unparse(defaults.get("PDL", ast.Constant(None)))
        assert default == "False", f"{kernel.name}: PDL must default to False"
        assert ast.unparse(_first_statement(kernel)) == "wait_for_previous_kernel(PDL)", (
            f"{kernel.name} must start with wait_for_previous_kernel(PDL): nothing may read or write before it")


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda path: path.name)
def test_every_launch_passes_the_launch_options(path):
    tree = ast.parse(path.read_text())
    kernel_names = {kernel.name for kernel in _jit_kernels(tree)}
    launches = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in kernel_names]
    assert launches, f"{path.name}: no launches found"
    for launch in launches:
        spread = [ast.unparse(keyword.value) for keyword in launch.keywords if keyword.arg is None]
        assert any(text.startswith("launch_options(") for text in spread), (
            f"{path.name}: the launch of {launch.func.value.id} (line {launch.lineno}) lacks **launch_options(...)")


# Compiled in a process of its own: the tests run with Triton's interpreter on, whose kernels do not compile.
COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from version4_triton_ultra.kernels.swiglu_elementwise import _separate_swiglu_forward_kernel as kernel
def compiled(target, pdl):
    source = ASTSource(kernel, {"gate_up_ptr": "*bf16", "h_ptr": "*bf16", "n_ffn": "i32"}, {"BLOCK": 1024, "PDL": pdl})
    options = {"num_warps": 8, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(source, target=target, options=options).asm
print(json.dumps({"early": compiled(GPUTarget("cuda", 90, 32), True)["ptx"],
                  "plain": compiled(GPUTarget("cuda", 90, 32), False)["ptx"],
                  "amd": len(compiled(GPUTarget("hip", "gfx942", 64), False)["amdgcn"])}))
"""


@pytest.fixture(scope="module")
def compiled_code():
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hopper_code_waits_before_its_first_load(compiled_code):
    early = compiled_code["early"]
    assert "griddepcontrol.wait" in early
    assert "griddepcontrol.launch_dependents" not in early   # see the module: never said early
    assert early.index("griddepcontrol.wait") < early.index("ld.global")   # before the first load
    assert "griddepcontrol" not in compiled_code["plain"]


def test_amd_code_compiles_without_it(compiled_code):
    assert compiled_code["amd"] > 0


@pytest.mark.gpu
def test_a_chain_of_early_launches_in_a_graph_sees_every_write(launch_switch):
    """40 in-place doublings of one large tensor, each kernel launched early (on Hopper) in one CUDA graph: a
    kernel that read before the one before it had written would double a value too few times."""
    from version4_triton_ultra.kernels.linear_cross_entropy import scaled_pair
    launch_switch(True)
    start = torch.rand(64 * 1024 * 1024, device="cuda", dtype=torch.float32) + 1.0
    x = start.clone()
    two = torch.full((1,), 2.0, device="cuda")
    scaled_pair(x, torch.float32, None, None, two, in_place=True)   # compile before capturing
    x.copy_(start)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(40):
            scaled_pair(x, torch.float32, None, None, two, in_place=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        x.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, start * 2.0 ** 40)
