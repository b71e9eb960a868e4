#!/usr/bin/env bash
# Every profiler of the workshop on one training script, one after the other, all outputs under
# one timestamped directory, and a summary table at the end. Run with --help for the options.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The steps, in the order they run.
readonly ALL_STEPS=(timed-run pytorch-profiler deepspeed-flops rocprofv3 rocprof-sys rocprof-compute nsys ncu)

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME --script TRAINING_SCRIPT [OPTIONS] [-- TRAINING FLAGS]

Runs, in this order, each with the same TRAINING FLAGS:
  timed-run         \${PYTHON:-python3} SCRIPT FLAGS --output-json RUN/timed-run/metrics.json
  pytorch-profiler  run_pytorch_profiler.py FLAGS --profile-dir RUN/pytorch-profiler
  deepspeed-flops   run_deepspeed_flops.py FLAGS --output-dir RUN/deepspeed-flops
  rocprofv3         run_rocprofv3.sh        (AMD GPU)     kernel trace + statistics
  rocprof-sys       run_rocprof_sys.sh      (AMD GPU)     Perfetto timeline
  rocprof-compute   run_rocprof_compute.sh  (AMD GPU)     hardware counters
  nsys              run_nsys.sh             (NVIDIA GPU)  timeline + kernel summary
  ncu               run_ncu.sh              (NVIDIA GPU)  hardware counters of a few kernels
The two Python profilers are looked for beside the training script. A step is skipped, with its
reason in the summary, when its tool is not installed, its script is absent, DeepSpeed is not
installed, no GPU is visible to PyTorch, or the GPU is from the other vendor.

Needs: Python with PyTorch; each profiler is optional (see the single-tool scripts' --help).

Options:
  --script PATH       training script (the version wrappers set it)
  --output-dir DIR    run directory (default: ./profile_runs/<timestamp>)
  --skip LIST         comma-separated steps not to run, e.g. --skip rocprof-compute,ncu
  --force-gpu-tools   run the GPU tools even when PyTorch sees no GPU of their vendor
  --verbose           show every step's output as it runs (it is always kept in RUN/logs/)
  -h, --help          this help

Writes into RUN: one directory per step, logs/STEP.log for each step, summary.txt.
Exit codes: 0 nothing failed (skipped steps are fine), 1 a step failed, 2 usage error.

Examples:
  bash version2_pytorch_fused/run_all_profilers.sh -- --batch-size 8 --seq-len 128 --num-steps 30
  bash $SCRIPT_NAME --script version1_pytorch_baseline/tiny_llama_v1.py --skip rocprof-compute,ncu \\
       --output-dir /tmp/v1_profiles -- --num-steps 10
EOF
}

SKIP_LIST=""
FORCE_GPU_TOOLS=0
VERBOSE=0
while (($#)); do
    case "$1" in
        --skip) need_value "$@"; SKIP_LIST="$2"; shift 2 ;;
        --force-gpu-tools) FORCE_GPU_TOOLS=1; shift ;;
        --verbose) VERBOSE=1; shift ;;
        *) parse_common_option "$@" || die_usage "unknown option '$1'"; shift "$CONSUMED" ;;
    esac
done

IFS=',' read -r -a SKIPPED_BY_USER <<<"$SKIP_LIST"
for step in "${SKIPPED_BY_USER[@]}"; do
    [[ " ${ALL_STEPS[*]} " == *" $step "* ]] || die_usage "--skip: unknown step '$step' (steps: ${ALL_STEPS[*]})"
done
# A command with nothing to do is an error, not an empty summary.
remaining=0
for step in "${ALL_STEPS[@]}"; do
    [[ ",$SKIP_LIST," == *",$step,"* ]] || remaining=$((remaining + 1))
done
((remaining > 0)) || die_usage "--skip names every step: nothing to run"

resolve_script
SCRIPT_DIR="$(dirname "$SCRIPT")"
if [[ -n "$OUTPUT_DIR" ]]; then
    ensure_writable_dir "$OUTPUT_DIR" "--output-dir"
    RUN_DIR="$(cd "$OUTPUT_DIR" && pwd)"
else
    RUN_DIR="$(new_timestamped_dir ./profile_runs)"
fi
LOG_DIR="$RUN_DIR/logs"
mkdir -p "$LOG_DIR"
training_command

user_skipped() { [[ ",$SKIP_LIST," == *",$1,"* ]]; }

