"""Tests of version4_triton_ultra/tune_attention_tiles.py, the tuner of the flash-attention kernels' tiles: its
float64 check, its flags, which tiles it hands to the step it times (--in-step), and its refusals. The timings
themselves need a GPU; what decides from them (the fastest right candidates) is tested here on rows made up for
the purpose, and the step's table with the other step forms' (tests/test_v4_step_forms.py)."""
import math
from types import SimpleNamespace

import pytest
import torch

from tinytransformer import triton_support
from version3_triton.kernels import flash_attention as v3_fa
from version4_triton_ultra.kernels import flash_attention as fa

from .attention_checks import TF32_TOLERANCE, TOLERANCE
from .script_checks import assert_refused_in_one_line


@pytest.fixture
def tune_module():
    """tune_attention_tiles, imported before a test switches the interpreter off (its import checks for a GPU)."""
    from version4_triton_ultra import tune_attention_tiles
    return tune_attention_tiles


def test_the_tile_tuners_check_passes_the_kernels_and_catches_a_wrong_answer(device, small_interpreter_blocks):
    """Small tiles in the interpreter, so the 40-long sequence spans several (and a partial one)."""
    from version4_triton_ultra import tune_attention_tiles as tune
    torch.manual_seed(0)
    problem = tune.Problem(1, 2, 40, 16, torch.float32, device=device)
    want_out, want_grads = problem.reference()
    out, lse = problem.forward()
    grads = problem.backward(out, lse).split(problem.dim, dim=-1)
    # The tuner's own tolerance: float32 through TF32 on an NVIDIA GPU (the pass's default), exact float32 in the
    # interpreter. The tests' values, so a tile the tuner passes is one the kernel tests would pass.
    tolerance = tune.dots_tolerance(torch.float32, device)
    tf32 = device.type == "cuda" and not triton_support.is_rocm()
    assert tolerance == (TF32_TOLERANCE if tf32 else TOLERANCE[torch.float32])
    assert tune.relative_error(out, want_out) < tolerance
    assert max(tune.relative_error(g, w) for g, w in zip(grads, want_grads)) < tolerance
    assert tune.relative_error(out * 1.01, want_out) > tolerance   # a 1% error is caught, on a GPU too
    with_nan = out.clone()
    with_nan.view(-1)[0] = float("nan")
    assert tune.relative_error(with_nan, want_out) == math.inf   # and NaN never passes


def test_the_pass_error_is_the_largest_of_the_pass_it_times(tune_module, device, small_interpreter_blocks):
    """pass_error: the forward's error is out's, the backward's the largest of dq, dk and dv; a wrong dv alone
    makes the backward's error, not the forward's."""
    tune = tune_module
    torch.manual_seed(0)
    problem = tune.Problem(1, 2, 40, 16, torch.float32, device=device)
    reference = problem.reference()
    tolerance = tune.dots_tolerance(torch.float32, device)
    assert tune.pass_error("forward", problem, reference) < tolerance
    assert tune.pass_error("dq", problem, reference) < tolerance
    out, grads = reference
    wrong_dv = (out, [grads[0], grads[1], grads[2] * 1.05])
    assert tune.pass_error("forward", problem, wrong_dv) < tolerance
    assert tune.pass_error("dkdv", problem, wrong_dv) > tolerance


def test_the_tile_tuners_candidates_flag_reads_tiles():
    """--candidates M,N,W,S: four numbers within what the kernels and both vendors take; anything else is a
    ValueError that names the expected form (the parser turns it into one line)."""
    from version4_triton_ultra import tune_attention_tiles as tune
    assert tune.tiles_of("32,128,4,5") == (32, 128, 4, 5)
    for bad in ("64,64,4", "64,64,4,2,1", "8,64,4,1", "512,64,4,1", "64,96,4,1", "64,64,3,1", "64,64,4,9", "a,b,c,d"):
        with pytest.raises(ValueError, match="BLOCK_M,BLOCK_N,WARPS,STAGES"):
            tune.tiles_of(bad)


def test_the_tile_tuner_pins_the_other_kernels(tune_module, known_gpu):
    """--others portable: the kernel being tuned gets the candidate, the others version 3's tiles, also where this
    GPU's rule would give them Hopper's."""
    tune = tune_module
    known_gpu(triton_support.KNOWN_GPUS["sm_90"])
    device = torch.device("meta")
    for others, want in ((tune.portable_launch_config, v3_fa._launch_config(128, torch.bfloat16, 1024, "dkdv")),
                         (fa._launch_config, fa._launch_config(128, torch.bfloat16, 1024, "dkdv", device))):
        launch_config = tune.with_tiles("dq", (128, 32, 8, 3), others)
        assert launch_config(128, torch.bfloat16, 1024, "dq", device) == dict(BLOCK_M=128, BLOCK_N=32, num_warps=8,
                                                                              num_stages=3)
        assert launch_config(128, torch.bfloat16, 1024, "dkdv", device) == want
    assert want != v3_fa._launch_config(128, torch.bfloat16, 1024, "dkdv")   # the two rules differ here


