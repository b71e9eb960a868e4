"""The flash-attention tuner: its command line on a machine without a GPU, and its kernel launches (through the
interpreter on the CPU) compute exactly what the library's own launches compute."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from version3_triton import tune_flash_attention as tuner

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--shapes", "8x8"], ["--kernels", "fwd"], ["--dtype", "float64"]])
def test_bad_input_or_no_gpu_is_one_line_and_exit_2(flags):
    result = subprocess.run([sys.executable, "version3_triton/tune_flash_attention.py", *flags], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "error:" in result.stderr


def test_candidate_configs():
    assert len(tuner.candidate_configs(quick=False)) == 60
    assert len(tuner.candidate_configs(quick=True)) == 12
    assert tuner.parse_shapes("8x8x128, 2x4x64") == [(8, 8, 128), (2, 4, 64)]


@pytest.mark.interpreter
def test_tuner_launches_match_the_library():
    from version3_triton.kernels import flash_attention as fa
    torch.manual_seed(0)
    problem = tuner.Problem(fa, 1, 2, 40, 16, torch.float32, device="cpu")
    want_out, want_lse = problem.out.clone(), problem.lse.clone()
    config = dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1)
    problem.out.fill_(float("nan"))
    problem.lse.fill_(float("nan"))
    problem.launcher("forward", config)()
    # the tuner's launch with another config fills `out` and lse as the library's forward did with its own
    torch.testing.assert_close(problem.out, want_out)
    torch.testing.assert_close(problem.lse, want_lse)

    p = problem.problem
    dim = problem.q.shape[-1]
    dq, dk, dv = torch.empty_like(problem.grad_qkv).split(dim, dim=-1)   # the packed layout the kernels write
    fa._run_backward(p, problem.q, problem.k, problem.v, problem.out, problem.lse, problem.grad_out, dq, dk, dv)
    for kernel in ("dkdv", "dq"):
        problem.launcher(kernel, config)()
    torch.testing.assert_close(problem.dq, dq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(problem.dk, dk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(problem.dv, dv, rtol=1e-5, atol=1e-5)
