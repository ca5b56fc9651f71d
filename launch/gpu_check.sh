#!/usr/bin/env bash
# The GPU check (issue 47, item 8): at most 8 minutes, one command, no package registry.
#
# Usage (from anywhere):
#   launch/gpu_check.sh [--tiny] [--out=DIR] [--parts=a,b] [--data-dir=DIR] [--executor=auto]
#
# Runs `python -m petra_jax.benchmarks.gpu_check` (its docstring lists the parts and their
# time limits) from the checkout's root and bundles the output into DIR.tar.gz. If the
# checkout holds wheels in .whl/ (../shared/gpu/wheels.sh), they are installed from there
# alone (pip --no-index: never the network) into GPU_CHECK_SITE (default /tmp/site) first.
# --tiny: CPU sizes, a dry run.
#
# Environment:
#   PYTHON          interpreter (default python3)
#   GPU_CHECK_SITE  where .whl/ is installed (default /tmp/site)
#   EXECUTOR        the tick executor (auto, compiled or host), as --executor
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
EXECUTOR=${EXECUTOR:-auto}
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" || exit 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# Several processes share the one GPU in turn: none holds 75 % of its memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec "$PYTHON" -m petra_jax.benchmarks.gpu_check --executor="$EXECUTOR" "$@"
