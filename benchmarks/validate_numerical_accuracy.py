"""Do two versions compute the same model? Same canonical weights in; logits, loss and gradients compared.

    python benchmarks/validate_numerical_accuracy.py --baseline v1 --optimized v2
    python benchmarks/validate_numerical_accuracy.py --baseline v1 --optimized v4 --dtype bfloat16
    python validate_numerical_accuracy.py --baseline ../version1_pytorch_baseline/tiny_llama_v1.py \
                                          --optimized ../version3_triton/tiny_llama_v3.py --tolerance 1e-4

A faster version is only an optimisation if it computes the same thing. Both models load the same canonical
weights (version 1's layout, tinytransformer/weights.py) and see the same random batch; the script prints the
relative error ||optimized - baseline|| / ||baseline|| of the logits, the loss and every parameter's gradient,
and exits with 1 when any of them exceeds the tolerance (0 when all pass, 2 on bad input).

Why errors are not zero. Floating-point addition is not associative: a fused kernel, a different GEMM tiling or
an online softmax adds the same numbers in another order. In float32 that leaves relative errors around 1e-6;
TF32 tensor cores (10-bit mantissa) and bfloat16 autocast leave much larger ones, hence one default tolerance
per precision (DESIGN.md). By default float32 runs are exact float32 on both sides (TF32 off, and the Triton
versions' float32 dot products in IEEE mode); --allow-tf32 measures what TF32 costs.

Versions are given as v1..v4 or as paths to tiny_llama_vK.py. The comparison logic is
tinytransformer/equivalence.py, the same code the test suite uses.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tinytransformer.triton_support import enable_interpreter_if_no_gpu, interpreter_active  # noqa: E402

enable_interpreter_if_no_gpu()  # before anything imports triton: without a GPU, Triton's interpreter

import torch  # noqa: E402

from tinytransformer.cli import OneLineParser, non_negative_int, positive_int, seed_int  # noqa: E402
from tinytransformer.config import ConfigError, ModelConfig  # noqa: E402
from tinytransformer.precision import set_tf32  # noqa: E402
from tinytransformer.equivalence import (canonical, forward_backward, load_version, random_batch,  # noqa: E402
                                         relative_errors, version_name)

# Default tolerances on relative error, per precision (DESIGN.md; the model-level bounds of tests/test_versions.py).
TOLERANCES = {"float32": 1e-4, "tf32": 5e-3, "bfloat16": 2e-2}
# Triton's CPU interpreter is slow: without explicit sizes, a Triton version on the CPU gets this model.
INTERPRETER_CONFIG = dict(vocab_size=101, hidden_dim=64, num_layers=2, num_heads=2, intermediate_size=96,
                          max_seq_len=48)
INTERPRETER_BATCH, INTERPRETER_SEQ = 2, 37   # 37: not a power of two, so the kernels' tail masks are exercised
SIZE_FLAGS = ("vocab_size", "hidden_dim", "num_layers", "num_heads", "intermediate_size")


def parse_args(argv):
    parser = OneLineParser(
        prog="validate_numerical_accuracy.py",
        description="Load the same canonical weights into two TinyLlama versions and compare logits, loss and "
                    "gradients (relative error). Exit 0: all within tolerance, 1: some are not, 2: bad input.")
    parser.add_argument("--baseline", default="v1", help="reference version: v1..v4 or a path to tiny_llama_vK.py")
    parser.add_argument("--optimized", required=True, help="version to check: v1..v4 or a path to tiny_llama_vK.py")
    parser.add_argument("--tolerance", type=float,
                        help="largest relative error allowed (default: 1e-4 float32, 5e-3 with --allow-tf32, "
                             "2e-2 bfloat16)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="float32, or bfloat16 autocast (on a GPU) for both versions")
    parser.add_argument("--allow-tf32", action="store_true",
                        help="let float32 matrix products use TF32 tensor cores (as version 4 does by default)")
    parser.add_argument("--batch-size", type=positive_int, help="sequences in the batch (default 8)")
    parser.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default 128)")
    parser.add_argument("--vocab-size", type=positive_int, help="model size flags, as in the training scripts "
                                                                "(default: the seed configuration)")
    parser.add_argument("--hidden-dim", type=positive_int)
    parser.add_argument("--num-layers", type=positive_int)
    parser.add_argument("--num-heads", type=positive_int)
    parser.add_argument("--intermediate-size", type=positive_int)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and of the batch")
    parser.add_argument("--show", type=non_negative_int, default=5, help="gradients listed individually, worst first")
    args = parser.parse_args(argv)
    try:
        args.baseline, args.optimized = version_name(args.baseline), version_name(args.optimized)
    except ValueError as error:
        parser.error(str(error))
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error("--tolerance must be positive")
    return args


def choose_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("validate_numerical_accuracy.py: error: --device cuda but no GPU is visible")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def problem_size(args, device) -> tuple[ModelConfig, int, int, str | None]:
    """(model config, batch, seq, note). Without size flags: the seed configuration, except for a Triton version
    in the CPU interpreter, which gets a small model (with a note saying so)."""
    given = {name: getattr(args, name) for name in SIZE_FLAGS if getattr(args, name) is not None}
    uses_triton = {args.baseline, args.optimized} & {"v3", "v4"}
    if device.type == "cpu" and interpreter_active() and uses_triton and not given \
            and args.batch_size is None and args.seq_len is None:
        config = ModelConfig(**INTERPRETER_CONFIG)
        note = ("Triton runs in its CPU interpreter here (slow), so a small model is used: "
                f"hidden {config.hidden_dim}, {config.num_layers} layers, batch {INTERPRETER_BATCH} x seq "
                f"{INTERPRETER_SEQ}; pass size flags to choose another")
        return config, INTERPRETER_BATCH, INTERPRETER_SEQ, note
    batch = args.batch_size or 8
    seq = args.seq_len or 128
    config = ModelConfig(**given, max_seq_len=max(seq, ModelConfig().max_seq_len))
    config.validate()   # ConfigError with a one-line message, e.g. heads that do not divide the width
    return config, batch, seq, None


def check_shapes(args, config: ModelConfig, batch: int, seq: int) -> None:
    """The Triton versions' shape rules (tiny_llama_v3/v4.shape_problem, from their kernels) for this model and
    batch: a ConfigError before either model is built."""
    gemm_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    for version in dict.fromkeys((args.baseline, args.optimized)):
        module = load_version(version)
        problem = module.shape_problem(config, batch, seq, gemm_dtype) if hasattr(module, "shape_problem") else None
        if problem:
            raise ConfigError(problem)


def build(version: str, config: ModelConfig, device: torch.device, exact_float32: bool):
    module = load_version(version)
    model = module.TinyLlama(config).to(device)
    if hasattr(model, "use_exact_float32"):   # the Triton versions: float32 tl.dot in IEEE mode, not TF32
        model.use_exact_float32(exact_float32)
    return model, module.SPEC.title


def result_rows(errors: dict, tolerance: float, show: int) -> tuple[list[tuple], bool]:
    """Printable rows (quantity, error, verdict) and whether everything passed."""
    def verdict(error):
        return "MISSING" if error is None else ("ok" if error <= tolerance else "FAIL")

    rows = [(name, errors[name], verdict(errors[name])) for name in ("logits", "loss")]
    grads = {name: error for name, error in errors.items() if name not in ("logits", "loss")}
    worst_first = sorted(grads.items(), key=lambda item: -1.0 if item[1] is None else -item[1])
    failing = [(name, e) for name, e in worst_first if verdict(e) != "ok"]
    listed = failing + [(n, e) for n, e in worst_first[:show] if (n, e) not in failing]
    rows += [(f"grad {name}", error, verdict(error)) for name, error in listed]
    if len(grads) > len(listed):
        rest = [e for n, e in worst_first if (n, e) not in listed]
        rows.append((f"grad: the other {len(rest)} parameters (worst)", max(rest), verdict(max(rest))))
    passed = all(verdict(error) == "ok" for error in errors.values())
    return rows, passed


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = choose_device(args.device)
    if args.dtype == "bfloat16" and device.type == "cpu" and {args.baseline, args.optimized} & {"v3", "v4"}:
        print("validate_numerical_accuracy.py: error: bfloat16 needs a GPU for the Triton versions (Triton's CPU "
              "interpreter computes bfloat16 dot products wrongly)", file=sys.stderr)
        return 2
    exact = args.dtype == "float32" and not args.allow_tf32
    precision = args.dtype if args.dtype == "bfloat16" else ("float32" if exact else "tf32")
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCES[precision]
    try:
        config, batch, seq, note = problem_size(args, device)
        check_shapes(args, config, batch, seq)
    except ConfigError as error:
        print(f"validate_numerical_accuracy.py: error: {error}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        # Global switches, read by every GEMM of both versions: set once, before either model runs.
        set_tf32(not exact)

    weights = canonical(config, seed=args.seed)
    inputs, targets = random_batch(config, batch, seq, device, seed=args.seed + 1)
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    baseline, baseline_title = build(args.baseline, config, device, exact)
    optimized, optimized_title = build(args.optimized, config, device, exact)
    reference = forward_backward(baseline, weights, inputs, targets, autocast_dtype)
    candidate = forward_backward(optimized, weights, inputs, targets, autocast_dtype)
    errors = relative_errors(reference, candidate)

    print(f"{args.optimized} ({optimized_title}) against {args.baseline} ({baseline_title})")
    print(f"device: {device.type}; precision: {precision}"
          + (" (exact: TF32 off, Triton dots in IEEE float32)" if exact else ""))
    print(f"model: vocab {config.vocab_size}, hidden {config.hidden_dim}, layers {config.num_layers}, heads "
          f"{config.num_heads}, ffn {config.intermediate_size}; batch {batch} x seq {seq}; seed {args.seed}")
    if note:
        print(f"note: {note}")
    print(f"loss: baseline {reference[1].item():.6f}, optimized {candidate[1].item():.6f}")
    rows, passed = result_rows(errors, tolerance, args.show)
    width = max(len(row[0]) for row in rows)
    print()
    print(f"{'quantity':<{width}}  {'rel. error':>10}  result")
    for name, error, verdict in rows:
        shown = "-" if error is None else f"{error:.2e}"
        print(f"{name:<{width}}  {shown:>10}  {verdict}")
    print()
    count = len(errors)
    print(f"{'PASS' if passed else 'FAIL'}: {count} quantities (logits, loss, {count - 2} gradients), "
          f"tolerance {tolerance:.0e} on ||optimized - baseline|| / ||baseline||")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
