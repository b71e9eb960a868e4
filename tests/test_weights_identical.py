"""The ranks' weights compared bit for bit at the end of a data-parallel run (DistributedContext.weights_identical in
tinytransformer/distributed.py): the fingerprint, and two gloo ranks that agree and then disagree. Every two-rank
equivalence test (test_distributed.py, test_v4_data_parallel.py) also asks that its ranks end identical."""
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinytransformer import distributed


def test_bit_pattern_sum_sees_every_bit():
    """The fingerprint of weights_identical: any one changed bit changes it, where a float sum would not see
    -0.0 against 0.0, or a change lost in rounding; float32, bfloat16 and float64 alike."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        weights = torch.randn(1000, dtype=torch.float64).to(dtype)
        fingerprint = distributed.bit_pattern_sum(weights)
        assert fingerprint.dtype == torch.int64 and torch.equal(fingerprint, distributed.bit_pattern_sum(weights))
        for index in (0, 517, 999):
            changed = weights.clone()
            changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf"), dtype=dtype))
            assert not torch.equal(distributed.bit_pattern_sum(changed), fingerprint)
        zeros = torch.zeros(4, dtype=dtype)
        assert not torch.equal(distributed.bit_pattern_sum(-zeros), distributed.bit_pattern_sum(zeros))
        big = torch.tensor([1e6, 1.0], dtype=dtype)
        nudged = torch.tensor([1e6, torch.nextafter(torch.tensor(1.0, dtype=dtype),
                                                    torch.tensor(2.0, dtype=dtype)).item()], dtype=dtype)
        assert big.sum() == nudged.sum() or dtype == torch.float64   # a float sum can miss the change ...
        assert not torch.equal(distributed.bit_pattern_sum(big), distributed.bit_pattern_sum(nudged))   # ... this not


def weights_identical_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two ranks with the same weights, then rank 1's last bit of one value changed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        context = distributed.DistributedContext(True, rank, rank, world, "gloo", "ddp", torch.device("cpu"))
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5).bfloat16())]
        same = context.weights_identical(params)
        if rank == 1:
            with torch.no_grad():
                params[1][2] = torch.nextafter(params[1][2], torch.tensor(float("inf"), dtype=torch.bfloat16))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([same, context.weights_identical(params)]))
    finally:
        dist.destroy_process_group()


def test_weights_identical_compares_every_ranks_bits():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(weights_identical_worker, args=(2, distributed.free_port(), out_dir), nprocs=2, join=True)
        for rank in range(2):
            assert json.loads(Path(out_dir, f"rank{rank}.json").read_text()) == [True, False]   # on every rank
