"""Training data: a synthetic Markov language with a known optimum, uniform random tokens, or a user's text.

Why a Markov language? Uniform random tokens (the classic profiling input) cannot be learned: the loss stays
at ln(vocab) and says nothing about whether the model is right. Tokens drawn from a first-order Markov chain
CAN be learned, and the best possible loss is the chain's entropy rate, computed exactly here. So every run
prints "optimum loss = X", and a correct model visibly approaches it.

Every corpus lives on the training device as a [rows, row_len] tensor of token ids. The batch of step t is a
function of (seed, t) alone: a counter-based hash picks each sample's window. A resumed run, or a run on any
number of ranks, therefore sees the same global batch at every step; rank r takes its contiguous slice.

Real text needs no download: `--data text:stdlib` trains on the source code of a fixed list of Python
standard-library modules, read from the running Python's installation (its bytes depend on the Python version).
"""
from __future__ import annotations

import inspect
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checks import check_input_file
from .config import ConfigError

# The Markov language is fixed per vocabulary size (it is "the language"); the run's seed only picks samples.
LANGUAGE_SEED = 20240607
SUCCESSORS_PER_TOKEN = 4          # each token can be followed by 4 others: learnable, far from trivial
DIRICHLET_CONCENTRATION = 0.5     # uneven successor probabilities: optimum ~1.0 nats instead of ln 4
MARKOV_ROWS = 256                 # independent chains in a corpus
MARKOV_ROW_LEN = 4096             # tokens per chain (at least 2 windows of seq_len + 1)
RANDOM_ROWS = 64
STEPS_PER_REFILL = 1024           # window starts are computed for this many steps at a time
VALIDATION_FRACTION = 0.1         # share of a text file held out for validation


# --------------------------------------------------------------------------------------------------
# Counter-based hashing: window positions as a pure function of (seed, step, sample)
# --------------------------------------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash (SplitMix64's finaliser); uint64 arithmetic wraps on purpose."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hashed_positions(seed: int, steps: np.ndarray, samples: int, num_positions: int) -> np.ndarray:
    """[len(steps), samples] integers in [0, num_positions), each a function of (seed, step, sample)."""
    with np.errstate(over="ignore"):
        step_keys = _splitmix64(np.uint64(seed) * _GOLDEN + steps.astype(np.uint64))
        sample_ids = np.arange(samples, dtype=np.uint64)
        keys = _splitmix64(step_keys[:, None] ^ (sample_ids[None, :] * np.uint64(0xD1B54A32D192ED03)))
    return (keys % np.uint64(num_positions)).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# The Markov language
# --------------------------------------------------------------------------------------------------
class MarkovLanguage:
    """A sparse first-order Markov chain over `vocab_size` tokens with an exactly known entropy rate."""

    def __init__(self, vocab_size: int, successors: int = SUCCESSORS_PER_TOKEN,
                 concentration: float = DIRICHLET_CONCENTRATION, seed: int = LANGUAGE_SEED):
        successors = min(successors, vocab_size)
        rng = np.random.default_rng(seed + vocab_size)
        self.vocab_size = vocab_size
        self.next_tokens = np.stack([rng.choice(vocab_size, successors, replace=False) for _ in range(vocab_size)])
        self.probs = rng.dirichlet(np.full(successors, concentration), size=vocab_size)
        self.cumulative = np.cumsum(self.probs, axis=1)
        self.cumulative[:, -1] = 1.0  # guard against rounding: u < 1 always finds a successor
        self.stationary = self._stationary_distribution()

    def _stationary_distribution(self, iterations: int = 2000) -> np.ndarray:
        """Power iteration pi <- pi P, starting uniform (the chain is sparse, so P is never built)."""
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
        for _ in range(iterations):
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.next_tokens, pi[:, None] * self.probs)
            if np.abs(nxt - pi).sum() < 1e-13:
                return nxt
            pi = nxt
        return pi

    def entropy_rate(self) -> float:
        """H = sum_i pi_i * H(P[i, :]) in nats: the lowest mean cross-entropy any next-token model can reach."""
        with np.errstate(divide="ignore", invalid="ignore"):
            row_entropy = -np.nansum(self.probs * np.log(self.probs), axis=1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, rows: int, length: int, seed: int) -> np.ndarray:
        """`rows` independent chains of `length` tokens, each starting from the stationary distribution.

        Starting from the stationary distribution makes every position equally distributed, so the expected
        loss of a perfect model is the entropy rate at every position of every window.
        """
        rng = np.random.default_rng(seed)
        tokens = np.empty((rows, length), dtype=np.int64)
        current = rng.choice(self.vocab_size, size=rows, p=self.stationary)
        tokens[:, 0] = current
        for t in range(1, length):
            u = rng.random(rows)
            successor_index = (self.cumulative[current] < u[:, None]).sum(axis=1)
            current = self.next_tokens[current, successor_index]
            tokens[:, t] = current
        return tokens


