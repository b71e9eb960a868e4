"""Time version 4's AdamW kernel (kernels/adamw.py) under other launches for one preset's parameters, and check each.

    python tune_adamw.py --preset medium
    python tune_adamw.py --preset large --candidates 512,4 1024,8 --output-json runs/adamw_large.json

TritonAdamW streams every parameter once a step: it reads the weight, its gradient and the two moments in float32
and writes the weight, the moments and the weight's bfloat16 copy (28 bytes a parameter, 30 with a copy), so its
goal is the memory bandwidth. Its launch is the elements each program updates and the warps that do it
(kernels/adamw.py: launch_for, by the size of a parameter group). Each candidate is ELEMENTS,WARPS (powers of
two) for every group; the first row of the table is the module's own rule.

What it times: version 4's model at the preset's sizes (float32 weights, random gradients, the bfloat16 copies
that bfloat16 autocast uses), its optimizer as the training script builds it (one parameter group a layer, then
the norms, then the embedding: one launch each), and for every candidate an optimizer over the same parameters
and the same state. A CUDA/HIP graph of 3 optimizer steps per candidate, replayed in interleaved rounds (median of
5, microseconds per step), as tune_qk_rotation.py times (tinytransformer/kernel_bench/graph_timing.py). The
parameters of one step far exceed the L2 cache, so every step reads from memory.

The check: the largest layer's parameters are copied twice and updated once from the same state, under the
module's launch and under the candidate's; the weights, moments and copies must agree bit for bit (each element's
arithmetic does not depend on the launch), else the row says WRONG. Needs a GPU.

The kernel alone is not the whole answer: in the training step most groups are updated on the second stream
beside the backward pass, and at the seed size the launch that was faster alone made the step slower (see
kernels/adamw.py). Time a candidate in the step before adopting it.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line  # noqa: E402
from tinytransformer.config import (ModelConfig, TrainConfig, available_presets,  # noqa: E402
                                    preset_settings)
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.triton_support import enable_interpreter_if_no_gpu  # noqa: E402

enable_interpreter_if_no_gpu()  # before the kernels import triton (without a GPU this script stops at its checks)

from tinytransformer.device import peak_bandwidth_tbs, software_and_gpu  # noqa: E402
from tinytransformer.kernel_bench.graph_timing import captured_launches, graph_ms, time_interleaved  # noqa: E402
from tinytransformer.kernel_bench.tuner_cli import (candidates_from_flags, powers_of_two,  # noqa: E402
                                                  prove_output_json, refuse_without_gpu)
from version4_triton_ultra.kernels import adamw  # noqa: E402

DEFAULT_CANDIDATES = [(256, 2), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (2048, 16)]
STEPS_PER_GRAPH = 3
ROUNDS = 5
BYTES_PER_PARAMETER = 28   # float32 weight, gradient and two moments read; weight and moments written
BYTES_PER_COPY_ELEMENT = 2   # the bfloat16 copy written


def candidate(text: str) -> tuple:
    elements, warps = powers_of_two(text, "ELEMENTS,WARPS", "512,4")
    if warps > 32 or elements < 32 * warps:
        raise ValueError(f"{text}: at most 32 warps, and at least one element a thread of a 32-wide warp")
    return elements, warps


def parse_args(argv):
    parser = OneLineParser(prog="tune_adamw.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=available_presets(), default="medium",
                        help="the model of configs/PRESET.yaml whose parameters are updated [medium]")
    parser.add_argument("--candidates", nargs="+", metavar="E,W",
                        help="launches to try: elements and warps a program [a built-in list]")
    parser.add_argument("--output-json", help="also write the table, the machine and the command here")
    args = parser.parse_args(argv)
    prove_output_json(parser, args.output_json)
    args.candidates = candidates_from_flags(parser, args.candidates, candidate, DEFAULT_CANDIDATES)
    refuse_without_gpu(parser)
    return args


def model_and_optimizer(preset: str):
    """Version 4's model at the preset's sizes on the GPU, with random gradients and bfloat16 copies, and the
    optimizer the training script gives it."""
    from version4_triton_ultra import tiny_llama_v4 as v4
    model_fields, _ = preset_settings(preset)
    model = v4.TinyLlama(ModelConfig(**model_fields)).cuda()
    model.refresh_16bit_weights(torch.bfloat16)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    return model, model.configure_optimizer(TrainConfig(use_amp=True, amp_dtype="bfloat16"))


def same_parameters(optimizer, launch) -> adamw.TritonAdamW:
    """An optimizer over `optimizer`'s parameter groups and state, launched with `launch`."""
    other = adamw.TritonAdamW([dict(group) for group in optimizer.param_groups], launch=launch,
                              sixteen_bit_copies=optimizer.sixteen_bit_copies)
    other.state = optimizer.state
    return other


