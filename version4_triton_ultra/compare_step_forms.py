"""Version 4's graph-captured step in several forms, built in one process and timed in interleaved rounds.

    python compare_step_forms.py --use-amp --preset medium
    python compare_step_forms.py --use-amp --preset large --forms rope-in-gemm separate-rope rope-in-attention --rounds 5 --output-json runs/rope_forms_large.json

Each of version 4's fusions has a switch back to the form it replaces, and whether the fusion pays depends on
the shape: the way to decide is to time both forms of the same step on the same GPU, taking turns, so that a
clock or a neighbour that slows one round slows every form in it. Starting one training run per form and
alternating them works too (the README's SwiGLU table), but each run pays a minute of start-up at the large
preset; here every form is built once (profile_graphed_step.build_step: the model, its optimizer and its
GraphedStep, as the training script builds them), warmed up and captured, and then each round times every form
in turn, each round starting with the next form: the median of --steps replays each, timed with device events
(step_forms.py, which the tuners of single kernels use too). The table gives each form's median over the rounds,
its time relative to the first form, the rounds in which it was faster than the first, and every round.

Every form keeps its model, optimizer state and graph on the GPU while the others run (about 23 GB each at the
large preset in bfloat16). The forms use one fixed batch; their losses are not compared here (the equivalence
tests do that: tests/test_versions.py, V4_SWITCHES). Needs a GPU (CUDA or ROCm).

Not a form: `--cublas-workspace` (profile_graphed_step.py's flag, the training script's default none). cuBLAS reads
its workspace size once per process, so every form here shares it; its two settings are compared by separate runs,
taking turns (benchmarks/results/kernel_time/h200_v4_cublas_workspace.json).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the shared harness

from tinytransformer.cli import OneLineParser, command_line, positive_int, run_command  # noqa: E402
from tinytransformer.cublas_workspace import describe_cublas_workspace  # noqa: E402
from tinytransformer.device import software_and_gpu  # noqa: E402
from tinytransformer.outputs import write_json  # noqa: E402
from tinytransformer.paths import prove_output_file  # noqa: E402

# Each form: the flags of profile_graphed_step.py that select it (the switches of tiny_llama_v4.py).
FORMS = {
    "as-is": [],                                          # version 4's defaults (each form chosen by size)
    "rope-in-gemm": ["--rope-in-gemm"],                   # RoPE in the Triton QKV GEMM's epilogue
    "separate-rope": ["--separate-rope"],                 # the vendor QKV GEMM, then a RoPE kernel of its own
    "rope-in-attention": ["--rope-in-attention"],         # RoPE as the attention kernel loads q and k
    "swiglu-in-gemms": ["--swiglu-in-gemms"],             # SwiGLU in the Triton feed-forward GEMMs' epilogues
    "separate-swiglu": ["--separate-swiglu"],             # vendor feed-forward GEMMs, SwiGLU as kernels of its own
    "cudnn-attention": ["--cudnn-attention"],             # cuDNN's fused attention after the QKV GEMM and RoPE
    "triton-attention": ["--triton-attention"],           # version 4's Triton flash attention
    "torch-adamw": ["--torch-adamw"],                     # torch's fused AdamW + a separate bfloat16 weight copy
    "no-weight-grad-stream": ["--no-weight-grad-stream"],   # the weight-gradient GEMMs on the main stream
    "equal-stream-priority": ["--equal-stream-priority"],   # the main stream not above the second stream
    "float32-weight-grads": ["--float32-weight-grads"],   # the second stream's weight gradients in float32
    "float32-head-grad": ["--float32-head-grad"],         # the output head's gradient summed in float32
    "no-programmatic-launch": ["--no-programmatic-launch"],   # each Triton kernel starts after the last one ends
}


def parse_args(argv):
    parser = OneLineParser(prog="compare_step_forms.py", description=__doc__.splitlines()[0],
                           epilog="Every other flag is profile_graphed_step.py's and describes the step all forms "
                                  "share: --preset, --batch-size, --seq-len, --use-amp.")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=["rope-in-gemm", "separate-rope"],
                        help="the forms to time, the first the reference of the ratios [rope-in-gemm separate-rope]")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds [3]")
    parser.add_argument("--steps", type=positive_int, default=50, help="timed replays per form and round [50]")
    parser.add_argument("--output-json", help="also write the figures, the machine and the command here")
    args, shared = parser.parse_known_args(argv)
    if len(set(args.forms)) != len(args.forms):
        parser.error(f"--forms: each form once; got {' '.join(args.forms)}")
    printing_only = [flag for flag in shared if flag.split("=")[0] == "--top"]
    if printing_only:
        parser.error(f"{printing_only[0]}: profile_graphed_step.py's kernel table is not printed here; drop it")
    # Each form's step, parsed by profile_graphed_step.py's own parser under this script's name: it refuses bad
    # sizes, flags that are not its own and a missing GPU in one line, before anything is built.
    from version4_triton_ultra import profile_graphed_step
    args.form_args = {form: profile_graphed_step.parse_args(shared + FORMS[form] + ["--steps", str(args.steps)],
                                                            prog=parser.prog)
                      for form in args.forms}
    args.shared = args.form_args[args.forms[0]]   # what every form shares: the sizes, the precision
    return args


def time_forms(form_args: dict, rounds: int, steps: int) -> dict:
    """{form: [median step ms of each round]}: every form built, warmed up and captured first, each while its own
    process-wide launch setting holds (profile_graphed_step.launches_of), then timed in turns."""
    from version4_triton_ultra import profile_graphed_step, step_forms
    captured = step_forms.capture_forms({form: (args, profile_graphed_step.launches_of(args))
                                         for form, args in form_args.items()}, fewer="compare fewer --forms per run")
    return step_forms.time_in_turns(captured, rounds, steps)


def report(times: dict) -> list[dict]:
    """step_forms.step_table's rows, each with the flags that select its form."""
    from version4_triton_ultra import step_forms
    return [{**row, "flags": FORMS[row["form"]]} for row in step_forms.step_table(times)]