# ----------------------------------------------------------------------------------------------------------
# --in-step: the preset's shape, and the tiles it takes into the step
# ----------------------------------------------------------------------------------------------------------
def shape_flags(**given):
    flags = dict(in_step=None, shape=None, head_dim=None, dtype="bfloat16")
    flags.update(given)
    return SimpleNamespace(**flags)


def test_in_step_takes_the_presets_attention_shape(tune_module):
    """The medium preset: batch 16, 16 heads, sequence 512, head dim 1024 / 16 = 64 (configs/medium.yaml); the
    flags may repeat it; without --in-step the defaults stay the large shape's."""
    tune = tune_module
    assert tune.preset_attention_shape("medium") == (16, 16, 512, 64)
    for given in ({}, {"shape": "16x16x512", "head_dim": 64}):
        args = shape_flags(in_step="medium", **given)
        assert tune.choose_shape(args) is None
        assert (args.batch, args.heads, args.seq_len, args.head_dim) == (16, 16, 512, 64)
    args = shape_flags()
    assert tune.choose_shape(args) is None
    assert (args.batch, args.heads, args.seq_len, args.head_dim) == (8, 16, 1024, 128)


@pytest.mark.parametrize("given, says", [({"shape": "8x16x512"}, "its attention is 16x16x512"),
                                         ({"head_dim": 128}, "at head dim 64"),
                                         ({"dtype": "float16"}, "bfloat16 autocast")])
def test_in_step_refuses_a_shape_or_dtype_the_step_does_not_have(tune_module, given, says):
    assert says in tune_module.choose_shape(shape_flags(in_step="medium", **given))


def tile_row(kernel, tiles, us=None, current=False, check="ok"):
    row = {"kernel": kernel, "tiles": tiles, "current": current, "check": check}
    if us is not None:
        row["pass_us"] = us
    return row


def test_the_step_gets_the_fastest_right_candidates_only():
    """Not the current tiles (the step's reference), not a WRONG one however fast, not one that failed to run."""
    from version4_triton_ultra import tune_attention_tiles as tune
    rows = [tile_row("dq", "64x64 w4 s2", 150.0, current=True), tile_row("dq", "a", 160.0),
            tile_row("dq", "b", 100.0, check="WRONG"), tile_row("dq", "c", 155.0), tile_row("dq", "d"),
            tile_row("dq", "e", 149.0)]
    rows[4]["fails"] = "out of resources"
    assert [row["tiles"] for row in tune.fastest_right_candidates(rows)] == ["e", "c"]
    assert [row["tiles"] for row in tune.fastest_right_candidates(rows, count=5)] == ["e", "c", "a"]


def test_each_candidate_is_captured_under_its_own_tiles_and_the_rule_comes_back(tune_module, monkeypatch):
    """tile_rows, its GPU calls replaced: the current tiles come first; each candidate's graph is captured while
    _launch_config gives that candidate for the tuned kernel (and the rule for the others); a candidate whose check
    raises is a row that says why and is not timed; a pass's microseconds are a graph's milliseconds over its
    passes; and the module's rule is back afterwards, also after the failure."""
    tune = tune_module
    rule = fa._launch_config
    captured = {}

    def fake_capture(run, launches):
        tuned = fa._launch_config(64, torch.float16, 128, "dq")
        untouched = fa._launch_config(64, torch.float16, 128, "dkdv")
        key = tune.label((tuned["BLOCK_M"], tuned["BLOCK_N"], tuned["num_warps"], tuned["num_stages"]))
        captured[key] = untouched == rule(64, torch.float16, 128, "dkdv")
        return key

    def fake_error(kernel, checked, reference):
        if fa._launch_config(64, torch.float16, 128, kernel)["BLOCK_M"] == 16:
            raise RuntimeError("out of resources: shared memory\nmore")
        return 1e-3

    monkeypatch.setattr(tune, "captured_launches", fake_capture)
    monkeypatch.setattr(tune, "pass_error", fake_error)
    monkeypatch.setattr(tune, "graph_ms", lambda graph: {"64x32 w4 s4": 1.2}.get(graph, 1.5))
    args = SimpleNamespace(head_dim=64, dtype="float16", seq_len=128, candidates=[(64, 32, 4, 4), (16, 64, 4, 1)])
    problems = tune.Problems(None, None, None, None, tolerance=2e-2)
    rows = tune.tile_rows("dq", args, problems, rule)
    assert fa._launch_config is rule
    current = rule(64, torch.float16, 128, "dq")
    assert rows[0]["current"] and rows[0]["tiles"] == tune.label(tune.row_tiles(rows[0]))
    assert tune.row_tiles(rows[0]) == (current["BLOCK_M"], current["BLOCK_N"], current["num_warps"],
                                       current["num_stages"])
    assert [row["tiles"] for row in rows[1:]] == ["64x32 w4 s4", "16x64 w4 s1"]
    assert captured == {rows[0]["tiles"]: True, "64x32 w4 s4": True}
    assert rows[1]["pass_us"] == pytest.approx(1000 * 1.2 / tune.PASSES_PER_GRAPH) and rows[1]["check"] == "ok"
    assert rows[2]["fails"] == "out of resources: shared memory" and "pass_us" not in rows[2]


