# Shared by the one-session GPU scripts (gpu_serve.sh, gpu_train.sh): sourced, not run. Sets PY, gpu (a slug
# of the GPU's name: h100, h200, a100, ...), name and log; sends all output to the log too; installs fivefold
# if it is not importable; and gives step / pytest_step (each with its own time limit, so a failing or
# timed-out step does not stop the next) and print_steps (how each ended). ONLY="NAME ..." runs just the
# steps so named (a session's device time may not cover every step of both scripts). COPY_TO=DIR: after every
# step, every file these scripts wrote under bench/results (since the first script of the call started) is
# packed into DIR/results.tgz, one file, so that a call cut short keeps what its finished steps measured.
#
#   gpu_setup LOG_PREFIX    # bench/results/<LOG_PREFIX>_<gpu>.log

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
export PYTHONUNBUFFERED=1

gpu_setup() {
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    gpu=$(printf '%s' "$name" | tr 'A-Z' 'a-z' | grep -oE 'gh200|[a-z][0-9]{2,4}[a-z]?' | head -n 1)
    gpu=${gpu:-${GPU_SLUG:-gpu}}
    mkdir -p bench/results
    if [ -z "${GPU_RESULTS_SINCE:-}" ]; then  # one mark for every script of the call (COPY_TO packs what is newer)
        GPU_RESULTS_SINCE=$(mktemp)
        export GPU_RESULTS_SINCE
    fi
    log=bench/results/$1_$gpu.log
    exec > >(tee "$log") 2>&1
    echo "== bench/$1.sh on $(hostname) at $(date -u '+%Y-%m-%d %H:%M:%S') UTC; git $(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || echo "(no nvidia-smi)"
    # -P: `python -c` would find the source tree through the working directory where `python bench/x.py`
    # does not (it puts bench/ on the path instead), and the benches would then fail to import fivefold.
    if ! "$PY" -P -c "import fivefold" >/dev/null 2>&1; then
        echo "== installing fivefold: pip install -e . --no-deps"
        # No internet: the build backend must come from the environment (setuptools), not an isolated build.
        "$PY" -m pip install -q -e . --no-deps --no-build-isolation || "$PY" -m pip install -q -e . --no-deps
    fi
    if ! "$PY" -P -c "import fivefold" >/dev/null 2>&1; then
        echo "== fivefold is still not importable after pip: running from the source tree (PYTHONPATH=$PWD)"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import torch, triton, transformers; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), '
              f'triton {triton.__version__}, transformers {transformers.__version__}, '
              f'cuda available: {torch.cuda.is_available()}')"
}

names=() codes=() secs=() known=()
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit (SIGTERM, then SIGKILL 10 s later), record how it ended
    local label=$1 limit=$2 start=$SECONDS rc
    shift 2
    known+=("$label")
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $label "* ]]; then
        echo "== $label: left out (not in ONLY=\"$ONLY\")"
        return
    fi
    echo
    echo "== $label (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    names+=("$label") codes+=("$rc") secs+=("$((SECONDS - start))")
    copy_results
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $label: TIMED OUT after ${limit} s (exit $rc)"
    elif [ "$rc" -ne 0 ]; then
        echo "== $label: FAILED (exit $rc)"
    fi
}

copy_results() {  # with COPY_TO: this call's results so far, packed into COPY_TO/results.tgz
    [ -n "${COPY_TO:-}" ] || return 0
    mkdir -p "$COPY_TO"
    (cd bench/results && find . -type f -newer "$GPU_RESULTS_SINCE" -print0 | tar czf "$COPY_TO/results.tgz" --null -T -)
}

existing() {  # the given test files that this checkout has
    local t
    for t in "$@"; do
        if [ -f "$t" ]; then echo "$t"; else echo "== $t is not in this checkout: left out" >&2; fi
    done
}

pytest_step() {  # pytest_step NAME LIMIT_S FILE_OR_NODE...: the files this checkout has (none: the step is left out)
    local label=$1 limit=$2 files
    shift 2
    mapfile -t files < <(existing "$@")
    if [ "${#files[@]}" -eq 0 ]; then echo "== $label: no test files, left out"; return; fi
    step "$label" "$limit" "$PY" -m pytest -q -x -p no:cacheprovider "${files[@]}"
}

print_steps() {
    echo
    echo "== summary: $name ($gpu), $SECONDS s in all"
    local word
    for word in ${ONLY:-}; do  # a mistyped name would otherwise leave every step out without a word
        [[ " ${known[*]} " == *" $word "* ]] || echo "  ONLY names '$word', which is no step here (steps: ${known[*]})"
    done
    local i how
    for i in "${!names[@]}"; do
        case ${codes[$i]} in
            0) how="ok" ;;
            124|137) how="TIMED OUT" ;;
            *) how="FAILED (exit ${codes[$i]})" ;;
        esac
        printf '  %-14s %-18s %4s s\n' "${names[$i]}" "$how" "${secs[$i]}"
    done
}
