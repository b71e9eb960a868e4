#!/usr/bin/env bash
# Hardware-counter profile, roofline or analysis of one training run with ROCm Compute Profiler
# (rocprof-compute). Run with --help for the options.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME [profile|roofline|analyze] --script TRAINING_SCRIPT [OPTIONS] [-- TRAINING FLAGS]

Modes (default: profile; also --mode MODE):
  profile   rocprof-compute profile -n NAME --no-roof -- \${PYTHON:-python3} TRAINING_SCRIPT FLAGS
            then rocprof-compute analyze -p WORKLOAD --list-stats   (-> stats.txt)
  roofline  rocprof-compute profile -n NAME --roof-only --kernel-names --device 0 -- ...
            (roofline PDFs: two plots and a legend, inside the workload directory)
  analyze   rocprof-compute analyze -p WORKLOAD --list-stats        (-> stats.txt)
            and, with --dispatch N, rocprof-compute analyze -p WORKLOAD --dispatch N
                                                                     (-> dispatch_N.txt)
rocprof-compute runs inside OUTDIR, so the workload lands in OUTDIR/workloads/NAME/<gpu>/
(e.g. workloads/tiny_llama_v2/MI300A_A1) whatever the ROCm release.

Needs: rocprof-compute on PATH (rocprofiler-compute, usually /opt/rocm/bin), an AMD Instinct GPU,
and rocprof-compute's Python requirements for analyze.

Options:
  --mode MODE        profile, roofline or analyze (or give the mode as the first word)
  --script PATH      training script to profile (the version wrappers set it; not for analyze)
  --output-dir DIR   where to write (default: ./profile_runs/<timestamp>/rocprof-compute)
  --name NAME        workload name (default: the script name, e.g. tiny_llama_v2; roofline: NAME_roof)
  --workload DIR     analyze: the workload directory (default: the newest one under ./profile_runs)
  --dispatch N       analyze: also analyse dispatch N in detail (pick N from stats.txt)
  -h, --help         this help

Exit codes: 0 ok, 1 the run failed, 2 usage error, 3 rocprof-compute not installed,
            4 it ran but no workload directory appeared.

Examples:
  bash version2_pytorch_fused/run_rocprof_compute.sh -- --batch-size 8 --seq-len 128 --num-steps 30
  bash version2_pytorch_fused/run_rocprof_compute.sh roofline -- --num-steps 10
  bash $SCRIPT_NAME analyze --workload profile_runs/<timestamp>/rocprof-compute/workloads/tiny_llama_v2/MI300A_A1 --dispatch 1538
EOF
}

MODE=profile
NAME=""
WORKLOAD=""
DISPATCH=""
while (($#)); do
    case "$1" in
        profile | roofline | analyze) MODE="$1"; shift ;;
        --mode) need_value "$@"; MODE="$2"; shift 2 ;;
        --name) need_value "$@"; NAME="$2"; shift 2 ;;
        --workload) need_value "$@"; WORKLOAD="$2"; shift 2 ;;
        --dispatch) need_value "$@"; DISPATCH="$2"; shift 2 ;;
        *) parse_common_option "$@" || die_usage "unknown option '$1'"; shift "$CONSUMED" ;;
    esac
done
case "$MODE" in
    profile | roofline | analyze) ;;
    *) die_usage "unknown mode '$MODE' (profile, roofline or analyze)" ;;
esac
if [[ -n "$DISPATCH" && ! "$DISPATCH" =~ ^[0-9]+$ ]]; then
    die_usage "--dispatch needs a dispatch number, got '$DISPATCH'"
fi

require_tool rocprof-compute

# The directory holding one profiled GPU: workloads/NAME/<gpu model or rank>/.
find_workload() {
    local base="$1/workloads/$2" found
    found="$(find "$base" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | sort | head -n 1)"
    if [[ -z "$found" && -d "$base" ]]; then
        found="$base"
    fi
    printf '%s' "$found"
}

# The most recently written workload under ./profile_runs, for `analyze` without --workload.
newest_workload() {
    local candidates=()
    shopt -s nullglob
    candidates=(./profile_runs/*/rocprof-compute*/workloads/*/*/)
    shopt -u nullglob
    if ((${#candidates[@]})); then
        # shellcheck disable=SC2012  # names are our own timestamped directories
        ls -td -- "${candidates[@]}" | head -n 1
    fi
}

# analyze WORKLOAD: the kernel/dispatch list, and one dispatch in detail when asked.
analyze() {
    local workload="$1" rc=0
    run_cmd rocprof-compute analyze -p "$workload" --list-stats >"$OUTPUT_DIR/stats.txt" 2>&1 || rc=$?
    cat "$OUTPUT_DIR/stats.txt"
    if [[ -n "$DISPATCH" && "$rc" == 0 ]]; then
        run_cmd rocprof-compute analyze -p "$workload" --dispatch "$DISPATCH" \
            >"$OUTPUT_DIR/dispatch_$DISPATCH.txt" 2>&1 || rc=$?
        cat "$OUTPUT_DIR/dispatch_$DISPATCH.txt"
    fi
    return "$rc"
}

if [[ "$MODE" == analyze ]]; then
    WORKLOAD="${WORKLOAD:-$(newest_workload)}"
    [[ -n "$WORKLOAD" ]] || die_usage "analyze: no --workload given and none found under ./profile_runs"
    [[ -d "$WORKLOAD" ]] || die_usage "analyze: workload directory not found: $WORKLOAD"
    WORKLOAD="$(cd "$WORKLOAD" && pwd)"
    prepare_output_dir rocprof-compute-analyze
    if ! analyze "$WORKLOAD"; then
        echo "rocprof-compute analyze failed on $WORKLOAD (see above)" >&2
        exit "$EXIT_FAILED"
    fi
    info "analysis written to $OUTPUT_DIR"
    exit 0
fi

resolve_script
prepare_output_dir rocprof-compute
training_command
if [[ "$MODE" == roofline ]]; then
    NAME="${NAME:-$(script_stem)_roof}"
    mode_flags=(--roof-only --kernel-names --device 0)
else
    NAME="${NAME:-$(script_stem)}"
    mode_flags=(--no-roof)
fi

# Run inside OUTDIR: every release writes ./workloads/NAME/<gpu>/ relative to where it starts
# (the option that moves it was renamed between releases).
rc=0
(cd "$OUTPUT_DIR" && run_cmd rocprof-compute profile -n "$NAME" "${mode_flags[@]}" -- "${TRAIN_CMD[@]}") || rc=$?
[[ "$rc" == 0 ]] || warn "rocprof-compute profile exited with $rc"

workload="$(find_workload "$OUTPUT_DIR" "$NAME")"
if [[ -z "$workload" ]]; then
    echo "rocprof-compute wrote no workload directory under $OUTPUT_DIR/workloads/$NAME" >&2
    exit "$EXIT_NO_REPORT"
fi
info "workload: $workload"

if [[ "$MODE" == roofline ]]; then
    find "$workload" -maxdepth 2 -type f -name '*.pdf' | sort | sed 's/^/    roofline: /'
elif [[ "$rc" == 0 ]]; then
    # Analysis is a convenience here: its Python requirements may be missing while profiling works.
    analyze "$workload" || warn "rocprof-compute analyze failed; the profile itself is in $workload"
    info "next: bash $SCRIPT_NAME analyze --workload $workload --dispatch N (N from stats.txt)"
fi
info "outputs in $OUTPUT_DIR"
if [[ "$rc" != 0 ]]; then
    exit "$EXIT_FAILED"
fi