def test_each_step_is_built_and_captured_under_its_tiles(tune_module, monkeypatch):
    """time_in_step, the step replaced by a recorder: the current step under the module's rule, each chosen row's
    step under its tiles for its kernel only, from the build through the warm-up call that captures it; the rule is
    back afterwards, also when a step does not fit in memory, which is one line naming the way out."""
    from tinytransformer.config import ConfigError
    from version4_triton_ultra import profile_graphed_step
    tune = tune_module
    rule = fa._launch_config
    seen = []
    tiles = lambda kernel: fa._launch_config(64, torch.float16, 128, kernel)  # noqa: E731

    def fake_build(step_args):
        seen.append(("build", tiles("dq"), tiles("dkdv")))
        return "step", None, None

    def fake_median(step, inputs, targets, steps):   # the capture (steps=1), then the timed replays (30)
        seen.append(("capture" if steps == 1 else "timed", tiles("dq"), tiles("dkdv")))
        return 10.0

    monkeypatch.setattr(profile_graphed_step, "build_step", fake_build)
    monkeypatch.setattr(profile_graphed_step, "median_step_ms", fake_median)
    chosen = [dict(kernel="dq", tiles="64x32 w4 s4", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4)]
    times = tune.time_in_step(SimpleNamespace(preset="medium"), chosen, rounds=2)
    assert times == {"current": [10.0, 10.0], "dq 64x32 w4 s4": [10.0, 10.0]}
    assert fa._launch_config is rule
    current = (rule(64, torch.float16, 128, "dq"), rule(64, torch.float16, 128, "dkdv"))
    want = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4), current[1])
    assert seen[:4] == [("build", *current), ("capture", *current), ("build", *want), ("capture", *want)]
    assert [record[0] for record in seen[4:]] == ["timed"] * 4   # replays of graphs already captured

    def no_memory(step_args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(profile_graphed_step, "build_step", no_memory)
    with pytest.raises(ConfigError, match="does not hold 2 forms of the medium preset's step.*pass fewer --kernels"):
        tune.time_in_step(SimpleNamespace(preset="medium"), chosen, rounds=2)
    assert fa._launch_config is rule


def test_repeated_kernels_and_candidates_are_tried_once(tune_module, monkeypatch):
    tune = tune_module
    monkeypatch.setattr(tune, "refuse_without_gpu", lambda parser: None)
    args = tune.parse_args(["--kernels", "dq,dkdv,dq", "--candidates", "64,32,4,4", "32,64,4,1", "64,32,4,4"])
    assert args.kernels == ["dq", "dkdv"] and args.candidates == [(64, 32, 4, 4), (32, 64, 4, 1)]


def test_in_step_is_refused_where_the_step_takes_cudnns_attention(tune_module, monkeypatch, capsys):
    tune = tune_module
    monkeypatch.setattr(tune, "refuse_without_gpu", lambda parser: None)
    monkeypatch.setattr(tune, "vendor_attention_pays", lambda device, dtype, head_dim: head_dim >= 128)
    with pytest.raises(SystemExit) as stop:
        tune.parse_args(["--in-step", "large"])
    assert stop.value.code == 2 and "takes cuDNN's attention at head dim 128" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--shape", "8x16"], ["--kernels", "fwd"], ["--others", "v3"],
                                   ["--candidates", "64,64,4"], ["--candidates", "48,64,4,1"],
                                   ["--candidates", "64,64,4,0"], ["--candidates", "64,64,32,2"],
                                   ["--in-step", "huge"], ["--in-step", "medium", "--head-dim", "128"],
                                   ["--in-step", "small", "--dtype", "float32"], ["--step-rounds", "0"],
                                   ["--in-step", "medium", "--others", "portable"], ["--shape", "1x1x\u00b2"],
                                   ["--shape", "70000x1x64", "--head-dim", "64"], ["--shape", "1x1x20000"],
                                   ["--output-json", "/dev/null/x.json"]])
def test_the_tile_tuner_needs_a_gpu_and_good_flags(flags):
    """One line and exit 2; a flag's own problem is named before the missing GPU."""
    message = assert_refused_in_one_line("tune_attention_tiles.py", flags)
    assert ("needs a GPU" in message) == (flags == [])
