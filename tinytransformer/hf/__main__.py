"""python -m tinytransformer.hf export | import: move a model between the workshop and Hugging Face.

    python -m tinytransformer.hf export --checkpoint checkpoints/run --out hf_model
        the newest checkpoint of a directory (or one file) -> a directory LlamaForCausalLM.from_pretrained loads
    python -m tinytransformer.hf import --model hf_model --out checkpoints/imported
        a local Hugging Face Llama of the workshop's architecture -> a step-0 checkpoint every version resumes
"""
from __future__ import annotations

import sys

from ..cli import HelpFormatter, OneLineParser, run_command
from ..training.checkpoint import CheckpointError
from .convert import export_checkpoint, import_model

PROG = "python -m tinytransformer.hf"


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG, formatter_class=HelpFormatter,
                           description="Export a checkpoint as a Hugging Face LlamaForCausalLM, or import one.")
    commands = parser.add_subparsers(dest="command", metavar="{export,import}")
    commands.required = True
    export = commands.add_parser("export", formatter_class=HelpFormatter,
                                 help="a checkpoint -> a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True, help="a checkpoint file, or a directory (its newest one)")
    export.add_argument("--out", required=True, help="the model directory to create (must not hold files)")
    imported = commands.add_parser("import", formatter_class=HelpFormatter,
                                   help="a Hugging Face model directory -> a step-0 checkpoint")
    imported.add_argument("--model", required=True, help="a local Hugging Face Llama model directory")
    imported.add_argument("--out", required=True, help="the checkpoint directory to create (must not hold files)")
    return parser


def export_command(args) -> int:
    source, out = export_checkpoint(args.checkpoint, args.out)
    print(f"exported {source} -> {out}/ (config.json, model.safetensors)")
    print(f"load it with: transformers.LlamaForCausalLM.from_pretrained({str(out)!r})")
    return 0


def import_command(args) -> int:
    out, config = import_model(args.model, args.out)
    print(f"imported {args.model} -> {out}/ckpt_step00000000.pt ({config.num_layers} layers, hidden "
          f"{config.hidden_dim}, vocab {config.vocab_size})")
    print(f"train from it with any version: --checkpoint-dir {out} --resume auto (and the same model flags)")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)   # --help and bad flags end the process here (exit 0 / 2)
    body = export_command if args.command == "export" else import_command
    return run_command(PROG, lambda: body(args), errors=(CheckpointError, OSError))


if __name__ == "__main__":
    sys.exit(main())
