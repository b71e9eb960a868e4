#!/usr/bin/env bash
# Runs the five stages of the version 3 performance-debugging exercise (and version 1 once, as the baseline),
# keeps every log, profiles each stage with the profilers this machine has, and prints a comparison table.
# Run with --help for the options.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../../.." && pwd)"
STAGE_SCRIPT="$HERE/run_stage.py"   # version 3's command line with --stage
V1_SCRIPT="$REPO_ROOT/version1_pytorch_baseline/tiny_llama_v1.py"
PROFILERS="$REPO_ROOT/profilers"
PY="${PYTHON:-python3}"   # the interpreter for every run; the profiler wrappers read the same variable
SCRIPT_NAME="$(basename "$0")"

# Used when no training flags follow `--`. On a GPU: big enough that the GPU, not Python, is the bottleneck,
# which is when stages 2-4 show (on the default tiny model every stage waits on Python's kernel launches).
# On the CPU, Triton's interpreter runs the kernels: a model small enough to finish in a minute or two.
GPU_DEFAULT_FLAGS=(--preset medium --use-amp --num-steps 40)
CPU_DEFAULT_FLAGS=(--device cpu --vocab-size 64 --hidden-dim 32 --num-layers 2 --num-heads 2
    --intermediate-size 64 --max-seq-len 16 --batch-size 2 --seq-len 16 --num-steps 8)

usage() {
    cat <<EOF
Usage: $SCRIPT_NAME [OPTIONS] [-- TRAINING FLAGS]

For each stage N of --stages, runs
  \${PYTHON:-python3} run_stage.py --stage N TRAINING FLAGS --output-json ...
and keeps its log; runs version 1 once with the same flags (the "vs v1" column); then profiles each stage
with a short run (--profile-num-steps steps) under every profiler available here:
  PyTorch profiler   always (--enable-pytorch-profiler --profile-operators)
  rocprofv3          on AMD GPUs, when rocprofv3 is on PATH   (profilers/run_rocprofv3.sh)
  nsys, ncu          on NVIDIA GPUs, when on PATH             (profilers/run_nsys.sh, run_ncu.sh)
and prints the comparison table: loss, samples/s, speed vs v1, peak memory, key issue (also written to
summary.md in the results directory).

TRAINING FLAGS are version 3's flags (tiny_llama_v3.py's, shared with version 1). Without any, the defaults are
  on a GPU: ${GPU_DEFAULT_FLAGS[*]}
  on a CPU: ${CPU_DEFAULT_FLAGS[*]}
Flags given after -- replace these defaults entirely.

Options:
  -o, --output-dir DIR     parent of the timestamped results directory (default: $HERE/runs)
  --stages LIST            comma-separated stages to run (default: 1,2,3,4,5)
  --skip-baseline          do not run version 1 (the "vs v1" column shows n/a)
  --no-profile             only the measured runs, no profiling runs
  --profile-num-steps N    steps of each profiling run (default: 12 on a GPU, 5 on the CPU)
  -h, --help               this help

Writes into DIR/<YYYYmmdd_HHMMSS>/:
  stageN_output.log, stageN_metrics.json     each stage's measured run
  v1_baseline_output.log, v1_baseline_metrics.json
  stageN_<tool>.log, stageN_<tool>/          each profiling run and its reports
  summary.md                                 the comparison table and the profiling status

Exit codes: 0 every measured run finished, 1 a measured run failed (its row says so), 2 usage error.
A profiler that is missing is reported as skipped; one that fails is reported, but does not fail the script.

Examples:
  bash $SCRIPT_NAME
  bash $SCRIPT_NAME -- --preset small --use-amp --num-steps 30
  bash $SCRIPT_NAME --stages 2,5 --no-profile -- --batch-size 16 --seq-len 256 --num-steps 20
EOF
}

die_usage() {
    printf '%s: %s (see --help)\n' "$SCRIPT_NAME" "$1" >&2
    exit 2
}

