"""Sample from a trained checkpoint: text for byte-level text runs, token ids for Markov / random runs.

    python sample.py --checkpoint checkpoints/ckpt_step00000600.pt --prompt "def " --max-new-tokens 200
    python sample.py --checkpoint checkpoints           (a directory: its newest valid checkpoint)
    python sample.py --checkpoint CKPT --temperature 0.8 --top-k 40 --seed 1 --device cpu
    python sample.py --checkpoint CKPT --version v2          (any version loads any checkpoint)

The model is rebuilt from the checkpoint's own config with version 1's model class (or --version's) and the
canonical weights. Generation is the plain loop: run the whole window, take the last position's logits,
pick a token, append, repeat; no KV cache, so each new token costs a full forward pass of the window.
The same seed gives the same text on the same machine: tokens are drawn on the CPU from a seeded generator.
The sampled text goes to stdout; one line describing the run goes to stderr.
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the repository root: the shared harness

from tinytransformer.training.checkpoint import CheckpointError  # noqa: E402
from tinytransformer.training.checkpoint.files import list_checkpoints  # noqa: E402
from tinytransformer.training.checkpoint.loading import read_checkpoint  # noqa: E402
from tinytransformer.cli import (EXIT_BAD_INPUT, HelpFormatter, OneLineParser, non_negative_float,  # noqa: E402
                                 non_negative_int, positive_int, seed_int)
from tinytransformer.config import ConfigError, ModelConfig  # noqa: E402
from tinytransformer.device import resolve_device  # noqa: E402

VERSION_MODULES = {
    "v1": "version1_pytorch_baseline.tiny_llama_v1",
    "v2": "version2_pytorch_fused.tiny_llama_v2",
    "v3": "version3_triton.tiny_llama_v3",
    "v4": "version4_triton_ultra.tiny_llama_v4",
}
BYTE_VOCAB = 256   # text runs use one token per byte


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description="Print text (or token ids) sampled from a TinyLlama checkpoint.",
                           formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint file written by any version, or a --checkpoint-dir (its newest valid "
                             "checkpoint)")
    parser.add_argument("--prompt", default=None,
                        help="text runs: the text to continue; Markov/random runs: token ids separated by spaces "
                             "(default: a newline / token 0)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200, help="tokens to generate")
    parser.add_argument("--temperature", type=non_negative_float, default=1.0,
                        help="divide the logits by this; below 1 is more conservative; 0 = always the most "
                             "likely token (greedy)")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sample only among the K most likely tokens; 0 = all")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the sampling generator")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--version", choices=sorted(VERSION_MODULES), default="v1",
                        help="whose model class computes the logits (every version computes the same model)")
    return parser


def load_checkpoint(path: str) -> tuple[Path, dict]:
    """A checkpoint file, or the newest valid checkpoint of a directory (a damaged newer one is skipped)."""
    if not Path(path).is_dir():
        return Path(path), read_checkpoint(path)
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is a directory without checkpoints (ckpt_step*.pt)")
    for _, candidate in reversed(found):
        try:
            return candidate, read_checkpoint(candidate)
        except CheckpointError:
            continue
    raise CheckpointError(f"none of the {len(found)} checkpoint(s) in {path} is readable")


def build_model(version: str, config: ModelConfig) -> torch.nn.Module:
    try:
        module = importlib.import_module(VERSION_MODULES[version])
    except ImportError as error:
        raise ConfigError(f"--version {version} is not available here ({error})") from None
    # The Triton versions' kernels take only some shapes (a checkpoint of version 1 or 2 may have others):
    # checked for the longest window generation runs, one sequence at a time.
    problem = module.shape_problem(config, 1, config.max_seq_len) if hasattr(module, "shape_problem") else None
    if problem:
        raise ConfigError(f"the checkpoint's model cannot run on --version {version}: {problem}")
    return module.TinyLlama(config)


def encode_prompt(prompt: str | None, is_text: bool, vocab_size: int) -> list[int]:
    if is_text:
        data = ("\n" if not prompt else prompt).encode("utf-8")
        return list(data)
    if not prompt:
        return [0]
    try:
        ids = [int(token) for token in prompt.split()]
    except ValueError:
        raise ConfigError(f"--prompt for a token-id checkpoint must be integers separated by spaces, "
                          f"got {prompt!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--prompt token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
             context: int, allowed: int, generator: torch.Generator, device) -> list[int]:
    """Append `max_new_tokens` tokens to the prompt. Only the first `allowed` token ids can be drawn (a text
    model's vocabulary may be larger than the 256 byte values it was trained on)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long, device=device)   # the model's context only
        logits, _ = model(window)
        logits = logits[0, -1, :allowed].float().cpu()
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if 0 < top_k < allowed:
            kth_largest = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        probabilities = torch.softmax(logits.double(), dim=-1)
        ids.append(int(torch.multinomial(probabilities, 1, generator=generator)))
    return ids


def write_output(ids: list[int], is_text: bool) -> None:
    if is_text:
        # Byte tokens need not form valid UTF-8 (a half-trained model splits multi-byte characters): decode with
        # replacement characters so a terminal or a pipe always receives valid text.
        print(bytes(ids).decode("utf-8", errors="replace"), flush=True)
    else:
        print(" ".join(map(str, ids)), flush=True)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        path, checkpoint = load_checkpoint(args.checkpoint)
        config = ModelConfig(**checkpoint["model_config"])
        train_config = checkpoint["train_config"]
        is_text = str(train_config.get("data", "")).startswith("text:")
        device = resolve_device(args.device)
        prompt_ids = encode_prompt(args.prompt, is_text, config.vocab_size)
        model = build_model(args.version, config)
        model.load_canonical(checkpoint["model"])
        model.to(device).eval()
    except ConfigError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The model saw windows of the training seq_len: longer contexts are positions it never learned.
    context = min(int(train_config.get("seq_len", config.max_seq_len)), config.max_seq_len)
    allowed = min(BYTE_VOCAB, config.vocab_size) if is_text else config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    ids = generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, context, allowed,
                   generator, device)
    print(f"{args.version} sampled {args.max_new_tokens} tokens from {path} (written by "
          f"{checkpoint['version']} at step {checkpoint['step']}, data {train_config.get('data')}); seed "
          f"{args.seed}, temperature {args.temperature}, top-k {args.top_k or 'off'}", file=sys.stderr)
    write_output(ids, is_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
