"""Tests of version4_triton_ultra/step_forms.py, which builds several forms of version 4's graph-captured step in
one process and times them in turns (compare_step_forms.py and the kernel tuners' --in-step). The steps themselves
need a GPU (tests/test_v4_graph.py runs compare_step_forms.py there); here the builds and timings are replaced by
recorders, to check what holds while each form is captured, the order of the turns and the table."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from tinytransformer.config import ConfigError
from version4_triton_ultra import profile_graphed_step, step_forms


@pytest.fixture
def recorded(monkeypatch):
    """build_step and median_step_ms replaced: each step is its form's args; every call is recorded with the rule
    that held during it ("rule" is the name of the rule's form, or None outside every rule)."""
    state = {"rule": None, "calls": []}

    def build(args):
        state["calls"].append(("build", args, state["rule"]))
        return args, None, None

    def median(step, inputs, targets, steps):
        state["calls"].append(("capture" if steps == 1 else f"timed {steps}", step, state["rule"]))
        return {"a": 10.0, "b": 9.0}.get(step, 1.0)

    monkeypatch.setattr(profile_graphed_step, "build_step", build)
    monkeypatch.setattr(profile_graphed_step, "median_step_ms", median)
    return state


def rule_named(state, name):
    @contextlib.contextmanager
    def rule():
        state["rule"] = name
        try:
            yield
        finally:
            state["rule"] = None
    return rule()


def test_each_form_is_built_and_captured_inside_its_rule_and_only_there(recorded):
    forms = {"a": ("a", rule_named(recorded, "a")), "plain": ("plain", None), "b": ("b", rule_named(recorded, "b"))}
    captured = step_forms.capture_forms(forms, fewer="pass fewer forms")
    assert list(captured) == ["a", "plain", "b"] and captured["b"] == ("b", None, None)
    assert recorded["calls"] == [("build", "a", "a"), ("capture", "a", "a"), ("build", "plain", None),
                                 ("capture", "plain", None), ("build", "b", "b"), ("capture", "b", "b")]
    assert recorded["rule"] is None


def test_the_forms_take_turns_each_round_starting_one_later(recorded):
    captured = step_forms.capture_forms({name: (name, None) for name in "abc"}, fewer="pass fewer forms")
    recorded["calls"].clear()
    times = step_forms.time_in_turns(captured, rounds=3, replays=30)
    assert [(kind, step) for kind, step, _ in recorded["calls"]] == [
        ("timed 30", step) for step in ["a", "b", "c", "b", "c", "a", "c", "a", "b"]]
    assert times == {"a": [10.0] * 3, "b": [9.0] * 3, "c": [1.0] * 3}


def test_a_gpu_that_cannot_hold_the_forms_is_one_line_and_the_rule_is_released(recorded, monkeypatch):
    def no_memory(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    monkeypatch.setattr(profile_graphed_step, "build_step", no_memory)
    forms = {"a": ("a", rule_named(recorded, "a")), "b": ("b", None)}
    with pytest.raises(ConfigError, match="does not hold 2 forms of this step") as error:
        step_forms.capture_forms(forms, fewer="pass fewer --kernels")
    assert str(error.value).endswith("pass fewer --kernels") and "\n" not in str(error.value)
    assert recorded["rule"] is None


def test_the_table_compares_each_round_with_the_first_form_in_that_round():
    """Round by round: the candidate is faster in rounds 2 (10.3 against 10.4) and 3 (10.05 against 10.1), not in
    round 1; against the first form's median (10.1) only one of its rounds would be."""
    rows = step_forms.step_table({"current": [10.0, 10.4, 10.1], "dq 64x32 w4 s4": [10.2, 10.3, 10.05]})
    assert [row["form"] for row in rows] == ["current", "dq 64x32 w4 s4"]
    assert rows[0]["relative_to_first"] == 1.0 and rows[0]["rounds_faster_than_first"] == 0
    assert rows[1]["median_step_ms"] == 10.2 and rows[1]["rounds_ms"] == [10.2, 10.3, 10.05]
    assert rows[1]["relative_to_first"] == pytest.approx(10.2 / 10.1)
    assert rows[1]["rounds_faster_than_first"] == 2


def test_the_norm_tuner_captures_each_step_under_its_launch_only(monkeypatch):
    """tune_norm_backward.time_in_step: the step under the rules first (the table's reference), then under each
    launch, the override in force from the build through the capture and gone before the timed replays, and gone
    too after a step that does not fit, which is one line."""
    from version4_triton_ultra import tune_norm_backward as tune
    from version4_triton_ultra.kernels import add_rmsnorm as norm
    rule, seen = norm._backward_tile, []
    tile = lambda: "rule" if norm._backward_tile is rule else norm._backward_tile(1024)  # noqa: E731

    def build(args):
        seen.append(("build", args.preset, args.use_amp, tile()))
        return f"step {sum(call[0] == 'build' for call in seen)}", None, None

    def median(step, inputs, targets, steps):
        seen.append(("capture" if steps == 1 else "timed", step, tile()))
        return {"step 1": 10.0, "step 2": 9.5}[step]

    monkeypatch.setattr(profile_graphed_step, "parse_args",   # its flags as profile_graphed_step.py would read them
                        lambda argv: SimpleNamespace(preset=argv[argv.index("--preset") + 1],
                                                     use_amp="--use-amp" in argv))
    monkeypatch.setattr(profile_graphed_step, "build_step", build)
    monkeypatch.setattr(profile_graphed_step, "median_step_ms", median)
    launch = (4, 8, 2, True, None)
    rows = tune.time_in_step("medium", [None, launch], block_d=1024, rounds=2)
    assert seen[:4] == [("build", "medium", True, "rule"), ("capture", "step 1", "rule"),
                        ("build", "medium", True, (4, 8)), ("capture", "step 2", (4, 8))]
    assert {call[2] for call in seen[4:]} == {"rule"} and len(seen) == 8
    assert [row["form"] for row in rows] == ["the rules", tune.label(launch)]
    assert rows[1]["relative_to_first"] == pytest.approx(0.95) and rows[1]["rounds_faster_than_first"] == 2

    def no_memory(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(profile_graphed_step, "build_step", no_memory)
    with pytest.raises(ConfigError, match="2 forms of the medium preset's step.*without --in-step"):
        tune.time_in_step("medium", [launch, None], block_d=1024)
    assert norm._backward_tile is rule
