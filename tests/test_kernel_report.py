"""The kernel report (benchmarks/kernel_report/): every Triton kernel of versions 3 and 4 compiles for AMD
and NVIDIA GPUs without one, its resources are read right, and the committed table is the committed JSON's.

The compile checks start the report as a process of its own: this test process defined the kernels for Triton's
CPU interpreter, and the report needs them defined for a GPU."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinytransformer import triton_support
from benchmarks.kernel_report import amd, nvidia, occupancy, render
from benchmarks.kernel_report.cli import main
from benchmarks.kernel_report.targets import TARGETS

REPO = Path(__file__).resolve().parent.parent
COMMITTED_JSON = REPO / "benchmarks" / "results" / "kernels" / "kernel_report.json"
COMMITTED_TABLE = REPO / "version4_triton_ultra" / "README.md"
KERNEL_DIRS = ("version3_triton", "version4_triton_ultra")


def _is_triton_jit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def launchable_kernels() -> set[tuple[str, str]]:
    """(file, name) of every @triton.jit function of versions 3 and 4 that no other one calls: the kernels that
    Python code launches (the others are helpers, compiled into their callers)."""
    functions = {}
    for directory in KERNEL_DIRS:
        for path in sorted((REPO / directory).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                    functions[(path.relative_to(REPO).as_posix(), node.name)] = node
    called = {call.func.id for node in functions.values() for call in ast.walk(node)
              if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)}
    return {key for key in functions if key[1] not in called}


def run_report(*flags, timeout=600):
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "benchmarks.kernel_report", *flags], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=timeout)


def check_every_kernel_compiles(rows, targets):
    kernels = launchable_kernels()
    assert len(kernels) >= 20   # the scan found the kernels (guards the test itself)
    for target in targets:
        mine = [r for r in rows if r["target"] == target]
        assert {(r["source"], r["kernel"]) for r in mine} == kernels, f"{target}: kernels not compiled"
        failed = [f"{r['kernel']}: {r['error']}" for r in mine if r["status"] != "ok"]
        assert not failed, f"{target}: {failed}"


def test_every_kernel_compiles_for_mi300_and_h100(tmp_path):
    """CI: each kernel once (its first configuration at the tiny preset) for gfx942 and sm_90."""
    out = tmp_path / "report.json"
    result = run_report("--targets", "gfx942,sm_90", "--presets", "tiny", "--quick", "--output-json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    check_every_kernel_compiles(doc["rows"], ["gfx942", "sm_90"])
    for row in doc["rows"]:
        assert row["registers"] > 0 and 0 < row["occupancy"]["value"] <= row["occupancy"]["max"]
    # The configurations are the vendor's: AMD's wavefront of 64 gives fewer warps for the same block.
    configs = {(r["target"], r["kernel"]): r["config"] for r in doc["rows"]}
    assert configs[("gfx942", "_swiglu_forward_kernel")]["num_warps"] \
        < configs[("sm_90", "_swiglu_forward_kernel")]["num_warps"]
    # The shared-memory rule answers from the target's limit: AMD's 64 KiB of LDS gets shallower GEMM tiles.
    assert configs[("gfx942", "_qkv_rope_kernel")]["BLOCK_K"] < configs[("sm_90", "_qkv_rope_kernel")]["BLOCK_K"]
    assert "_flash_attention_backward_dkdv_kernel" in result.stdout


# ------------------------------------------------------------------ the 16-bit attention tiles (attention_tiles.py)
def run_check(module: str, *flags, code=None):
    """python -m benchmarks.kernel_report.MODULE FLAGS, or `code` run the same way (a process of its own,
    interpreter off)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = ["-c", code] if code else ["-m", f"benchmarks.kernel_report.{module}", *flags]
    return subprocess.run([sys.executable, *command], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=600)


def run_check_patched(module: str, kernels: str, patch: str):
    """The check MODULE on sm_90 after `patch` (a line of Python that may name `kernels`, a module of
    version4_triton_ultra/kernels/) has changed a rule of version 4's kernels."""
    code = ("import sys\n"
            f"from benchmarks.kernel_report import discovery, {module}\n"
            "discovery.import_versions()\n"
            f"from version4_triton_ultra.kernels import {kernels}\n"
            f"{patch}\n"
            f"sys.exit({module}.main(['--targets', 'sm_90']))\n")
    return run_check(module, code=code)


