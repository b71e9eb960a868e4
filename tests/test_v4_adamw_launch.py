"""The launch of version 4's AdamW kernel (kernels/adamw.py): elements and warps a program, chosen by tune_adamw.py.

Any launch must give the same update bit for bit (each element's arithmetic does not depend on which program
does it): the tuner's check relies on that, and the module's launch may change with a new sweep."""
import pytest
import torch

from version4_triton_ultra.kernels import adamw
from version4_triton_ultra.kernels.adamw import TritonAdamW

from .script_checks import assert_refused_in_one_line

pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")

# Several programs of the launches below with a partial last one, a short parameter, a matrix with a copy.
SHAPES = [(2048 + 904,), (13,), (64, 48)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def updated_twice(launch, device):
    """Weights, moments and the bfloat16 copy after two steps with fixed random gradients, under `launch`."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in SHAPES]
    copies = {params[2]: torch.empty(params[2].shape, dtype=torch.bfloat16, device=device)}
    optimizer = TritonAdamW(params, sixteen_bit_copies=copies, launch=launch, **HYPER)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(device)
        optimizer.step()
    state = [optimizer.state[p] for p in params]
    return ([p.detach() for p in params] + [s["exp_avg"] for s in state] + [s["exp_avg_sq"] for s in state]
            + list(copies.values()))


@pytest.mark.parametrize("launch", [(32, 1), (128, 2), (2048, 4)], ids=["32 a program", "128, 2 warps", "2048"])
def test_every_launch_gives_the_same_update(launch, device):
    want = updated_twice(None, device)
    got = updated_twice(launch, device)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_launch_follows_the_size_of_a_group(monkeypatch, device):
    """Small programs from SMALL_PROGRAMS_FROM elements a group; in one optimizer each group gets its own."""
    assert adamw.launch_for(adamw.SMALL_PROGRAMS_FROM) == (adamw.BLOCK, adamw.NUM_WARPS)
    assert adamw.launch_for(adamw.SMALL_PROGRAMS_FROM - 1) == adamw.SMALL_GROUP_LAUNCH
    monkeypatch.setattr(adamw, "SMALL_PROGRAMS_FROM", 1000)
    big, small = (torch.nn.Parameter(torch.randn(n, device=device)) for n in (1500, 20))
    optimizer = TritonAdamW([{"params": [big]}, {"params": [small]}], **HYPER)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    optimizer.step()
    warps = [tables["num_warps"] for _, tables in optimizer._launches.values()]
    assert warps == [adamw.NUM_WARPS, adamw.SMALL_GROUP_LAUNCH[1]]


@pytest.mark.parametrize("launch", [(500, 4), (512, 3), (512,), 512])
def test_refuses_a_launch_that_is_not_two_powers_of_two(launch, device):
    with pytest.raises(ValueError, match="powers of two"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(4, device=device))], launch=launch)


def test_the_adamw_tuners_candidates():
    from version4_triton_ultra import tune_adamw
    assert tune_adamw.candidate("512,4") == (512, 4)
    for text, why in (("512", "ELEMENTS,WARPS"), ("500,4", "power of two"), ("512,64", "at most 32 warps"),
                      ("64,4", "one element a thread")):
        with pytest.raises(ValueError, match=why):
            tune_adamw.candidate(text)
    assert (adamw.BLOCK, adamw.NUM_WARPS) in tune_adamw.DEFAULT_CANDIDATES   # the rule is among what a sweep tries


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--candidates", "512"], ["--preset", "huge"],
                                   ["--output-json", "/dev/null/x.json"]])
def test_the_adamw_tuner_needs_a_gpu_and_good_flags(flags):
    assert_refused_in_one_line("tune_adamw.py", flags)
