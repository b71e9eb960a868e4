"""Train version 3 with one performance-debugging stage's defect: version 3's command line plus --stage.

    python run_stage.py --stage N [version 3's training flags]     N = 1 ... 5; 5 (the default) is version 3

Everything but --stage is tiny_llama_v3.py's own command line (the same flags, checks, header and metrics JSON,
which names the version "v3"); the stage adds its defect through the harness's hooks: build_model (stages 1, 2,
4), make_step (stage 3) and describe (the stage and its defect, in the header and the JSON). The defects
themselves are in stages.py, beside this file.
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: the harness and version 3

from tinytransformer.cli import run  # noqa: E402
from version3_triton import tiny_llama_v3  # noqa: E402  (chooses Triton's interpreter without a GPU)
from version3_triton.exercises.performance_debugging import stages  # noqa: E402


def add_arguments(group):
    group.add_argument("--stage", type=int, choices=sorted(stages.STAGES), default=5,
                       help="performance-debugging stage: 1 uninitialised weights, 2 non-contiguous input to a "
                            "Triton kernel, 3 timing without synchronisation, 4 naive Triton matmul, "
                            "5 version 3 as it is (see stages.py)")


def build_model(config, args):
    stage = getattr(args, "stage", 5)
    return tiny_llama_v3.TinyLlama(config) if stage == 5 else stages.build_model(stage, config)


def make_step(model, optimizer, device, train, args, gradient_sync=None):
    # gradient_sync stays None: version 3's spec has no averages_gradients hook (DDP averages its gradients).
    return stages.make_step(getattr(args, "stage", 5), model, optimizer, device, train, args)


def describe(args) -> dict:
    info = tiny_llama_v3.describe(args)
    stage = getattr(args, "stage", 5)
    if stage != 5:
        info.update(stages.describe(stage, args))
    return info


# Version 3's spec with the stage's hooks: the name stays "v3", so the metrics JSON of a stage run reads like
# version 3's, and run_all_stages.sh compares the stages as runs of one version.
SPEC = dataclasses.replace(tiny_llama_v3.SPEC, build_model=build_model, add_arguments=add_arguments,
                           describe=describe, make_step=make_step)


def main(argv=None):
    return run(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