def run_attention_tiles(*flags):
    return run_check("attention_tiles", *flags)


def test_16_bit_attention_tiles_fit_the_h100_and_the_mi300():
    """The tiles version 4's attention picks for bfloat16 at head dims 64 and 128 compile and fit: on sm_90 the
    pipelined Hopper tiles (3 stages in the forward without RoPE on load), on gfx942 version 3's."""
    result = run_attention_tiles("--targets", "sm_90,gfx942")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "16 of 16 launch configurations compile and fit" in result.stdout
    lines = result.stdout.splitlines()
    assert any(line.startswith("sm_90") and "Dh 128" in line and "no RoPE" in line and "64x64 w4 s3" in line
               for line in lines)
    assert not any(line.startswith("gfx942") and " s3 " in line for line in lines)


def test_attention_tiles_catch_a_forward_that_does_not_fit():
    """Three stages for the forward with RoPE on load at head dim 128 ask for more shared memory than an H100 has
    (the GPU refused that launch, which is why that forward keeps one stage): the check says so and fails."""
    result = run_check_patched("attention_tiles", "flash_attention", (
        "flash_attention._hopper_launch_config = lambda head_dim, kernel, rope_on_load: "
        "dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    too_big = [line for line in result.stdout.splitlines() if "does not fit" in line]
    assert len(too_big) == 1 and "Dh 128" in too_big[0] and "RoPE on load" in too_big[0]


def test_attention_tiles_refuse_an_unknown_target():
    result = run_attention_tiles("--targets", "sm_99")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--targets" in result.stderr


# ------------------------------------------------------------------ the norm backward's layouts (norm_layouts.py)
def run_norm_layouts(*flags):
    return run_check("norm_layouts", *flags)


def test_the_norm_backward_keeps_one_layout_in_its_loop():
    """In the bfloat16 step's form, at every preset's width, compiled for an H100 and an MI300: no layout move
    inside the tile loop, each tensor at 4 columns a thread."""
    result = run_norm_layouts("--targets", "sm_90,gfx942")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "layout moves in the loop" in line]
    assert len(lines) == 8 and all(line.endswith("layout moves in the loop: 0") for line in lines)
    assert all("vector 4" in line for line in lines)
    assert "8 of 8 launches compile with no layout move inside a loop" in result.stdout


def test_the_norm_layout_check_catches_a_move_in_the_loop():
    """Each tensor laid out by its own dtype (the kernel before _shared_vector): the float32 grad_h moves from the
    bfloat16 loads' layout to the float32 store's in every tile, and the check fails."""
    result = run_check_patched("norm_layouts", "add_rmsnorm", "add_rmsnorm._shared_vector = lambda *dtypes: 0")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "layout moves in the loop" in line]
    assert len(lines) == 4 and all(line.endswith("layout moves in the loop: 1") for line in lines)


def test_layout_moves_are_counted_inside_loops_only():
    from benchmarks.kernel_report.norm_layouts import layout_moves_in_loops
    ttgir = "\n".join([
        "tt.func public @k() {",
        "  %a = ttg.convert_layout %x : tensor<4xf32, #a> -> tensor<4xf32, #b>",       # outside: not counted
        "  %r = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<4xf32>) {",
        "    %b = ttg.convert_layout %acc : tensor<4xf32, #a> -> tensor<4xf32, #b>",   # counted
        "    %c = scf.if %p -> (tensor<4xf32>) {",
        "      %d = ttg.convert_layout %b : tensor<4xf32, #b> -> tensor<4xf32, #a>",   # counted: in the loop's if
        "    } else {",
        "      %e = ttg.convert_layout %b : tensor<4xf32, #b> -> tensor<4xf32, #a>",   # counted
        "    }",
        "    scf.yield %c : tensor<4xf32>",
        "  }",
        "  %f = scf.if %p -> (tensor<4xf32>) {",
        "    %g = ttg.convert_layout %r : tensor<4xf32, #a> -> tensor<4xf32, #b>",     # an if, not a loop
        "  }",
        "  tt.return",
        "}"])
    assert layout_moves_in_loops(ttgir) == 3
    assert layout_moves_in_loops("") == 0