def print_table(rows: list[dict], args) -> None:
    size = f"preset {args.shared.preset}" if args.shared.preset else "seed model"
    precision = "bfloat16 autocast" if args.shared.use_amp else "float32 (TF32 GEMMs)"
    print(f"{software_and_gpu()['gpu']}, {size}, {precision}: median step of {args.steps} replays per round, "
          f"{args.rounds} interleaved rounds")
    workspace = describe_cublas_workspace(on_gpu=True)
    if workspace:
        print(f"cuBLAS workspace (every form): {workspace}")
    print(f"{'form':<24} {'median ms':>10} {'vs first':>9} {'faster':>7}  rounds (ms)")
    for row in rows:
        rounds = " / ".join(f"{ms:.3f}" for ms in row["rounds_ms"])
        faster = f"{row['rounds_faster_than_first']}/{len(row['rounds_ms'])}"
        print(f"{row['form']:<24} {row['median_step_ms']:10.3f} {row['relative_to_first']:8.3f}x {faster:>7}  {rounds}")


def main(argv=None) -> int:
    def body() -> int:
        args = parse_args(argv)
        if args.output_json:
            prove_output_file(args.output_json, "--output-json")   # before minutes of building and timing
        rows = report(time_forms(args.form_args, args.rounds, args.steps))
        print_table(rows, args)
        if args.output_json:
            write_json(args.output_json, {
                "benchmark": "version 4's step in several forms, interleaved rounds in one process",
                "command": "python version4_triton_ultra/" + command_line("compare_step_forms.py", argv),
                "environment": software_and_gpu(), "preset": args.shared.preset, "use_amp": args.shared.use_amp,
                "batch_size": args.shared.batch_size, "seq_len": args.shared.seq_len,
                "rounds": args.rounds, "steps_per_round": args.steps,
                "cublas_workspace": describe_cublas_workspace(on_gpu=True), "rows": rows})
            print(f"results: {args.output_json}")
        return 0
    return run_command("compare_step_forms.py", body)


if __name__ == "__main__":
    sys.exit(main())