need_value() {
    if [[ $# -lt 2 || -z "$2" || "$2" == --* ]]; then
        die_usage "option $1 needs a value"
    fi
}

have() { command -v "$1" >/dev/null 2>&1; }

# ------------------------------------------------------------------------------------------------ options
RESULTS_ROOT="$HERE/runs"
STAGE_LIST="1,2,3,4,5"
BASELINE=1
PROFILE=1
PROFILE_NUM_STEPS=""   # 12 on a GPU, 5 on the CPU (Triton's interpreter is slow), unless given
TRAIN_ARGS=()
FLAGS_GIVEN=0
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        -o | --output-dir) need_value "$@"; RESULTS_ROOT="$2"; shift 2 ;;
        --stages) need_value "$@"; STAGE_LIST="$2"; shift 2 ;;
        --skip-baseline) BASELINE=0; shift ;;
        --no-profile) PROFILE=0; shift ;;
        --profile-num-steps) need_value "$@"; PROFILE_NUM_STEPS="$2"; shift 2 ;;
        --) shift; TRAIN_ARGS=("$@"); FLAGS_GIVEN=1; break ;;
        *) die_usage "unknown option '$1'" ;;
    esac
done
if [[ ! "$STAGE_LIST" =~ ^[1-5](,[1-5])*$ ]]; then
    die_usage "--stages takes stage numbers 1-5 separated by commas, got '$STAGE_LIST'"
fi
if [[ -n "$PROFILE_NUM_STEPS" && ! "$PROFILE_NUM_STEPS" =~ ^[1-9][0-9]*$ ]]; then
    die_usage "--profile-num-steps needs a positive number, got '$PROFILE_NUM_STEPS'"
fi
IFS=, read -r -a STAGES <<<"$STAGE_LIST"
have "$PY" || die_usage "python interpreter '$PY' not found (set PYTHON=...)"

# ------------------------------------------------------------------------------------------------ set-up
# Which GPU, if any: decides the default flags and which vendor profilers make sense.
VENDOR="$("$PY" -c 'import torch
if not torch.cuda.is_available():
    print("cpu")
else:
    print("amd" if torch.version.hip else "nvidia")')"

if [[ -z "$PROFILE_NUM_STEPS" ]]; then
    if [[ "$VENDOR" == cpu ]]; then PROFILE_NUM_STEPS=5; else PROFILE_NUM_STEPS=12; fi
fi
if [[ "$FLAGS_GIVEN" == 0 ]]; then
    if [[ "$VENDOR" == cpu ]]; then
        TRAIN_ARGS=("${CPU_DEFAULT_FLAGS[@]}")
    else
        TRAIN_ARGS=("${GPU_DEFAULT_FLAGS[@]}")
    fi
fi

mkdir -p "$RESULTS_ROOT"
stamp="$(date +%Y%m%d_%H%M%S)"
OUT="$RESULTS_ROOT/$stamp"
n=1
while [[ -e "$OUT" ]]; do
    n=$((n + 1))
    OUT="$RESULTS_ROOT/${stamp}_$n"
done
mkdir "$OUT"
OUT="$(cd "$OUT" && pwd)"

{
    echo "command : $0 $*"
    echo "device  : $VENDOR"
    echo "flags   : ${TRAIN_ARGS[*]}"
    echo "stages  : ${STAGES[*]}"
} >"$OUT/command.txt"

echo "results : $OUT"
echo "device  : $VENDOR"
echo "flags   : ${TRAIN_ARGS[*]}"

# ------------------------------------------------------------------------------------------------ runs
FAILED_RUNS=0
PROFILE_ROWS=()   # "stageN|tool|status|where"

# run_logged LOG COMMAND...: COMMAND's output on the screen and in LOG; returns COMMAND's exit code.
run_logged() {
    local log="$1" rc=0
    shift
    printf '+ %s\n' "$*" | tee "$log"
    if "$@" 2>&1 | tee -a "$log"; then rc=0; else rc="${PIPESTATUS[0]}"; fi
    return "$rc"
}

