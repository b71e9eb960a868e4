"""Learning-rate schedule, validation loss, and the built-in real-text corpus (text:stdlib)."""
import json
import math

import pytest
import torch

from tinytransformer.cli import build_parser
from tinytransformer.config import ModelConfig, TrainConfig
from tinytransformer.data import STDLIB_MODULES, BatchStream, build_corpora, stdlib_text_bytes
from tinytransformer.training.schedule import (COSINE_FLOOR, learning_rate_at, make_learning_rate_a_tensor,
                                               set_learning_rate)
from tinytransformer.training.validation import validation_loss
from tinytransformer.weights import init_canonical_weights
from version1_pytorch_baseline.tiny_llama_v1 import TinyLlama
from version1_pytorch_baseline.tiny_llama_v1 import main as v1_main

TINY = ["--hidden-dim", "32", "--num-heads", "2", "--num-layers", "1", "--intermediate-size", "64",
        "--vocab-size", "300", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]


# ----------------------------------------------------------------------------------------------------------
# Learning-rate schedule
# ----------------------------------------------------------------------------------------------------------
def test_cosine_schedule_warms_up_linearly_then_decays_to_a_tenth():
    train = TrainConfig(num_steps=100, learning_rate=2e-3, lr_schedule="cosine", lr_warmup_steps=10)
    lrs = [learning_rate_at(step, train) for step in range(100)]
    assert lrs[:10] == pytest.approx([2e-3 * (s + 1) / 10 for s in range(10)])   # step 0 already learns
    assert lrs[9] == pytest.approx(2e-3) and lrs[10] == pytest.approx(2e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))                        # decays monotonically
    assert lrs[-1] == pytest.approx(COSINE_FLOOR * 2e-3)
    middle = 10 + (99 - 10) / 2                                                    # half-way: half-way down
    assert learning_rate_at(int(middle), train) == pytest.approx(1.1e-3, rel=0.02)


