#!/usr/bin/env bash
# Helpers shared by the profiler wrappers in this directory. Source it, do not run it:
#     source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#
# Exit codes of every single-tool wrapper (run_rocprofv3.sh, run_nsys.sh, ...):
#   0  the tool ran and wrote its report
#   1  the profiled training run, or the tool itself, failed
#   2  usage error: unknown option, missing value, training script not found
#   3  the tool is not installed (not on PATH); nothing was run
#   4  the tool ran but wrote no report (no kernels matched, no GPU, no counter permission, ...)
# run_all_profilers.sh turns 3 into a "skipped" row and continues with the next tool.

# The variables set here are read by the scripts that source this file.
# shellcheck disable=SC2034

readonly EXIT_FAILED=1
readonly EXIT_USAGE=2
readonly EXIT_NO_TOOL=3
readonly EXIT_NO_REPORT=4

PROFILERS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The interpreter that runs the training script; `PYTHON=python3.11 bash run_nsys.sh ...` picks another.
PY="${PYTHON:-python3}"
SCRIPT_NAME="$(basename "$0")"

# Filled by parse_common_option; each wrapper reads them after its option loop.
SCRIPT=""
OUTPUT_DIR=""
TRAIN_ARGS=()
CONSUMED=0

# ---------------------------------------------------------------------------------------------
# Messages and tool detection
# ---------------------------------------------------------------------------------------------

have() { command -v "$1" >/dev/null 2>&1; }

info() { printf '[%s] %s\n' "$SCRIPT_NAME" "$*"; }
warn() { printf '[%s] warning: %s\n' "$SCRIPT_NAME" "$*" >&2; }

# One line on stderr, then exit 2: what a user sees after a typo.
die_usage() {
    printf '%s: %s (see --help)\n' "$SCRIPT_NAME" "$1" >&2
    exit "$EXIT_USAGE"
}

# Where each tool comes from: used by the single-tool scripts and by the orchestrator's skip rows.
install_hint() {
    case "$1" in
        rocprofv3) echo "install ROCm's rocprofiler-sdk (or add /opt/rocm/bin to PATH)" ;;
        rocprof-sys-run) echo "install ROCm Systems Profiler, rocprofiler-systems (or add /opt/rocm/bin to PATH)" ;;
        rocprof-compute) echo "install ROCm Compute Profiler, rocprofiler-compute (or add /opt/rocm/bin to PATH)" ;;
        nsys) echo "install NVIDIA Nsight Systems (CUDA toolkit or the nsight-systems package)" ;;
        ncu) echo "install NVIDIA Nsight Compute (CUDA toolkit or the nsight-compute package)" ;;
        *) echo "install it and put it on PATH" ;;
    esac
}

missing_tool_message() { printf '%s not found on PATH: %s; skipping' "$1" "$(install_hint "$1")"; }

# Exit 3 with one clear line when TOOL is not installed.
require_tool() {
    if ! have "$1"; then
        printf '%s\n' "$(missing_tool_message "$1")" >&2
        exit "$EXIT_NO_TOOL"
    fi
}

# Print a command the way a user could paste it back into a shell (single quotes only where
# needed), then run it.
show_cmd() {
    local arg quoted line="+"
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            line+=" $arg"
        else
            quoted="${arg//\'/\'\\\'\'}"
            line+=" '$quoted'"
        fi
    done
    printf '%s\n' "$line"
}
run_cmd() {
    show_cmd "$@"
    "$@"
}

# ---------------------------------------------------------------------------------------------
# Option parsing shared by every wrapper
# ---------------------------------------------------------------------------------------------

# need_value "$@": the option in $1 needs a value in $2.
need_value() {
    if [[ $# -lt 2 || -z "$2" || "$2" == --* ]]; then
        die_usage "option $1 needs a value"
    fi
}

# Handles the options all wrappers share; a wrapper calls it for anything it does not know:
#     *) parse_common_option "$@" || die_usage "unknown option '$1'"; shift "$CONSUMED" ;;
# Returns 1 for an option it does not know either. Everything after `--` goes to the training script.
parse_common_option() {
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --script)
            need_value "$@"
            SCRIPT="$2"
            CONSUMED=2
            ;;
        --output-dir)
            need_value "$@"
            OUTPUT_DIR="$2"
            CONSUMED=2
            ;;
        --)
            shift
            TRAIN_ARGS=("$@")
            CONSUMED=$(($# + 1))
            ;;
        *) return 1 ;;
    esac
}

# Check --script and make it absolute, so it still resolves after a wrapper changes directory.
resolve_script() {
    [[ -n "$SCRIPT" ]] || die_usage "missing --script PATH (the training script to profile)"
    [[ -f "$SCRIPT" ]] || die_usage "training script not found: $SCRIPT"
    SCRIPT="$(cd "$(dirname "$SCRIPT")" && pwd)/$(basename "$SCRIPT")"
}

# tiny_llama_v2.py -> tiny_llama_v2: the default name of report files.
script_stem() {
    local base
    base="$(basename "$SCRIPT")"
    printf '%s' "${base%.py}"
}

# The command every tool wraps: the interpreter, the training script and the user's flags.
training_command() {
    TRAIN_CMD=("$PY" "$SCRIPT" "${TRAIN_ARGS[@]}")
}

# ---------------------------------------------------------------------------------------------
# Output directories
# ---------------------------------------------------------------------------------------------