# measure NAME SCRIPT [EXTRA FLAGS...]: the measured training run of one stage (or of version 1).
measure() {
    local name="$1" script="$2" rc=0
    shift 2
    echo
    echo "==> $name: measured run (log: ${name}_output.log)"
    run_logged "$OUT/${name}_output.log" "$PY" "$script" "$@" "${TRAIN_ARGS[@]}" \
        --output-json "$OUT/${name}_metrics.json" || rc=$?
    if [[ "$rc" != 0 ]]; then
        echo "    $name FAILED (exit $rc); see $OUT/${name}_output.log" >&2
        FAILED_RUNS=$((FAILED_RUNS + 1))
    fi
}

# profile_with STAGE TOOL COMMAND...: one profiling run; records ok / skipped / no report / failed.
profile_with() {
    local stage="$1" tool="$2" rc=0 status where
    shift 2
    local log="$OUT/stage${stage}_${tool}.log"
    echo "==> stage $stage: $tool (log: stage${stage}_${tool}.log)"
    printf '+ %s\n' "$*" >"$log"
    "$@" >>"$log" 2>&1 || rc=$?
    where="stage${stage}_${tool}/"
    case "$rc" in
        0) status=ok ;;
        3) status=skipped; where="$(tail -n 1 "$log")" ;;      # the wrappers' exit code for "tool missing"
        4) status="no report"; where="see stage${stage}_${tool}.log" ;;
        *) status="failed (exit $rc)"; where="see stage${stage}_${tool}.log" ;;
    esac
    echo "    $status"
    PROFILE_ROWS+=("stage $stage|$tool|$status|$where")
}

skip_profile() { # STAGE TOOL REASON
    PROFILE_ROWS+=("stage $1|$2|skipped|$3")
}

profile_stage() {
    local stage="$1"
    local flags=(--stage "$stage" "${TRAIN_ARGS[@]}" --num-steps "$PROFILE_NUM_STEPS")
    profile_with "$stage" pytorch_profile "$PY" "$STAGE_SCRIPT" "${flags[@]}" \
        --enable-pytorch-profiler --profile-operators --profile-dir "$OUT/stage${stage}_pytorch_profile"

    if [[ "$VENDOR" != amd ]]; then
        skip_profile "$stage" rocprofv3 "needs an AMD GPU"
    elif ! have rocprofv3; then
        skip_profile "$stage" rocprofv3 "rocprofv3 not on PATH (ROCm's rocprofiler-sdk)"
    else
        profile_with "$stage" rocprofv3 bash "$PROFILERS/run_rocprofv3.sh" --script "$STAGE_SCRIPT" \
            --output-dir "$OUT/stage${stage}_rocprofv3" --name "stage$stage" -- "${flags[@]}"
    fi

    local tool
    for tool in nsys ncu; do
        if [[ "$VENDOR" != nvidia ]]; then
            skip_profile "$stage" "$tool" "needs an NVIDIA GPU"
        elif ! have "$tool"; then
            skip_profile "$stage" "$tool" "$tool not on PATH (Nsight, part of the CUDA toolkit)"
        else
            profile_with "$stage" "$tool" bash "$PROFILERS/run_$tool.sh" --script "$STAGE_SCRIPT" \
                --output-dir "$OUT/stage${stage}_$tool" --name "stage$stage" -- "${flags[@]}"
        fi
    done
}

if [[ "$BASELINE" == 1 ]]; then
    measure v1_baseline "$V1_SCRIPT"
fi
for stage in "${STAGES[@]}"; do
    measure "stage$stage" "$STAGE_SCRIPT" --stage "$stage"
done
if [[ "$PROFILE" == 1 ]]; then
    echo
    for stage in "${STAGES[@]}"; do
        profile_stage "$stage"
    done
