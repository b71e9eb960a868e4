#!/usr/bin/env bash
# Kernel trace + per-kernel statistics of one training run with rocprofv3 (ROCm), then a table of
# the kernels that took the most GPU time. Run with --help for the options.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME --script TRAINING_SCRIPT [OPTIONS] [-- TRAINING FLAGS]

Runs the training script under rocprofv3 with a kernel trace and per-kernel statistics:
  rocprofv3 --kernel-trace --stats --truncate-kernels -d OUTDIR -o NAME --output-format csv \\
            [--kernel-include-regex REGEX] -- \${PYTHON:-python3} TRAINING_SCRIPT TRAINING FLAGS
then prints the top kernels by total GPU time from NAME_kernel_stats.csv.

Needs: rocprofv3 on PATH (ROCm's rocprofiler-sdk, usually /opt/rocm/bin) and an AMD GPU.

Options:
  --script PATH         training script to profile (the version wrappers set it)
  --output-dir DIR      where to write (default: ./profile_runs/<timestamp>/rocprofv3)
  --name NAME           prefix of the output files (default: the script name, e.g. tiny_llama_v2)
  --top N               rows of the top-kernels table (default: 15)
  --kernel-regex REGEX  trace only kernels whose name matches REGEX (--kernel-include-regex)
  --triton-only         trace only the Triton kernels: the @triton.jit functions found in the
                        .py files beside the training script
  -h, --help            this help

Writes into OUTDIR: NAME_kernel_stats.csv, NAME_kernel_trace.csv (and the other rocprofv3
CSVs), top_kernels.txt (the table printed at the end).

Exit codes: 0 ok, 1 the run failed, 2 usage error, 3 rocprofv3 not installed,
            4 rocprofv3 ran but wrote no kernel statistics.

Examples:
  bash version2_pytorch_fused/run_rocprofv3.sh -- --batch-size 8 --seq-len 128 --num-steps 30
  bash $SCRIPT_NAME --script version3_triton/tiny_llama_v3.py --triton-only -- --num-steps 10
EOF
}

NAME=""
TOP_N=15
KERNEL_REGEX=""
TRITON_ONLY=0
while (($#)); do
    case "$1" in
        --name) need_value "$@"; NAME="$2"; shift 2 ;;
        --top) need_value "$@"; TOP_N="$2"; shift 2 ;;
        --kernel-regex) need_value "$@"; KERNEL_REGEX="$2"; shift 2 ;;
        --triton-only) TRITON_ONLY=1; shift ;;
        *) parse_common_option "$@" || die_usage "unknown option '$1'"; shift "$CONSUMED" ;;
    esac
done
[[ "$TOP_N" =~ ^[0-9]+$ ]] || die_usage "--top needs a whole number, got '$TOP_N'"

require_tool rocprofv3
resolve_script
if [[ "$TRITON_ONLY" == 1 ]]; then
    KERNEL_REGEX="$(triton_kernel_regex "$(dirname "$SCRIPT")")"
    [[ -n "$KERNEL_REGEX" ]] || die_usage "--triton-only: no @triton.jit kernels beside $SCRIPT"
    NAME="${NAME:-$(script_stem)_triton}"
fi
NAME="${NAME:-$(script_stem)}"
prepare_output_dir rocprofv3
training_command

filter=()
if [[ -n "$KERNEL_REGEX" ]]; then
    filter=(--kernel-include-regex "$KERNEL_REGEX")
fi

rc=0
run_cmd rocprofv3 --kernel-trace --stats --truncate-kernels \
    -d "$OUTPUT_DIR" -o "$NAME" --output-format csv "${filter[@]}" \
    -- "${TRAIN_CMD[@]}" || rc=$?
[[ "$rc" == 0 ]] || warn "rocprofv3 exited with $rc"

# rocprofv3 names the file NAME_kernel_stats.csv; older releases put it under <host>/<pid>/, and a
# run with several GPU processes writes one per process: take the largest.
stats_csv="$(find "$OUTPUT_DIR" -type f -name '*kernel_stats.csv' -printf '%s %p\n' |
    sort -nr | head -n 1 | cut -d' ' -f2-)"
if [[ -z "$stats_csv" ]]; then
    echo "rocprofv3 wrote no *kernel_stats.csv under $OUTPUT_DIR (did the run launch any GPU kernel?)" >&2
    exit "$EXIT_NO_REPORT"
fi

# The column names of the statistics CSV changed between ROCm releases (Name / KERNEL_NAME,
# TotalDurationNs / Total_Duration_ns, ...): match them ignoring case and punctuation.
"$PY" - "$stats_csv" "$TOP_N" <<'PYEOF' | tee "$OUTPUT_DIR/top_kernels.txt"
import csv
import re
import sys

path, top_n = sys.argv[1], int(sys.argv[2])


def squash(text):
    return re.sub(r"[^a-z0-9]", "", text.lower())


def find_column(header, *candidates):
    by_key = {squash(h): h for h in header}
    for candidate in candidates:
        if squash(candidate) in by_key:
            return by_key[squash(candidate)]
    return None


def number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return 0.0


with open(path, newline="") as f:
    reader = csv.DictReader(f)
    header = reader.fieldnames or []
    rows = list(reader)

name_col = find_column(header, "Name", "KernelName", "Kernel", "KernelNames")
total_col = find_column(header, "TotalDurationNs", "TotalDuration", "TotalNs", "DurationNs", "TotalTimeNs")
calls_col = find_column(header, "Calls", "Count", "NumCalls", "Invocations", "Dispatches")
avg_col = find_column(header, "AverageNs", "AvgNs", "Average", "AverageDurationNs", "MeanNs")
if name_col is None or total_col is None:
    sys.exit(f"cannot find kernel-name and total-duration columns in {path}; columns: {header}")

kernels = []
for row in rows:
    total = number(row[total_col])
    calls = number(row[calls_col]) if calls_col else 0.0
    if avg_col:
        average = number(row[avg_col])
    else:
        average = total / calls if calls else 0.0
    kernels.append((total, calls, average, row[name_col]))
kernels.sort(reverse=True)
grand_total = sum(k[0] for k in kernels) or 1.0

print(f"Top {min(top_n, len(kernels))} of {len(kernels)} GPU kernels by total time ({path})")
print(f"{'#':>3} {'total ms':>10} {'% time':>7} {'calls':>7} {'avg us':>9}  kernel")
for rank, (total, calls, average, name) in enumerate(kernels[:top_n], start=1):
    short = name if len(name) <= 90 else name[:87] + "..."
    print(f"{rank:>3} {total / 1e6:>10.3f} {100 * total / grand_total:>6.1f}% {calls:>7.0f} "
          f"{average / 1e3:>9.2f}  {short}")
PYEOF

info "outputs in $OUTPUT_DIR (kernel statistics: $stats_csv)"
if [[ "$rc" != 0 ]]; then
    exit "$EXIT_FAILED"
fi