# A directory the script will write into, proven before any profiler runs: created if missing, and a
# probe file created and removed in it. A file in its place, a read-only mount or a name the file
# system refuses is one line and exit 2, instead of a failure after the first (long) profiler step.
ensure_writable_dir() {
    local dir="$1" what="$2" probe
    if [[ -e "$dir" && ! -d "$dir" ]]; then
        die_usage "$what $dir is a file, not a directory"
    fi
    if ! mkdir -p "$dir" 2>/dev/null; then
        die_usage "$what $dir: cannot create the directory"
    fi
    probe="$dir/.write-probe-$$"
    if ! { : >"$probe"; } 2>/dev/null; then
        die_usage "$what $dir: cannot write there"
    fi
    rm -f "$probe"
}

# Create ROOT/<YYYYmmdd_HHMMSS> (plus _2, _3, ... when two runs start in the same second)
# and print its absolute path.
new_timestamped_dir() {
    local root="$1" stamp dir n=1
    stamp="$(date +%Y%m%d_%H%M%S)"
    ensure_writable_dir "$root" "the runs directory"
    dir="$root/$stamp"
    while [[ -e "$dir" ]]; do
        n=$((n + 1))
        dir="$root/${stamp}_$n"
    done
    mkdir "$dir"
    (cd "$dir" && pwd)
}

# Set OUTPUT_DIR to an absolute, existing directory: --output-dir when given, else
# ./profile_runs/<timestamp>/SUBDIR, the same layout run_all_profilers.sh produces.
prepare_output_dir() {
    local subdir="$1"
    if [[ -z "$OUTPUT_DIR" ]]; then
        OUTPUT_DIR="$(new_timestamped_dir "./profile_runs")/$subdir"
    fi
    ensure_writable_dir "$OUTPUT_DIR" "--output-dir"
    OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"
}

# Seconds since the epoch with sub-second digits, for step timing.
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------------------------------------
# Kernel-name patterns
# ---------------------------------------------------------------------------------------------

# Triton names a GPU kernel after its Python function, so the kernels of a version are the
# functions decorated with @triton.jit in the files beside its training script. Prints them
# as one regular expression, "a_kernel|b_kernel", or nothing when there are none.
triton_kernel_regex() {
    "$PY" - "$1" <<'PYEOF'
import pathlib
import re
import sys

names = set()
for path in pathlib.Path(sys.argv[1]).rglob("*.py"):
    text = path.read_text(errors="ignore")
    # The first `def` after each @triton.jit (other decorators may sit in between).
    names.update(re.findall(r"@triton\.jit\b.*?^\s*def\s+(\w+)", text, flags=re.S | re.M))
print("|".join(sorted(names)))
PYEOF
}

# ---------------------------------------------------------------------------------------------
# Steps and the summary table (used by run_all_profilers.sh)
# ---------------------------------------------------------------------------------------------

STEP_NAMES=()
STEP_STATUS=()
STEP_SECONDS=()
STEP_OUTPUT=()

record_step() { # NAME STATUS SECONDS OUTPUT-OR-REASON
    STEP_NAMES+=("$1")
    STEP_STATUS+=("$2")
    STEP_SECONDS+=("$3")
    STEP_OUTPUT+=("$4")
}

skip_step() { # NAME REASON
    printf '==> %-16s skipped: %s\n' "$1" "$2"
    record_step "$1" skipped "-" "$2"
}

# run_step NAME OUTPUT LOG -- COMMAND...
# Runs COMMAND with its stdout and stderr in LOG (also on the screen when VERBOSE=1), times it
# and records ok / failed / skipped. Exit code 3 (tool missing) counts as skipped.
run_step() {
    local name="$1" output="$2" log="$3" rc=0 t0 t1 seconds
    shift 4
    printf '==> %-16s running (log: %s)\n' "$name" "$log"
    show_cmd "$@" >"$log"
    t0="$(now)"
    if [[ "${VERBOSE:-0}" == 1 ]]; then
        if "$@" 2>&1 | tee -a "$log"; then rc=0; else rc="${PIPESTATUS[0]}"; fi
    else
        "$@" >>"$log" 2>&1 || rc=$?
    fi
    t1="$(now)"
    seconds="$(elapsed "$t0" "$t1")"
    if [[ "$rc" == 0 ]]; then
        printf '    %-16s ok (%ss)\n' "$name" "$seconds"
        record_step "$name" ok "$seconds" "$output"
    elif [[ "$rc" == "$EXIT_NO_TOOL" ]]; then
        skip_step "$name" "$(tail -n 1 "$log")"
    else
        printf '    %-16s FAILED (exit %s after %ss); last lines of %s:\n' "$name" "$rc" "$seconds" "$log" >&2
        tail -n 15 "$log" | sed 's/^/      /' >&2
        record_step "$name" failed "$seconds" "exit $rc, see $log"
    fi
}

# Print the table of all recorded steps: step | status | seconds | output (or why it was skipped).
print_summary() {
    local i
    printf '\n%-17s| %-8s| %8s | %s\n' "step" "status" "seconds" "output"
    printf '%s\n' "-----------------+---------+----------+---------------------------------------------"
    for i in "${!STEP_NAMES[@]}"; do
        printf '%-17s| %-8s| %8s | %s\n' "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" \
            "${STEP_SECONDS[$i]}" "${STEP_OUTPUT[$i]}"
    done
}

# True when any recorded step failed.
any_step_failed() {
    local status
    for status in "${STEP_STATUS[@]}"; do
        [[ "$status" == failed ]] && return 0
    done
    return 1
}
