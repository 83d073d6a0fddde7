#!/usr/bin/env bash
# Source me: builds (once) and activates the heavy environment for weightsync's demo and tests.
#
# The venv lives OUTSIDE the clone, keyed on the dependency spec (.ci/requirements.txt, pyproject's
# dependency table and the Python version), so a warm run reuses it and any spec change builds a new
# one. A cold build (vllm 0.33 + megatron-core + torch, ~10 GB) takes a few minutes. weightsync itself
# is installed editable on top, without dependencies, every time (cheap).
#   WEIGHTSYNC_CACHE   where venvs are kept (default: ~/.cache/weightsync)
#   WEIGHTSYNC_PYTHON  interpreter to build the venv from (default: python3)
set -euo pipefail
_ws_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_ws_py=${WEIGHTSYNC_PYTHON:-python3}
_ws_key=$( { cat "$_ws_root/.ci/requirements.txt"; sed -n '/^dependencies/,/^]/p;/^\[project.optional-dependencies\]/,/^\[project.scripts\]/p' "$_ws_root/pyproject.toml"; "$_ws_py" -c 'import sys; print(sys.version_info[:2])'; } | sha256sum | cut -c1-16)
_ws_cache=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
WEIGHTSYNC_VENV="$_ws_cache/venv-$_ws_key"
mkdir -p "$_ws_cache"
if [ ! -f "$WEIGHTSYNC_VENV/.complete" ]; then
  echo "weightsync: building environment $WEIGHTSYNC_VENV (cold: a few minutes)" >&2
  rm -rf "$WEIGHTSYNC_VENV"
  "$_ws_py" -m venv "$WEIGHTSYNC_VENV"
  "$WEIGHTSYNC_VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$WEIGHTSYNC_VENV/bin/python" -m pip install -q -r "$_ws_root/.ci/requirements.txt" >&2
  touch "$WEIGHTSYNC_VENV/.complete"
fi
# shellcheck disable=SC1091
source "$WEIGHTSYNC_VENV/bin/activate"
python -m pip install -q --no-deps --no-build-isolation -e "$_ws_root" > "$WEIGHTSYNC_VENV/editable.log" 2>&1 \
  || { cat "$WEIGHTSYNC_VENV/editable.log" >&2; echo "weightsync: editable install failed" >&2; return 1 2>/dev/null || exit 1; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
set +euo pipefail