def one_update(params, copies, launch) -> list:
    """Weights, moments and copies after one step from fresh state, on copies of `params` (with their gradients)."""
    clones = [p.detach().clone().requires_grad_(True) for p in params]
    for clone, param in zip(clones, params):
        clone.grad = param.grad.clone()
    clone_copies = {clone: copies[param].clone() for clone, param in zip(clones, params) if param in copies}
    optimizer = adamw.TritonAdamW(clones, lr=1e-3, sixteen_bit_copies=clone_copies, launch=launch)
    optimizer.step()
    state = [optimizer.state[c] for c in clones]
    return clones + [s["exp_avg"] for s in state] + [s["exp_avg_sq"] for s in state] + list(clone_copies.values())


def check(params, copies, launch, want) -> str:
    """"ok" when one update of `params` under `launch` gives `want` (the module's launch's update) bit for bit."""
    got = one_update(params, copies, launch)
    return "ok" if all(torch.equal(a, b) for a, b in zip(got, want)) else "WRONG"


def label(launch) -> str:
    return "{} elements, {} warps".format(*launch)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    model, rule = model_and_optimizer(args.preset)
    rule.step()   # the state, and the launch tables the capture reuses
    largest = max(rule.param_groups, key=lambda g: sum(p.numel() for p in g["params"]))
    want = one_update(largest["params"], rule.sixteen_bit_copies, None)
    optimizers = {"the rule (by group size)": (rule, "ok")}
    for launch in args.candidates:
        try:
            verdict = check(largest["params"], rule.sixteen_bit_copies, launch, want)
            optimizers[label(launch)] = (same_parameters(rule, launch), verdict)
        except Exception as why:   # noqa: BLE001 - a launch this GPU cannot compile or run is not a candidate
            print(f"{label(launch):<26} fails: {str(why).splitlines()[0][:80]}")
    graphs = {name: captured_launches(optimizer.step, STEPS_PER_GRAPH) for name, (optimizer, _) in optimizers.items()}
    times = time_interleaved({name: (lambda g=g: graph_ms(g)) for name, g in graphs.items()}, ROUNDS)

    parameters = sum(p.numel() for p in model.parameters())
    bytes_moved = (BYTES_PER_PARAMETER * parameters
                   + BYTES_PER_COPY_ELEMENT * sum(c.numel() for c in rule.sixteen_bit_copies.values()))
    peak = peak_bandwidth_tbs(torch.cuda.get_device_name())
    print(f"{torch.cuda.get_device_name()}: AdamW of the {args.preset} preset's {parameters / 1e6:.1f} M parameters "
          f"({len(rule.param_groups)} launches a step, {bytes_moved / 1e6:.0f} MB); us per step (graph of "
          f"{STEPS_PER_GRAPH}, median of {ROUNDS} rounds)")
    rows = []
    for name, ms in times.items():
        us = 1000.0 * ms / STEPS_PER_GRAPH
        share = f"{bytes_moved / us / 1e6 / peak:6.1%}" if peak else "     -"
        print(f"{name:<26} {us:9.1f} us  {bytes_moved / us / 1e3:7.0f} GB/s {share}  {optimizers[name][1]}")
        rows.append({"launch": name, "us_per_step": us, "gb_per_s": bytes_moved / us / 1e3,
                     "check": optimizers[name][1]})
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": f"version 4's AdamW kernel under candidate launches, graph of {STEPS_PER_GRAPH} optimizer "
                         f"steps, median of {ROUNDS} interleaved rounds",
            "command": "python version4_triton_ultra/" + command_line("tune_adamw.py", argv),
            "environment": software_and_gpu(), "preset": args.preset, "parameters": parameters,
            "launches_per_step": len(rule.param_groups), "bytes_per_step": bytes_moved,
            "peak_bandwidth_tbs": peak, "results": rows})
        print(f"results: {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