def test_constant_schedule_with_and_without_warm_up():
    assert {learning_rate_at(s, TrainConfig(num_steps=20)) for s in range(20)} == {1e-3}
    train = TrainConfig(num_steps=20, lr_warmup_steps=4)
    assert [learning_rate_at(s, train) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_learning_rate_is_set_in_place_when_it_is_a_tensor():
    """A CUDA-graph-captured optimizer step reads its learning rate from a tensor: that tensor must change."""
    weight = torch.nn.Parameter(torch.ones(3))
    as_tensor = torch.optim.AdamW([weight], lr=torch.tensor(1e-3))
    tensor = as_tensor.param_groups[0]["lr"]
    set_learning_rate(as_tensor, 5e-4)
    assert as_tensor.param_groups[0]["lr"] is tensor and tensor.item() == pytest.approx(5e-4)
    as_float = torch.optim.AdamW([weight], lr=1e-3)
    set_learning_rate(as_float, 5e-4)
    assert as_float.param_groups[0]["lr"] == 5e-4


def test_a_capturable_optimizer_gets_a_tensor_learning_rate():
    """What version 4's CUDA-graph step needs; a plain optimizer keeps its float (and its exact numerics)."""
    weight = torch.nn.Parameter(torch.ones(3))
    capturable = torch.optim.AdamW([weight], lr=1e-3, capturable=True)
    plain = torch.optim.AdamW([weight], lr=1e-3)
    make_learning_rate_a_tensor(capturable)
    make_learning_rate_a_tensor(plain)
    assert isinstance(capturable.param_groups[0]["lr"], torch.Tensor) and plain.param_groups[0]["lr"] == 1e-3
    tensor = capturable.param_groups[0]["lr"]
    set_learning_rate(capturable, 2e-4)
    assert capturable.param_groups[0]["lr"] is tensor and tensor.item() == pytest.approx(2e-4)


def test_groups_of_one_learning_rate_share_one_tensor():
    """Version 4 has an optimizer group per layer: one tensor for all, filled once per step."""
    weights = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    optimizer = torch.optim.AdamW([{"params": [w]} for w in weights[:2]] + [{"params": [weights[2]], "lr": 5e-3}],
                                  lr=1e-3, capturable=True)
    make_learning_rate_a_tensor(optimizer)
    first, second, third = (group["lr"] for group in optimizer.param_groups)
    assert first is second and third is not first and third.item() == pytest.approx(5e-3)
    set_learning_rate(optimizer, 2e-4)
    assert first.item() == pytest.approx(2e-4) and third.item() == pytest.approx(2e-4)


def test_the_trainer_follows_the_schedule(tmp_path):
    out = tmp_path / "m.json"
    code = v1_main(TINY + ["--num-steps", "12", "--lr-schedule", "cosine", "--lr-warmup-steps", "3",
                           "--output-json", str(out)])
    metrics = json.loads(out.read_text())
    assert code == 0
    assert metrics["lr_schedule"] == {"kind": "cosine", "peak": 1e-3, "warmup_steps": 3,
                                      "final": pytest.approx(1e-4)}
    assert metrics["train_config"]["lr_warmup_steps"] == 3 and metrics["train_config"]["warmup_steps"] >= 0


def test_help_tells_the_two_warm_ups_apart():
    spec = type("Spec", (), {"name": "v1", "title": "t", "add_arguments": None})()
    text = "".join(build_parser(spec).format_help().split())   # line wrapping may split any word
    assert "TIMINGwarm-up" in text and "LEARNING-RATEwarm-up" in text
    assert "(not--warmup-steps,whichonlyexcludesstepsfromthetiming)" in text


@pytest.mark.parametrize("flags", [["--lr-schedule", "linear"], ["--lr-warmup-steps", "12"],
                                   ["--lr-warmup-steps", "-1"], ["--eval-batches", "0"], ["--eval-every", "x"],
                                   ["--save-every", "-2"], ["--keep-last", "-1"]])
def test_bad_schedule_and_eval_flags_are_one_line_exit_2(flags, capsys):
    try:
        code = v1_main(TINY + ["--num-steps", "12"] + flags)
    except SystemExit as exit_:
        code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "error" in err[0]


# ----------------------------------------------------------------------------------------------------------
# Validation loss
# ----------------------------------------------------------------------------------------------------------
def test_validation_loss_on_markov_data_approaches_the_optimum(tmp_path, capsys):
    out = tmp_path / "m.json"
    code = v1_main(TINY + ["--num-steps", "150", "--batch-size", "8", "--learning-rate", "1e-2",
                           "--eval-every", "50", "--eval-batches", "8", "--log-every", "50",
                           "--output-json", str(out), "--tensorboard-dir", str(tmp_path / "tb")])
    assert code == 0
    stdout = capsys.readouterr().out
    evals = json.loads(out.read_text())["eval"]
    optimum = evals["optimum"]
    losses = [entry["loss"] for entry in evals["history"]]
    assert [entry["step"] for entry in evals["history"]] == [50, 100, 150]
    assert optimum == pytest.approx(0.8956, abs=1e-3)
    assert losses[0] > losses[1] > losses[2] > optimum               # falls toward the optimum ...
    assert losses[2] - optimum < 0.6 < math.log(300) - optimum        # ... and gets close (from ~4.8 away)
    assert evals["final"] == losses[-1]
    assert "validation loss" in stdout and "optimum 0.8956" in stdout
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and b"eval/loss" in events[0].read_bytes()


def test_validation_batches_are_fixed_and_change_nothing(tmp_path):
    """The same batches every time (a function of the seed); no gradients; the training is unchanged."""
    config = ModelConfig(vocab_size=300, hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64)
    _, valid = build_corpora("markov", 300, 16, seed=5, device="cpu")
    model = TinyLlama(config)
    model.load_canonical(init_canonical_weights(config, 0))
    train = TrainConfig()
    first = validation_loss(model, BatchStream(valid, 16, 4, seed=5), 3, torch.device("cpu"), train)
    again = validation_loss(model, BatchStream(valid, 16, 4, seed=5), 3, torch.device("cpu"), train)
    other = validation_loss(model, BatchStream(valid, 16, 4, seed=6), 3, torch.device("cpu"), train)
    assert first == again and first != other
    assert all(p.grad is None for p in model.parameters()) and model.training

    histories = []
    for extra in ([], ["--eval-every", "1", "--eval-batches", "3"]):
        out = tmp_path / f"m{len(extra)}.json"
        assert v1_main(TINY + ["--num-steps", "10", "--output-json", str(out)] + extra) == 0
        histories.append(json.loads(out.read_text())["loss"]["history"])
    assert histories[0] == histories[1]


def test_validation_uses_the_held_out_split_of_text(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(b"abcdefgh" * 400 + b"0123456789" * 40)   # the held-out 10% is digits only
    out = tmp_path / "m.json"
    code = v1_main(TINY + ["--vocab-size", "256", "--data", f"text:{text}", "--num-steps", "30",
                           "--learning-rate", "1e-2", "--eval-every", "30", "--eval-batches", "2",
                           "--output-json", str(out)])
    assert code == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval"]["optimum"] is None
    # Trained on letters, evaluated on digits: the held-out loss is far above the training loss.
    assert metrics["eval"]["final"] > metrics["loss"]["final"] + 1.0


# ----------------------------------------------------------------------------------------------------------
# --data text:stdlib
# ----------------------------------------------------------------------------------------------------------
def test_stdlib_text_loads_and_is_deterministic():
    data = stdlib_text_bytes()
    assert 1_000_000 < len(data) < 5_000_000
    assert data == stdlib_text_bytes()
    assert data.startswith(b"# ===== argparse.py =====\n")
    assert list(STDLIB_MODULES) == sorted(STDLIB_MODULES)
    train, valid = build_corpora("text:stdlib", 256, 64, seed=0, device="cpu")
    assert train.tokens.numel() + valid.tokens.numel() == len(data)
    assert int(train.tokens.max()) < 256 and "standard library" in train.description


def test_stdlib_text_trains_end_to_end(tmp_path):
    out = tmp_path / "m.json"
    code = v1_main(TINY + ["--vocab-size", "256", "--data", "text:stdlib", "--num-steps", "20",
                           "--learning-rate", "1e-2", "--output-json", str(out)])
    assert code == 0
    loss = json.loads(out.read_text())["loss"]
    assert loss["final"] < loss["first"] - 1.0
