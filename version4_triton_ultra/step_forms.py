"""Version 4's graph-captured step in several forms, built in one process and timed in turns.

A form is the step built and captured while a rule holds: other flags of profile_graphed_step.py
(compare_step_forms.py), or a kernel launch that a tuner puts in place of the current one (tune_norm_backward.py,
tune_attention_tiles.py). A CUDA graph records each kernel's launch as it captures it, so a rule needs to hold only
until its step is captured. The captured steps then take turns (graph_timing.rounds_in_turns: each round starts
one form later), so that a clock or a neighbour that slows one round slows every form in it. A form's figure for a
round is the median of a number of replays, after 20 untimed ones (profile_graphed_step.median_step_ms).

Every form keeps its model, optimizer state and graph on the GPU until the timing ends (about 23 GB each at the
large preset in bfloat16): a GPU that cannot hold them all gets one line saying so. Needs a GPU (CUDA or ROCm).
"""
import contextlib
import statistics

import torch

from tinytransformer.config import ConfigError
from tinytransformer.kernel_bench.graph_timing import rounds_in_turns
from version4_triton_ultra import profile_graphed_step


def capture_forms(forms: dict, fewer: str) -> dict:
    """{name: (step, inputs, targets)} for `forms` {name: (step_args, rule)}: version 4's step as
    profile_graphed_step.build_step builds it from step_args, built, warmed up and captured inside `rule` (a context
    manager, or None for none). `fewer` ends the out-of-memory line: how to ask for fewer forms."""
    captured = {}
    for name, (step_args, rule) in forms.items():
        try:
            with rule or contextlib.nullcontext():
                step, inputs, targets = profile_graphed_step.build_step(step_args)
                # GraphedStep's eager warm-up steps, the capture and some replays: the graph exists after these.
                profile_graphed_step.median_step_ms(step, inputs, targets, steps=1)
        except torch.cuda.OutOfMemoryError:
            preset = getattr(step_args, "preset", None)
            which = f"the {preset} preset's step" if preset else "this step"
            raise ConfigError(f"the GPU's memory does not hold {len(forms)} forms of {which} at once (each keeps "
                              f"its model, optimizer state and graph); {fewer}") from None
        captured[name] = (step, inputs, targets)
    return captured


def time_in_turns(captured: dict, rounds: int, replays: int) -> dict:
    """{name: [median step ms of each round]} for the steps capture_forms returned."""
    return rounds_in_turns({name: (lambda s=s: profile_graphed_step.median_step_ms(*s, steps=replays))
                            for name, s in captured.items()}, rounds)


def step_table(times: dict) -> list[dict]:
    """One row per form of time_in_turns' result: its median over the rounds, every round, its ratio to the first
    form's median, and in how many rounds it was faster than the first form in the same round (a form that is
    faster by less than the rounds' spread wins some rounds and loses others)."""
    first = next(iter(times.values()))
    return [{"form": name, "median_step_ms": statistics.median(rounds), "rounds_ms": rounds,
             "relative_to_first": statistics.median(rounds) / statistics.median(first),
             "rounds_faster_than_first": sum(mine < theirs for mine, theirs in zip(rounds, first))}
            for name, rounds in times.items()]
