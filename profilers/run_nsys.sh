#!/usr/bin/env bash
# Timeline of one training run with NVIDIA Nsight Systems (nsys), then its GPU-kernel summary.
# Run with --help for the options.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME --script TRAINING_SCRIPT [OPTIONS] [-- TRAINING FLAGS]

Records a CUDA + NVTX + OS-runtime timeline, then summarises the GPU kernels:
  nsys profile --trace=cuda,nvtx,osrt --force-overwrite true -o OUTDIR/NAME \\
       \${PYTHON:-python3} TRAINING_SCRIPT TRAINING FLAGS
  nsys stats --report cuda_gpu_kern_sum --force-export=true OUTDIR/NAME.nsys-rep
(Nsight Systems before 2023.1 called the report gpukernsum; it is tried when the first fails.)

Needs: nsys on PATH (Nsight Systems, part of the CUDA toolkit) and an NVIDIA GPU.

Options:
  --script PATH      training script to profile (the version wrappers set it)
  --output-dir DIR   where to write (default: ./profile_runs/<timestamp>/nsys)
  --name NAME        report name (default: the script name, e.g. tiny_llama_v2)
  -h, --help         this help

Writes into OUTDIR: NAME.nsys-rep (open it in the Nsight Systems GUI), NAME.sqlite,
cuda_gpu_kern_sum.txt (the kernel table printed at the end).

Exit codes: 0 ok, 1 the run failed, 2 usage error, 3 nsys not installed,
            4 nsys ran but produced no report (one line says so).

Examples:
  bash version2_pytorch_fused/run_nsys.sh -- --batch-size 8 --seq-len 128 --num-steps 30
  bash $SCRIPT_NAME --script version3_triton/tiny_llama_v3.py --output-dir /tmp/nsys_v3 -- --num-steps 10
EOF
}

NAME=""
while (($#)); do
    case "$1" in
        --name) need_value "$@"; NAME="$2"; shift 2 ;;
        *) parse_common_option "$@" || die_usage "unknown option '$1'"; shift "$CONSUMED" ;;
    esac
done

require_tool nsys
resolve_script
NAME="${NAME:-$(script_stem)}"
prepare_output_dir nsys
training_command

rc=0
# The model's named ranges (attention, ffn, rmsnorm, ...) become NVTX/roctx ranges on the timeline.
export TT_NVTX=1
run_cmd nsys profile --trace=cuda,nvtx,osrt --force-overwrite true -o "$OUTPUT_DIR/$NAME" \
    "${TRAIN_CMD[@]}" || rc=$?
[[ "$rc" == 0 ]] || warn "nsys profile exited with $rc"

# Nsight Systems before 2021.4 wrote .qdrep instead of .nsys-rep.
report=""
for candidate in "$OUTPUT_DIR/$NAME.nsys-rep" "$OUTPUT_DIR/$NAME.qdrep"; do
    if [[ -f "$candidate" ]]; then
        report="$candidate"
        break
    fi
done
if [[ -z "$report" ]]; then
    echo "nsys produced no report ($OUTPUT_DIR/$NAME.nsys-rep is missing; see the nsys messages above)" >&2
    exit "$EXIT_NO_REPORT"
fi

summary="$OUTPUT_DIR/cuda_gpu_kern_sum.txt"
if ! run_cmd nsys stats --report cuda_gpu_kern_sum --force-export=true "$report" >"$summary" 2>&1; then
    run_cmd nsys stats --report gpukernsum --force-export=true "$report" >"$summary" 2>&1 ||
        warn "nsys stats failed; open $report in the Nsight Systems GUI instead"
fi
cat "$summary"
info "report: $report"
info "kernel summary: $summary"
if [[ "$rc" != 0 ]]; then
    exit "$EXIT_FAILED"
fi
