#!/usr/bin/env bash
# The GPU check: does every CUDA path work on this machine, and how fast (about 8 minutes on one H100, offline).
#
#   bash runs/gpu_check.sh                  # needs one CUDA device; writes gpu_check.json and gpu_check.log
#   bash runs/gpu_check.sh --out=DIR        # into DIR (default: <base_dir>/gpu_check/<UTC time>)
#   bash runs/gpu_check.sh --dry-run        # the same steps on CPU at tiny sizes (the default test tier runs this)
#   bash runs/gpu_check.sh --budget_s=600   # any setting of scripts/gpu_check.py as --name=value
#
# The steps and the JSON: scripts/gpu_check.py. Exit code 0 when every step passed.
# rustbpe (tokenizer training) is installed from a wheel in .whl/ when it is missing, for a machine without network;
# fetch the wheel where there is network (a Python 3.12 x86-64 Linux box here):
#   pip download rustbpe==0.1.0 --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --no-deps -d .whl/
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=()
for a in "$@"; do
    case "$a" in
        --dry-run) args+=(--dry_run=True) ;;
        *) args+=("$a") ;;
    esac
done
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
site=".whl/site-py$pyver"  # rustbpe installed from the wheel goes here (git-ignored), not into the system
if [ -d "$site" ]; then export PYTHONPATH="$PYTHONPATH:$PWD/$site" GPU_CHECK_RUSTBPE="from .whl/ ($site)"; fi
if ! "$PY" -c "import rustbpe" 2>/dev/null; then
    # pip if it is there, else the wheel (a zip) unpacked as it is: rustbpe has no dependencies
    wheel=$(ls .whl/rustbpe-0.1.0-cp"$pyver"-*.whl 2>/dev/null | head -n 1)
    if ! "$PY" -m pip install --quiet --no-index --find-links .whl/ --target "$site" rustbpe==0.1.0 2>/dev/null \
        && ! { [ -n "$wheel" ] && "$PY" -m zipfile -e "$wheel" "$site"; }; then
        echo "error: rustbpe is not installed and .whl/ has no wheel of it for this Python ($pyver): fetch one with" \
             "'pip download rustbpe==0.1.0 --only-binary=:all: --python-version 3.12 --platform" \
             "manylinux2014_x86_64 --no-deps -d .whl/' (see runs/gpu_check.sh)" >&2
        exit 2
    fi
    export PYTHONPATH="$PYTHONPATH:$PWD/$site"
    export GPU_CHECK_RUSTBPE="from .whl/ into $site"
fi
exec "$PY" scripts/gpu_check.py "${args[@]}"
