#!/usr/bin/env bash
# kdrun on the Python stack of a typical GPU machine, tried on a CPU first:
# Python 3.12, torch 2.11, transformers 5.17, huggingface_hub 1.33, accelerate 1.15.
#
#     bash scripts/checks/stack.sh [VENV]       (default /tmp/kdrun-stack; run by hand, not by CI)
#     PYTHON=/path/to/python3.12 bash scripts/checks/stack.sh     (where python3.12 is not on PATH)
#
# Makes the virtual environment, installs that stack and kdrun (editable, with the dev extra), then
# runs kdrun-doctor --device-check --fast and the fast test loop (pytest -m "not slow") there, and
# prints both results. torch 2.11's CPU build comes from the PyTorch index when it is reachable; from
# PyPI torch 2.11 is the CUDA build, several GB with its nvidia-* packages (it runs on a CPU too).
case "${1:-}" in -h|--help) sed -n "2,/^[^#]/{/^#/s/^# \{0,1\}//p}" "$0"; exit 0 ;; esac
set -uo pipefail

VENV=${1:-/tmp/kdrun-stack}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3.12}
STACK=(transformers==5.17.0 huggingface_hub==1.33.0 accelerate==1.15.0)

"$PY" -m venv "$VENV" || { echo "check_stack.sh: $PY could not make a virtual environment at $VENV" >&2; exit 1; }
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu 2>/dev/null ||
  "${PIP[@]}" torch==2.11.0 || { echo "check_stack.sh: torch 2.11.0 could not be installed" >&2; exit 1; }
"${PIP[@]}" "${STACK[@]}" -e "$REPO[dev]" || { echo "check_stack.sh: the stack or kdrun did not install" >&2; exit 1; }
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|huggingface.hub|accelerate) '

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
OUT=$VENV/device-check
rm -rf "$OUT"
start=$SECONDS
"$VENV/bin/kdrun-doctor" --device-check --fast --out "$OUT"
doctor=$?
echo "check_stack.sh: kdrun-doctor --device-check --fast exited with $doctor in $((SECONDS - start)) s ($OUT)"
(cd "$REPO" && "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider)
tests=$?
echo "check_stack.sh: the fast test loop exited with $tests"
exit $(( doctor || tests ))
