"""Version 1 with a training step that averages its own gradients (GradientAllReduce), the way version 4's
graph-captured step does on a GPU: for CPU tests of the harness's path without the DDP wrapper.

    torchrun --nproc-per-node 2 tests/own_averaging_v1.py [version 1's flags]
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

from tinytransformer.cli import run  # noqa: E402
from version1_pytorch_baseline import tiny_llama_v1  # noqa: E402


class AveragingStep:
    """Eager forward, backward of the loss scaled by 1/ranks, SUM all-reduce of the gradients, optimizer."""

    def __init__(self, model, optimizer, gradient_sync):
        self.model, self.optimizer, self.gradient_sync = model, optimizer, gradient_sync
        self.sums = 0   # how many times the gradients were summed (a test reads it)

    def __call__(self, inputs, targets):
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(inputs, targets)
        (loss * self.gradient_sync.loss_scale).backward()
        self.gradient_sync.sum_(self.model.parameters())
        self.sums += 1
        self.optimizer.step()
        return loss.detach()


def make_step(model, optimizer, device, train, args, gradient_sync=None):
    return AveragingStep(model, optimizer, gradient_sync) if gradient_sync is not None else None


SPEC = dataclasses.replace(tiny_llama_v1.SPEC, make_step=make_step, averages_gradients=lambda args, device: True)

if __name__ == "__main__":
    sys.exit(run(SPEC))
