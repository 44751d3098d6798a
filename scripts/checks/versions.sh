#!/usr/bin/env bash
# kdrun on each dependency stack it claims to support, each in its own virtual environment:
#
#   pinned   the stack CI installs: pip install -c constraints.txt -e ".[dev]"
#   lowest   the lowest versions pyproject.toml allows of torch, transformers, datasets, accelerate,
#            evaluate and wandb, with the huggingface_hub and tokenizers those ask for at the least
#   gpu      the Python stack of a typical GPU image: torch 2.11, transformers 5.17,
#            huggingface_hub 1.33, accelerate 1.15
#
#     bash scripts/checks/versions.sh [STACK ...]     (default: all three; run by hand, not by CI)
#     KDRUN_VERSIONS_DIR=/tmp/kdrun-versions          (where the environments live; reused when present)
#     FAST=1 bash scripts/checks/versions.sh ...      (a few tests instead of the fast loop)
#     KINDS="classification qa" bash ...              (only these tiny runs)
#
# In each: the fast test loop (pytest -m "not slow"), then one tiny run of each task kind on real
# data where shared/data beside the repository (or $KDRUN_DATA) has it: labelled classification (toy), regression
# (STS-B), extractive QA (SQuAD), a raw-text corpus (Wikipedia). Prints one table row per stack
# (its versions, the loop's counts, each tiny run's exit status) and writes the table to
# $KDRUN_VERSIONS_DIR/versions.md (each loop's output, failures named: <stack>-loop.log beside it).
# torch below 2.13 comes from PyPI as its CUDA build (several GB; it runs on a CPU too).
case "${1:-}" in -h|--help) sed -n "2,/^[^#]/{/^#/s/^# \{0,1\}//p}" "$0"; exit 0 ;; esac
set -uo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${KDRUN_VERSIONS_DIR:-/tmp/kdrun-versions}
PYTHON=${PYTHON:-python3}
DATA=${KDRUN_DATA:-$(dirname "$REPO")/shared/data}
STACKS=("$@")
[ ${#STACKS[@]} -eq 0 ] && STACKS=(pinned lowest gpu)
mkdir -p "$ROOT"

pins() {  # the pins of a stack, one requirement per line
  case "$1" in
    pinned) cat "$REPO/constraints.txt" ;;
    here) ;;  # the Python it is given as $ROOT/here (a test of this script)
    lowest) printf '%s\n' torch==2.7.1 transformers==5.0.0 datasets==3.0.0 accelerate==1.0.0 evaluate==0.4.3 \
              wandb==0.19.9 "huggingface_hub==1.3.0" hydra-core==1.3.8 \
              omegaconf==2.3.1 "sqlalchemy<2" ;;
    gpu) printf '%s\n' torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 accelerate==1.15.0 \
           hydra-core==1.3.8 omegaconf==2.3.1 "sqlalchemy<2" ;;
    *) echo "unknown stack $1 (pinned, lowest, gpu)" >&2; return 2 ;;
  esac
}

install() {  # the stack's environment with kdrun installed (editable, dev extra) under its pins
  local stack=$1 venv=$ROOT/$1
  [ -x "$venv/bin/kdrun" ] && return 0
  "$PYTHON" -m venv "$venv" || return 1
  pins "$stack" > "$ROOT/$stack.pins" || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip &&
    "$venv/bin/python" -m pip install -q -c "$ROOT/$stack.pins" -e "$REPO[dev]"
}

tiny_runs() {  # one tiny run per task kind; prints "kind:rc" for each (logs: $out/<kind>.log)
  local venv=$1 out=$2 base=(teacher=tiny_random student=tiny_random logger=none teacher.finetune.epochs=1
                            train.epochs=1 objective=logit)
  local -A kinds=(
    [classification]="task=toy task.toy.num_train=64 task.toy.num_validation=24"
    [regression]="task=stsb task.data_dir=$DATA/glue/STS-B task.max_train_samples=64"
    [qa]="task=squad task.data_files=$DATA/squad/dev-v1.1.json task.split_by_article=3 task.max_seq_length=128 task.doc_stride=32 task.max_train_samples=32"
    [corpus]="task=text_corpus task.data_files=$DATA/wikipedia/wiki_00 task.validation_percent=15 task.max_seq_length=24 task.max_train_samples=64 objective=ckd_general"
  )
  for kind in ${KINDS:-classification regression qa corpus}; do
    # shellcheck disable=SC2086
    (cd "$out" && HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 KDRUN_CACHE_DIR="$out/cache" \
      "$venv/bin/kdrun" "${base[@]}" ${kinds[$kind]} hydra.run.dir="$out/$kind" > "$out/$kind.log" 2>&1)
    printf '%s:%s ' "$kind" "$?"
  done
}

versions() {
  "$1/bin/python" - <<'EOF'
import importlib.metadata as m
print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "transformers", "huggingface_hub", "datasets", "accelerate",
                                                "evaluate", "wandb", "pytest")))
EOF
}

rows=()
for stack in "${STACKS[@]}"; do
  venv=$ROOT/$stack out=$ROOT/$stack-runs
  rm -rf "$out" && mkdir -p "$out"
  echo "[versions] $stack: installing into $venv" >&2
  if ! install "$stack" > "$ROOT/$stack-install.log" 2>&1; then
    rows+=("| $stack | install failed (see $ROOT/$stack-install.log) | — | — |"); continue
  fi
  echo "[versions] $stack: the fast loop" >&2
  if [ -n "${FAST:-}" ]; then sel=(tests/test_significance.py); else sel=(-m "not slow"); fi
  (cd "$REPO" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -rfE "${sel[@]}" > "$ROOT/$stack-loop.log" 2>&1)
  loop=$(tail -1 "$ROOT/$stack-loop.log")
  echo "[versions] $stack: tiny runs" >&2
  runs=$(tiny_runs "$venv" "$out")
  rows+=("| $stack | $(versions "$venv") | $loop | $runs |")
done
table=$(printf '%s\n' "| stack | versions | fast loop | tiny runs (kind:exit status) |" "|---|---|---|---|" "${rows[@]}")
echo "$table" | tee "$ROOT/versions.md"
