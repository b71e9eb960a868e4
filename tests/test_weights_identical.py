"""The ranks' weights compared bit for bit at the end of a data-parallel run (DistributedContext.weights_identical in
tinytransformer/distributed.py): the fingerprint, and two gloo ranks that agree and then disagree. Every two-rank
equivalence test (test_distributed.py, test_v4_data_parallel.py) also asks that its ranks end identical."""
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinytransformer import distributed
from tinytransformer.config import ConfigError


def up(value: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(value, torch.tensor(float("inf"), dtype=value.dtype))


def down(value: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(value, torch.tensor(float("-inf"), dtype=value.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_fingerprint_sees_every_change_of_bits(dtype):
    """bit_pattern_fingerprint, the fingerprint weights_identical compares: one last bit changed anywhere (also
    past a chunk's end), -0.0 against 0.0, a change a float sum rounds away, two last-bit changes that cancel in a
    sum (what sums added in a varying order make), two elements swapped; the same bits, the same fingerprint."""
    weights = torch.randn(1000, dtype=torch.float64).to(dtype)
    fingerprint = distributed.bit_pattern_fingerprint(weights, chunk=256)
    assert fingerprint.dtype == torch.int64 and fingerprint.shape == (2,)
    assert torch.equal(fingerprint, distributed.bit_pattern_fingerprint(weights.clone(), chunk=256))

    def differs(changed):
        return not torch.equal(distributed.bit_pattern_fingerprint(changed, chunk=256), fingerprint)

    for index in (0, 255, 256, 999):
        changed = weights.clone()
        changed[index] = up(changed[index])
        assert differs(changed)
    cancelling = weights.clone()
    cancelling[3], cancelling[700] = up(cancelling[3]), down(cancelling[700])
    assert differs(cancelling)
    swapped = weights.clone()
    swapped[[10, 600]] = swapped[[600, 10]]
    assert differs(swapped)
    zeros = torch.zeros(4, dtype=dtype)
    assert not torch.equal(distributed.bit_pattern_fingerprint(-zeros), distributed.bit_pattern_fingerprint(zeros))
    big, nudged = torch.tensor([1e6, 1.0], dtype=dtype), torch.tensor([1e6, 1.0], dtype=dtype)
    nudged[1] = up(nudged[1])
    assert big.sum() == nudged.sum() or dtype == torch.float64   # a float sum can miss the change ...
    assert not torch.equal(distributed.bit_pattern_fingerprint(big),
                           distributed.bit_pattern_fingerprint(nudged))   # ... the fingerprint does not


def test_the_fingerprint_takes_any_shape():
    """A 0-dim float64 (two int32s), a non-contiguous view, an empty tensor."""
    assert distributed.bit_pattern_fingerprint(torch.tensor(2.5, dtype=torch.float64)).shape == (2,)
    matrix = torch.randn(6, 4)
    assert torch.equal(distributed.bit_pattern_fingerprint(matrix.T),
                       distributed.bit_pattern_fingerprint(matrix.T.contiguous()))
    assert torch.equal(distributed.bit_pattern_fingerprint(torch.empty(0)), torch.zeros(2, dtype=torch.int64))


def weights_identical_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two ranks with the same weights, then on rank 1 two values changed in their last bits, one up and one down
    (which a plain sum of the bits could cancel)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        context = distributed.DistributedContext(True, rank, rank, world, "gloo", "ddp", torch.device("cpu"))
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5).bfloat16())]
        same = context.weights_identical(params)
        if rank == 1:
            with torch.no_grad():
                params[1][2], params[1][4] = up(params[1][2]), down(params[1][4])
        differ = context.weights_identical(params)
        try:   # check_same shares the comparison over the ranks (their lowest and highest values)
            context.check_same(10 + rank, "the rank's number")
            disagreement = None
        except ConfigError as error:
            disagreement = str(error)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([same, differ, disagreement]))
    finally:
        dist.destroy_process_group()


def test_weights_identical_compares_every_ranks_bits():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(weights_identical_worker, args=(2, distributed.free_port(), out_dir), nprocs=2, join=True)
        for rank in range(2):
            # On every rank: the same weights, then not; and check_same names the lowest and highest value.
            assert json.loads(Path(out_dir, f"rank{rank}.json").read_text()) == [
                True, False, "the ranks disagree on the rank's number (10 .. 11)"]
