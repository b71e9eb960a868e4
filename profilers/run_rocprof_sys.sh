#!/usr/bin/env bash
# Host + device timeline of one training run with ROCm Systems Profiler (rocprof-sys-run), for
# viewing in Perfetto. Run with --help for the options.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME --script TRAINING_SCRIPT [OPTIONS] [-- TRAINING FLAGS]

Runs the training script under ROCm Systems Profiler with a call-stack profile and a trace:
  ROCPROFSYS_OUTPUT_PATH=OUTDIR ROCPROFSYS_TIME_OUTPUT=OFF \\
  rocprof-sys-run --profile --trace -o OUTDIR -- \${PYTHON:-python3} TRAINING_SCRIPT TRAINING FLAGS
and tells you where the Perfetto trace (.proto) landed.

Needs: rocprof-sys-run on PATH (rocprofiler-systems, usually /opt/rocm/bin) and an AMD GPU.

Options:
  --script PATH      training script to profile (the version wrappers set it)
  --output-dir DIR   where to write (default: ./profile_runs/<timestamp>/rocprof-sys)
  -h, --help         this help

Writes into OUTDIR: perfetto-trace*.proto (open it at https://ui.perfetto.dev), wall-clock
profiles (*.txt, *.json) and, with newer releases, a rocpd database (*.db).

Exit codes: 0 ok, 1 the run failed, 2 usage error, 3 rocprof-sys-run not installed,
            4 it ran but wrote no trace.

Examples:
  bash version2_pytorch_fused/run_rocprof_sys.sh -- --batch-size 8 --seq-len 128 --num-steps 30
  bash $SCRIPT_NAME --script version1_pytorch_baseline/tiny_llama_v1.py -- --num-steps 10
EOF
}

while (($#)); do
    parse_common_option "$@" || die_usage "unknown option '$1'"
    shift "$CONSUMED"
done

require_tool rocprof-sys-run
resolve_script
prepare_output_dir rocprof-sys
training_command

# -o sets ROCPROFSYS_OUTPUT_PATH; the variable is also set for releases whose launcher reads only
# the environment. TIME_OUTPUT=OFF: OUTDIR is already timestamped, no need for a second level.
rc=0
# The model's named ranges (attention, ffn, rmsnorm, ...) become NVTX/roctx ranges on the timeline.
export TT_NVTX=1
run_cmd env ROCPROFSYS_OUTPUT_PATH="$OUTPUT_DIR" ROCPROFSYS_TIME_OUTPUT=OFF \
    rocprof-sys-run --profile --trace -o "$OUTPUT_DIR" -- "${TRAIN_CMD[@]}" || rc=$?
[[ "$rc" == 0 ]] || warn "rocprof-sys-run exited with $rc"

trace="$(find "$OUTPUT_DIR" -type f -name '*.proto' | sort | head -n 1)"
database="$(find "$OUTPUT_DIR" -type f -name '*.db' | sort | head -n 1)"
if [[ -z "$trace" && -z "$database" ]]; then
    echo "rocprof-sys-run wrote no trace (.proto or .db) under $OUTPUT_DIR" >&2
    exit "$EXIT_NO_REPORT"
fi
if [[ -n "$trace" ]]; then
    info "Perfetto trace: $trace"
    info "open it at https://ui.perfetto.dev (copy it to your laptop first when working remotely)"
fi
if [[ -n "$database" ]]; then
    info "rocpd database: $database (ROCm Optiq reads it; 'rocpd convert' turns it into CSV or Perfetto)"
fi
info "all outputs in $OUTPUT_DIR"
if [[ "$rc" != 0 ]]; then
    exit "$EXIT_FAILED"
fi