# "cuda", "rocm" or "none": the GPU PyTorch sees.
detect_gpu() {
    "$PY" -c 'import torch
print("none" if not torch.cuda.is_available() else ("rocm" if torch.version.hip else "cuda"))' \
        2>/dev/null || echo none
}

# Why a GPU tool of VENDOR (rocm or cuda) cannot run here; empty when it can. GPU_KIND is set
# by the caller, once, and only when a GPU tool may run (importing torch takes a few seconds).
gpu_skip_reason() {
    local vendor="$1"
    if [[ "$FORCE_GPU_TOOLS" == 1 ]]; then
        return 0
    elif [[ "$GPU_KIND" == none ]]; then
        echo "no GPU visible to PyTorch (torch.cuda.is_available() is False; --force-gpu-tools runs it anyway)"
    elif [[ "$vendor" == rocm && "$GPU_KIND" == cuda ]]; then
        echo "needs an AMD GPU; this one is NVIDIA"
    elif [[ "$vendor" == cuda && "$GPU_KIND" == rocm ]]; then
        echo "needs an NVIDIA GPU; this one is AMD"
    fi
}

deepspeed_installed() {
    "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)' 2>/dev/null
}

# run_python_step STEP HELPER_SCRIPT OUTPUT_OPTION: a Python profiler that sits beside the script.
run_python_step() {
    local step="$1" helper="$SCRIPT_DIR/$2" option="$3"
    if [[ ! -f "$helper" ]]; then
        skip_step "$step" "no $2 beside $(basename "$SCRIPT")"
        return
    fi
    run_step "$step" "$step/" "$LOG_DIR/$step.log" -- \
        "$PY" "$helper" "${TRAIN_ARGS[@]}" "$option" "$RUN_DIR/$step"
}

# run_tool_step STEP TOOL VENDOR WRAPPER: one of the single-tool scripts in this directory.
run_tool_step() {
    local step="$1" tool="$2" vendor="$3" wrapper="$4" reason
    if ! have "$tool"; then
        skip_step "$step" "$(missing_tool_message "$tool")"
        return
    fi
    if [[ "$FORCE_GPU_TOOLS" == 0 && -z "$GPU_KIND" ]]; then
        GPU_KIND="$(detect_gpu)"
        info "GPU seen by PyTorch: $GPU_KIND"
    fi
    reason="$(gpu_skip_reason "$vendor")"
    if [[ -n "$reason" ]]; then
        skip_step "$step" "$reason"
        return
    fi
    run_step "$step" "$step/" "$LOG_DIR/$step.log" -- \
        bash "$PROFILERS_DIR/$wrapper" --script "$SCRIPT" --output-dir "$RUN_DIR/$step" -- "${TRAIN_ARGS[@]}"
}

GPU_KIND=""
info "run directory: $RUN_DIR"
info "training command: $(show_cmd "${TRAIN_CMD[@]}" | cut -c3-)"

for step in "${ALL_STEPS[@]}"; do
    if user_skipped "$step"; then
        skip_step "$step" "--skip $step"
        continue
    fi
    case "$step" in
        timed-run)
            mkdir -p "$RUN_DIR/timed-run"
            run_step timed-run timed-run/metrics.json "$LOG_DIR/timed-run.log" -- \
                "${TRAIN_CMD[@]}" --output-json "$RUN_DIR/timed-run/metrics.json"
            ;;
        pytorch-profiler) run_python_step pytorch-profiler run_pytorch_profiler.py --profile-dir ;;
        deepspeed-flops)
            if deepspeed_installed; then
                run_python_step deepspeed-flops run_deepspeed_flops.py --output-dir
            else
                skip_step deepspeed-flops "DeepSpeed not installed (pip install deepspeed)"
            fi
            ;;
        rocprofv3) run_tool_step rocprofv3 rocprofv3 rocm run_rocprofv3.sh ;;
        rocprof-sys) run_tool_step rocprof-sys rocprof-sys-run rocm run_rocprof_sys.sh ;;
        rocprof-compute) run_tool_step rocprof-compute rocprof-compute rocm run_rocprof_compute.sh ;;
        nsys) run_tool_step nsys nsys cuda run_nsys.sh ;;
        ncu) run_tool_step ncu ncu cuda run_ncu.sh ;;
    esac
done

print_summary | tee "$RUN_DIR/summary.txt"
printf '\nAll outputs under %s\n' "$RUN_DIR"
if any_step_failed; then
    exit "$EXIT_FAILED"
fi
