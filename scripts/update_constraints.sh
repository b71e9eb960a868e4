#!/usr/bin/env bash
# Move constraints.txt to the newest releases that requirements.txt allows, on purpose, and prove them.
#
# usage: bash scripts/update_constraints.sh [PYTHON]      (PYTHON: the interpreter to build the environment
#                                                         with; default python3)
# 1. a fresh virtual environment in a temporary directory; torch's CPU build first, as README's set-up does,
#    but its newest release (installing the pinned one would hold torch back);
# 2. requirements.txt WITHOUT the old constraints: the newest versions within its ranges;
# 3. the whole test suite (README's test command); only if it passes is constraints.txt rewritten.
# Commit the new constraints.txt with the suite's summary line in the message.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${1:-python3}"
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

"$python_bin" -m venv "$workdir/venv"
# shellcheck disable=SC1091
source "$workdir/venv/bin/activate"
python -m pip install -q --upgrade pip
bash .ci/install_torch_cpu.sh newest
python -m pip install -q -r requirements.txt -r requirements-peers.txt
python -m pip freeze --exclude-editable | sed -e 's/+cpu$//' | LC_ALL=C sort -f > "$workdir/frozen.txt"

python -m pytest -q
{
    sed -n '/^#/p' constraints.txt
    cat "$workdir/frozen.txt"
} > "$workdir/constraints.txt"
mv "$workdir/constraints.txt" constraints.txt
echo "constraints.txt updated: $(grep -vc '^#' constraints.txt) pinned packages; commit it with the suite's result"