fi

# ------------------------------------------------------------------------------------------------ summary
"$PY" - "$OUT" "${STAGES[@]}" <<'PYEOF' | tee "$OUT/summary.md"
import json
import sys
from pathlib import Path

out, stages = Path(sys.argv[1]), [int(s) for s in sys.argv[2:]]


def load(name):
    path = out / f"{name}_metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def rate(metrics):
    return (metrics or {}).get("throughput", {}).get("samples_per_s")


baseline = load("v1_baseline")
base_rate = rate(baseline)
print(f"## Performance-debugging stages, measured on: {out.name}")
print()
first = baseline or next((m for m in map(load, (f"stage{s}" for s in stages)) if m), None)
if first:
    device = first["device"]
    flags = next((line.split(":", 1)[1].strip() for line in (out / "command.txt").read_text().splitlines()
                  if line.startswith("flags")), "")
    print(f"Device: {device.get('name')} ({device.get('backend')}), torch {device.get('torch_version')}; "
          f"precision {first.get('precision')}; training flags: `{flags}`")
    optimum = first["loss"].get("optimum")
    if optimum is not None:
        print(f"Optimum loss of the data: {optimum:.3f} nats")
    print()
print("| Stage | Loss (first -> final) | Samples/s | vs v1 | Peak memory | Key issue |")
print("|-------|-----------------------|-----------|-------|-------------|-----------|")
baseline_ran = (out / "v1_baseline_output.log").exists()
rows = [("v1 baseline", baseline, "reference: version 1, PyTorch eager")] if baseline_ran else []
for stage in stages:
    metrics = load(f"stage{stage}")
    issue = (metrics or {}).get("variant", {}).get("defect", "none (version 3 as it is)")
    rows.append((f"{stage}", metrics, issue))
host_timer = None
for label, metrics, issue in rows:
    if metrics is None:
        print(f"| {label} | run failed, see its log | | | | {issue} |")
        continue
    loss = metrics["loss"]
    samples = rate(metrics)
    speed = f"{samples / base_rate:.2f}x" if samples and base_rate else "n/a"
    memory = metrics["memory"]["peak_allocated_mib"]
    memory = f"{memory:,.0f} MiB" if memory is not None else "n/a (CPU)"
    samples = f"{samples:,.1f}" if samples else "n/a"
    print(f"| {label} | {loss['first']:.3f} -> {loss['final']:.3f} | {samples} | {speed} | {memory} | {issue} |")
    timer = metrics.get("variant", {}).get("host_clock_timer")
    if timer:
        host_timer = (label, timer, metrics["timing"]["median_ms"])
print()
print("Samples/s: median step time measured with device events (host clock on the CPU), warm-up excluded.")
if host_timer:
    label, timer, event_ms = host_timer
    claimed = timer.get("samples_per_s")
    claimed = f"{claimed:,.1f} samples/s" if claimed else "n/a"
    print(f"Stage {label}'s own timer (host clock, no synchronisation) claimed {timer['median_ms']:.2f} ms/step "
          f"({claimed}); the harness timed the same steps at {event_ms:.2f} ms/step "
          f"(ratio {event_ms / timer['median_ms']:.1f}).")
PYEOF

if ((${#PROFILE_ROWS[@]})); then
    {
        echo
        echo "| Profile | Tool | Status | Output |"
        echo "|---------|------|--------|--------|"
        for row in "${PROFILE_ROWS[@]}"; do
            IFS='|' read -r p_stage p_tool p_status p_where <<<"$row"
            echo "| $p_stage | $p_tool | $p_status | $p_where |"
        done
    } | tee -a "$OUT/summary.md"
fi

echo
echo "results: $OUT (summary.md, stage*_output.log, stage*_metrics.json, profiles)"
if ((FAILED_RUNS > 0)); then
    echo "$FAILED_RUNS measured run(s) failed; see the logs above" >&2
    exit 1
fi
