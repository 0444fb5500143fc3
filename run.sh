#!/usr/bin/env bash
# All set-up and the two main jobs, on a fresh machine with only Python 3.11+:
#   bash run.sh demo   install, train the default model on the embedded corpus, generate from it
#   bash run.sh test   install (with test dependencies) and run the whole test suite
# Installs into ./.venv unless a virtual environment is already active (or FIVEFOLD_NO_VENV=1).
# torch is installed first and pinned by TORCH_SPEC: the default is the CPU build this project is
# developed on; on a GPU machine use e.g. TORCH_SPEC="torch==2.13.0" PIP_EXTRA_INDEX_URL=<CUDA index>.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ -z "${VIRTUAL_ENV:-}" ] && [ "${FIVEFOLD_NO_VENV:-0}" != 1 ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  PY=.venv/bin/python
fi

install() {
  "$PY" -m pip install -q "$TORCH_SPEC"
  "$PY" -m pip install -q -e ".[$1]"
}

job=${1:-}
shift || true
case "$job" in
  demo)
    install tensorboard
    "$PY" -m fivefold train "$@"
    out=runs/default  # generate from where training wrote, also when --out was given
    prev=""
    for arg in "$@"; do
      [ "$prev" = "--out" ] && out=$arg
      case "$arg" in --out=*) out=${arg#--out=} ;; esac
      prev=$arg
    done
    "$PY" -m fivefold generate "$out" --prompt "The with statement" --max-new-tokens 80
    ;;
  test)
    install dev
    # two worker processes, each taking a whole test file at a time (its module fixtures run once): the
    # parity tests' torchrun launches leave a core idle while workers start; FIVEFOLD_TEST_WORKERS=0: one process
    "$PY" -m pytest -q -n "${FIVEFOLD_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  *)
    echo "usage: bash run.sh demo|test [extra arguments for fivefold train / pytest]" >&2
    exit 2
    ;;
esac
