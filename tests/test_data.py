"""Data: the Markov language's optimum is right, batches depend on (seed, step) only, text and random data."""
import math

import numpy as np
import pytest
import torch

from tinytransformer.config import ConfigError
from tinytransformer.data import BatchStream, MarkovLanguage, build_corpora, hashed_positions


def test_stationary_distribution_is_a_fixed_point():
    language = MarkovLanguage(200)
    pi = language.stationary
    assert pi.sum() == pytest.approx(1.0)
    moved = np.zeros_like(pi)
    np.add.at(moved, language.next_tokens, pi[:, None] * language.probs)
    assert np.abs(moved - pi).max() < 1e-10


def test_entropy_rate_matches_a_two_state_chain_by_hand():
    """A chain with 2 tokens whose rows are (0.9, 0.1) and (0.5, 0.5): pi = (5/6, 1/6), H by hand."""
    language = MarkovLanguage(2, successors=2)
    language.next_tokens = np.array([[0, 1], [0, 1]])
    language.probs = np.array([[0.9, 0.1], [0.5, 0.5]])
    language.stationary = language._stationary_distribution()
    h = lambda p: -sum(x * math.log(x) for x in p)  # noqa: E731
    expected = 5 / 6 * h([0.9, 0.1]) + 1 / 6 * h([0.5, 0.5])
    assert language.entropy_rate() == pytest.approx(expected, rel=1e-9)


def test_entropy_rate_matches_the_empirical_conditional_entropy():
    language = MarkovLanguage(50)
    tokens = language.sample(rows=64, length=2000, seed=1)
    pairs = np.zeros((50, 50))
    np.add.at(pairs, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
    rows = pairs.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        conditional = -np.nansum(pairs * np.log(pairs / rows)) / pairs.sum()
    assert conditional == pytest.approx(language.entropy_rate(), abs=0.02)


def test_language_is_fixed_and_samples_follow_the_seed():
    a, b = MarkovLanguage(100), MarkovLanguage(100)
    assert np.array_equal(a.next_tokens, b.next_tokens)
    assert np.array_equal(a.sample(4, 50, seed=3), b.sample(4, 50, seed=3))
    assert not np.array_equal(a.sample(4, 50, seed=3), a.sample(4, 50, seed=4))


def test_hashed_positions_are_a_pure_function_of_seed_and_step():
    first = hashed_positions(7, np.arange(10, 20), samples=8, num_positions=1000)
    again = hashed_positions(7, np.arange(15, 20), samples=8, num_positions=1000)
    assert np.array_equal(first[5:], again)
    assert first.min() >= 0 and first.max() < 1000
    assert not np.array_equal(first, hashed_positions(8, np.arange(10, 20), samples=8, num_positions=1000))


def test_batches_are_windows_of_the_corpus_with_shifted_targets():
    corpus, _ = build_corpora("markov", 100, 16, seed=0, device="cpu")
    stream = BatchStream(corpus, seq_len=16, batch_size=4, seed=0)
    inputs, targets = stream.batch(3)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    flat = corpus.tokens.reshape(-1).tolist()
    text = " " + " ".join(map(str, flat)) + " "
    for row in torch.cat([inputs, targets[:, -1:]], dim=1).tolist():
        assert " " + " ".join(map(str, row)) + " " in text   # a real window of the corpus


def test_ranks_take_contiguous_slices_of_the_same_global_batch():
    corpus, _ = build_corpora("markov", 100, 16, seed=0, device="cpu")
    whole = BatchStream(corpus, 16, batch_size=8, seed=5)
    halves = [BatchStream(corpus, 16, batch_size=4, seed=5, rank=r, world_size=2) for r in (0, 1)]
    for step in (0, 1, 1500):   # 1500: after a refill of the window table
        inputs, _ = whole.batch(step)
        assert torch.equal(inputs, torch.cat([h.batch(step)[0] for h in halves]))


def test_batch_of_a_step_does_not_depend_on_history():
    corpus, _ = build_corpora("random", 100, 16, seed=0, device="cpu")
    walked = BatchStream(corpus, 16, 4, seed=1)
    for step in range(5):
        walked.batch(step)
    fresh = BatchStream(corpus, 16, 4, seed=1)
    assert torch.equal(walked.batch(5)[0], fresh.batch(5)[0])


def test_text_corpus_splits_bytes_90_10(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 10)
    train, valid = build_corpora(f"text:{path}", 256, 8, seed=0, device="cpu")
    assert train.tokens.numel() == 2304 and valid.tokens.numel() == 256
    assert train.tokens.max() == 255 and train.optimum_loss is None


def test_random_data_optimum_is_log_vocab():
    train, _ = build_corpora("random", 300, 8, seed=0, device="cpu")
    assert train.optimum_loss == pytest.approx(math.log(300))
    assert 0 <= train.tokens.min() and train.tokens.max() < 300


def test_unknown_data_is_a_config_error():
    with pytest.raises(ConfigError):
        build_corpora("wikipedia", 100, 8, seed=0, device="cpu")