def test_norm_layouts_refuses_an_unknown_target():
    result = run_norm_layouts("--targets", "sm_99")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--targets" in result.stderr


@pytest.mark.slow
def test_full_matrix_compiles_and_fits(tmp_path):
    """Every kernel, every launch configuration of every preset, on all four targets."""
    out = tmp_path / "report.json"
    result = run_report("--output-json", str(out), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    check_every_kernel_compiles(doc["rows"], list(TARGETS))
    assert {p for r in doc["rows"] for p in r["presets"]} == {"tiny", "small", "medium", "large"}


def test_committed_report_covers_every_kernel_and_target():
    doc = json.loads(COMMITTED_JSON.read_text())
    assert list(doc["targets"]) == list(TARGETS) and doc["presets"] == ["large", "medium", "small", "tiny"]
    check_every_kernel_compiles(doc["rows"], list(TARGETS))


def test_committed_table_is_generated_from_the_committed_json():
    doc = json.loads(COMMITTED_JSON.read_text())
    committed = render.committed_block(COMMITTED_TABLE.read_text(encoding="utf-8"))
    assert committed is not None, f"no generated block in {COMMITTED_TABLE}"
    assert committed == render.markdown(doc), (
        "regenerate it: python -m benchmarks.kernel_report --from-json "
        "benchmarks/results/kernels/kernel_report.json --markdown version4_triton_ultra/README.md")


# ------------------------------------------------------------------------------------------------ parts
def test_amd_resources_from_the_metadata():
    assembly = """\t.text
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .address_space:  global
        .offset:         0
    .group_segment_fixed_size: 0
    .name:           other_kernel
    .private_segment_fixed_size: 0
    .sgpr_count:     10
    .vgpr_count:     12
  - .agpr_count:     51
    .args:
      - .offset:         0
    .group_segment_fixed_size: 256
    .name:           my_kernel
    .private_segment_fixed_size: 64
    .sgpr_count:     45
    .sgpr_spill_count: 0
    .vgpr_count:     307
    .vgpr_spill_count: 3
...
\t.end_amdgpu_metadata
"""
    assert amd.resources(assembly, "my_kernel") == {
        "vgprs": 307, "agprs": 51, "sgprs": 45, "vgpr_spills": 3, "sgpr_spills": 0, "scratch_bytes": 64,
        "static_lds_bytes": 256}
    with pytest.raises(ValueError):
        amd.resources(assembly, "missing_kernel")


def test_nvidia_resources_from_cuobjdump():
    text = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function my_kernel:
  REG:168 STACK:0 SHARED:1024 LOCAL:16 CONSTANT[0]:672 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert nvidia.parse_resource_usage(text, "my_kernel") == {
        "registers": 168, "local_bytes": 16, "static_shared_bytes": 1024, "stack_bytes": 0}


def test_nvidia_spills_in_the_stack_frame_count_as_local_memory():
    """ptxas puts spilled registers in the stack frame (STACK) and leaves LOCAL at 0; the driver counts both."""
    text = " Function spilling_kernel:\n  REG:255 STACK:248 SHARED:0 LOCAL:0 CONSTANT[0]:600\n"
    assert nvidia.parse_resource_usage(text, "spilling_kernel") == {
        "registers": 255, "local_bytes": 248, "static_shared_bytes": 0, "stack_bytes": 248}
    both = " Function both_kernel:\n  REG:255 STACK:32 SHARED:0 LOCAL:16 CONSTANT[0]:600\n"
    assert nvidia.parse_resource_usage(both, "both_kernel")["local_bytes"] == 48


@pytest.mark.parametrize("vgprs, lds, warps, expected, limit", [
    (307, 16384, 4, 1, "VGPRs"),     # 312 of 512 registers: one wave per SIMD
    (171, 16384, 4, 2, "VGPRs"),     # 176: two
    (64, 0, 4, 8, "waves"),          # the hardware's 8
    (64, 24576, 4, 2, "LDS"),        # two 24 KiB workgroups in 64 KiB, one wave of each per SIMD
    (64, 8192, 8, 8, "waves"),       # 8 workgroups' LDS, 2 waves each per SIMD: 16, capped at 8
    (40, 65537, 4, 0, "LDS"),        # more LDS than a CU has: does not fit
])
def test_amd_occupancy(vgprs, lds, warps, expected, limit):
    result = occupancy.amd(TARGETS["gfx942"], vgprs, 40, lds, warps)
    assert (result["value"], result["limited_by"]) == (expected, limit)


@pytest.mark.parametrize("registers, shared, warps, expected, limit", [
    (168, 49152, 4, 12, "registers"),   # 5376 registers a warp: 12 warps, 3 blocks of 4
    (32, 0, 4, 64, "warps"),
    (32, 0, 1, 32, "blocks"),           # 32 blocks of one warp
    (64, 100 * 1024, 4, 8, "shared memory"),   # two blocks of 101 KiB in 228 KiB
])
def test_nvidia_occupancy(registers, shared, warps, expected, limit):
    result = occupancy.nvidia(TARGETS["sm_90"], registers, shared, warps)
    assert (result["value"], result["limited_by"]) == (expected, limit)


def test_known_gpu_answers_the_launch_questions():
    gpu = triton_support.KNOWN_GPUS["gfx942"]
    triton_support.use_known_gpu(gpu)
    try:
        assert triton_support.is_rocm() and triton_support.threads_per_warp() == 64
        assert triton_support.multiprocessor_count(torch.device("meta")) == 304
        assert triton_support.shared_memory_per_program(torch.device("meta")) == 64 * 1024
        assert triton_support.is_gpu(torch.device("meta")) and not triton_support.is_gpu(torch.device("cpu"))
    finally:
        triton_support.use_known_gpu(None)
    assert not triton_support.is_gpu(torch.device("meta"))


@pytest.mark.parametrize("flags, message", [
    (["--targets", "gfx1100"], "unknown target gfx1100"),
    (["--presets", "huge"], "unknown preset huge"),
    (["--output-json", "/proc/no/such/report.json"], "cannot write there"),
    (["--markdown", "/"], "is a directory"),
    (["--from-json", "/no/such/report.json"], "cannot read a report"),
])
def test_bad_input_is_one_line_and_exit_2(flags, message, capsys):
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_markdown_replaces_only_its_block(tmp_path):
    doc = json.loads(COMMITTED_JSON.read_text())
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{render.BEGIN}\nold table\n{render.END}\n\nafter\n")
    assert main(["--from-json", str(COMMITTED_JSON), "--markdown", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old table" not in text
    assert render.committed_block(text) == render.markdown(doc)


@pytest.mark.gpu
def test_register_counts_match_what_the_driver_reports(device):
    """On an NVIDIA GPU: the registers and the local memory (spills) the report reads from a cubin (cuobjdump) are
    the ones the driver reports once the same kernel is loaded (Triton's n_spills: the driver's local bytes / 4).
    Every configuration this process compiled is checked, spilling ones included (other tests of the worker
    may have compiled them)."""
    if torch.version.hip is not None:
        pytest.skip("the driver's register count on AMD is not compared here (the report reads the code object)")
    from version3_triton.kernels.flash_attention import flash_attention_packed
    from version3_triton.kernels import flash_attention as fa
    qkv = torch.randn(2, 128, 3 * 256, device=device)
    flash_attention_packed(qkv, 8, causal=True)
    torch.cuda.synchronize()
    compiled = [k for cache in fa._flash_attention_forward_kernel.device_caches.values() for k in cache[0].values()]
    assert compiled
    for kernel in compiled:
        kernel._init_handles()
        used = nvidia.resources(kernel.asm["cubin"], kernel.name)
        assert used["registers"] == kernel.n_regs
        assert used["local_bytes"] == 4 * kernel.n_spills