# --------------------------------------------------------------------------------------------------
# Corpora and batches
# --------------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """Token rows on the training device, with what is known about the best achievable loss."""
    tokens: torch.Tensor          # [rows, row_len] int64
    description: str
    optimum_loss: float | None    # None when unknown (real text)


def _markov_corpus(vocab_size: int, seq_len: int, seed: int, device) -> tuple[Corpus, Corpus]:
    language = MarkovLanguage(vocab_size)
    row_len = max(MARKOV_ROW_LEN, 2 * (seq_len + 1))
    optimum = language.entropy_rate()
    description = (f"Markov language: {vocab_size} tokens, {language.next_tokens.shape[1]} successors each, "
                   f"entropy rate {optimum:.4f} nats")
    # Training and validation streams are independent samples of the same chain.
    train = language.sample(MARKOV_ROWS, row_len, seed=seed)
    valid = language.sample(MARKOV_ROWS // 4, row_len, seed=seed + 7919)
    return (Corpus(torch.from_numpy(train).to(device), description, optimum),
            Corpus(torch.from_numpy(valid).to(device), description + " (held-out stream)", optimum))


def _random_corpus(vocab_size: int, seq_len: int, seed: int, device) -> tuple[Corpus, Corpus]:
    row_len = max(MARKOV_ROW_LEN, 2 * (seq_len + 1))
    generator = torch.Generator().manual_seed(seed)
    train = torch.randint(0, vocab_size, (RANDOM_ROWS, row_len), generator=generator)
    valid = torch.randint(0, vocab_size, (RANDOM_ROWS // 4, row_len), generator=generator)
    description = f"uniform random tokens over {vocab_size} ids (not learnable: loss stays near ln V)"
    optimum = math.log(vocab_size)
    return Corpus(train.to(device), description, optimum), Corpus(valid.to(device), description, optimum)


# --data text:stdlib: real text that every machine with Python already has, so no download is needed. The
# modules are a fixed, sorted list (~2.9 MB of source on Python 3.11); a module missing from this Python is
# skipped. The exact bytes therefore depend on the Python version: compare losses only between runs on the
# same Python (the run header prints the version and the byte count).
STDLIB_TEXT = "stdlib"
TEXT_FILE = "--data text file"   # how messages name the file of --data text:PATH
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bdb", "calendar", "codecs", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "dis", "doctest", "enum", "fractions", "ftplib", "functools",
    "gettext", "gzip", "heapq", "imaplib", "inspect", "ipaddress", "locale", "mailbox", "optparse", "os",
    "pathlib", "pdb", "pickle", "pickletools", "platform", "plistlib", "pprint", "pydoc", "queue", "random",
    "shutil", "smtplib", "socket", "ssl", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "traceback", "typing", "uuid", "warnings", "weakref", "zipfile",
)
STDLIB_MIN_BYTES = 1_000_000


def stdlib_source_dir() -> Path:
    """The directory of the running Python's pure-Python standard library (where inspect.py lives)."""
    return Path(inspect.getfile(inspect)).resolve().parent


def stdlib_text_bytes() -> bytes:
    """The source of STDLIB_MODULES, in that order, each preceded by a one-line header naming its file."""
    root = stdlib_source_dir()
    parts = []
    for name in STDLIB_MODULES:
        # A module may be a file (pathlib.py) or, in newer Pythons, a package (pathlib/__init__.py).
        for candidate in (root / f"{name}.py", root / name / "__init__.py"):
            if candidate.is_file():
                relative = candidate.relative_to(root).as_posix()
                parts.append(f"# ===== {relative} =====\n".encode() + candidate.read_bytes())
                break
    data = b"\n".join(parts)
    if len(data) < STDLIB_MIN_BYTES:
        raise ConfigError(f"--data text:stdlib found only {len(data):,} bytes of Python source in {root} "
                          f"(is the standard library installed without its .py files?); use text:PATH")
    return data


def text_file_of(data: str) -> str | None:
    """The file a --data choice reads: PATH of text:PATH; None for markov, random and text:stdlib."""
    if data.startswith("text:") and data != f"text:{STDLIB_TEXT}":
        return data[len("text:"):]
    return None


def read_text_bytes(path: str | Path) -> bytes:
    """The bytes of a --data text:PATH file; a directory, a device or a pipe is one line (check_input_file)."""
    path = check_input_file(path, TEXT_FILE)
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read {TEXT_FILE} {path}: {error.strerror or error}") from None


def _text_corpus(path: str, vocab_size: int, seq_len: int, device) -> tuple[Corpus, Corpus]:
    if vocab_size < 256:
        raise ConfigError(f"--data text:PATH uses byte tokens (256 ids); --vocab-size must be >= 256, "
                          f"got {vocab_size}")
    if path == STDLIB_TEXT:
        data = stdlib_text_bytes()
        source = f"the Python {platform.python_version()} standard library's source ({len(STDLIB_MODULES)} modules)"
    else:
        data = read_text_bytes(path)
        source = str(path)
    split = int(len(data) * (1 - VALIDATION_FRACTION))
    train_bytes, valid_bytes = data[:split], data[split:]
    needed = seq_len + 2
    if len(valid_bytes) < needed or len(train_bytes) < needed:
        raise ConfigError(f"text file {path} has {len(data)} bytes; it needs at least "
                          f"{math.ceil(needed / VALIDATION_FRACTION)} for --seq-len {seq_len} "
                          f"(90% train / 10% validation)")
    as_row = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int64)[None, :]  # noqa: E731
    description = f"byte-level text from {source}: {len(data):,} bytes, 90/10 train/validation split"
    return (Corpus(as_row(train_bytes).to(device), description, None),
            Corpus(as_row(valid_bytes).to(device), description + " (validation split)", None))


def build_corpora(data: str, vocab_size: int, seq_len: int, seed: int, device) -> tuple[Corpus, Corpus]:
    """(training corpus, validation corpus) for a --data choice, already on `device`."""
    if data == "markov":
        return _markov_corpus(vocab_size, seq_len, seed, device)
    if data == "random":
        return _random_corpus(vocab_size, seq_len, seed, device)
    if data.startswith("text:"):
        return _text_corpus(data[len("text:"):], vocab_size, seq_len, device)
    raise ConfigError(f"unknown --data {data!r}: use markov, random, text:PATH or text:stdlib")


class BatchStream:
    """Batches of a corpus: step t's global batch depends on (seed, t) only.

    `batch(t)` returns (inputs, targets) of this rank, each [batch_size, seq_len]. Window starts are computed
    on the host for STEPS_PER_REFILL steps at a time and kept on the device, so a training step does no host work.
    """

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        rows, row_len = corpus.tokens.shape
        self.flat_tokens = corpus.tokens.reshape(-1)
        self.row_len = row_len
        self.windows_per_row = row_len - seq_len       # a window holds seq_len + 1 tokens
        if self.windows_per_row < 1:
            raise ConfigError(f"corpus rows of {row_len} tokens are too short for --seq-len {seq_len}")
        self.num_positions = rows * self.windows_per_row
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.device = corpus.tokens.device
        self.offsets = torch.arange(seq_len + 1, device=self.device)
        self._first_step = None
        self._starts = None

    def _refill(self, step: int) -> None:
        first = step - step % STEPS_PER_REFILL
        steps = np.arange(first, first + STEPS_PER_REFILL)
        global_batch = self.batch_size * self.world_size
        positions = hashed_positions(self.seed, steps, global_batch, self.num_positions)
        mine = positions[:, self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        rows, columns = np.divmod(mine, self.windows_per_row)
        starts = rows * self.row_len + columns
        self._starts = torch.from_numpy(starts).to(self.device)
        self._first_step = first

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._first_step is None or not (self._first_step <= step < self._first_step + STEPS_PER_REFILL):
            self._refill(step)
        starts = self._starts[step - self._first_step]
        windows = self.flat_tokens[starts[:, None] + self.offsets]   # [batch, seq_len + 1]
        return windows[:, :-1], windows[:, 1:]
