#!/usr/bin/env bash
# Source me: builds (once) and activates the heavy environment for weightsync's demo and tests.
#
# The venv lives OUTSIDE the clone, keyed on the dependency spec (the requirements file below, pyproject's
# dependency table and the Python version), so a warm run reuses it and any spec change builds a new
# one. A cold build (vllm + megatron-core + torch, ~10 GB) takes a few minutes. weightsync itself
# is installed editable on top, without dependencies, every time (cheap). A cold build prints one
# line per stage to stderr with the elapsed seconds, and a heartbeat every 5 s naming pip's latest
# step (its full output goes to $WEIGHTSYNC_CACHE/build-<key>.log); a warm run prints nothing.
#   WEIGHTSYNC_CACHE   where venvs are kept (default: ~/.cache/weightsync)
#   WEIGHTSYNC_PYTHON  interpreter to build the venv from (default: python3)
set -euo pipefail
_ws_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_ws_py=${WEIGHTSYNC_PYTHON:-python3}
# WEIGHTSYNC_VLLM picks the vLLM line: unset or 0.34 -> .ci/requirements.txt (the default), 0.33 ->
# .ci/requirements-vllm033.txt (the second pass of .ci/test). Each has its own cached venv.
case "${WEIGHTSYNC_VLLM:-0.34}" in
  0.34) _ws_req="$_ws_root/.ci/requirements.txt" ;;
  0.33) _ws_req="$_ws_root/.ci/requirements-vllm033.txt" ;;
  *) echo "weightsync: WEIGHTSYNC_VLLM=${WEIGHTSYNC_VLLM} is not one of 0.34 (default), 0.33" >&2
     set +euo pipefail; return 1 2>/dev/null || exit 1 ;;
esac
_ws_key=$( { cat "$_ws_req"; sed -n '/^dependencies/,/^]/p;/^\[project.optional-dependencies\]/,/^\[project.scripts\]/p' "$_ws_root/pyproject.toml"; "$_ws_py" -c 'import sys; print(sys.version_info[:2])'; } | sha256sum | cut -c1-16)
_ws_cache=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
WEIGHTSYNC_VENV="$_ws_cache/venv-$_ws_key"
mkdir -p "$_ws_cache"
_ws_t0=$SECONDS
_ws_say() { echo "weightsync: [$(( SECONDS - _ws_t0 ))s] $*" >&2; }
# _ws_step LABEL CMD...: run CMD with its output in $_ws_log; a heartbeat line every 5 s naming pip's
# latest "Collecting / Downloading / Installing ..." line; on failure, the log's tail and a non-zero status.
_ws_step() {
  local label=$1; shift
  _ws_say "$label"
  echo "== $label" >> "$_ws_log"
  (
    "$@" >> "$_ws_log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM  # a background job ignores Ctrl-C: stop it here
    n=0; seen=""
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1
      n=$((n + 1))
      if [ $((n % 5)) -eq 0 ]; then
        # pip's newest step, only when it is new: a long silent step (resolving, unpacking a big wheel)
        # says how long it has been silent instead of repeating a line that is no longer true
        last=$(grep -E '^ *(Collecting|Downloading|Building|Installing|Successfully)' "$_ws_log" | tail -n 1 | sed 's/^ *//' | cut -c1-110 || true)
        if [ -n "$last" ] && [ "$last" != "$seen" ]; then
          seen=$last; quiet=$n
          _ws_say "  ... still ${label%% *}: $last"
        else
          _ws_say "  ... still ${label%% *} (${n} s in this stage; pip silent for $(( n - ${quiet:-0} )) s; log: $_ws_log)"
        fi
      fi
    done
    wait "$pid"
  ) || { tail -n 25 "$_ws_log" >&2; _ws_say "FAILED: $label (full log: $_ws_log)"; return 1; }
}
if [ ! -f "$WEIGHTSYNC_VENV/.complete" ]; then
  # One build per venv at a time: a second shell or job sourcing this meanwhile waits on the lock,
  # then finds the venv complete (two pips in one venv corrupt it). The build runs in a subshell that
  # holds the lock; exit 10: someone else built it while we waited.
  _ws_rc=0
  (
    if ! flock -n 9; then
      _ws_say "another process is building $WEIGHTSYNC_VENV; waiting for it (log: $_ws_cache/build-$_ws_key.log)"
      flock 9
    fi
    [ -f "$WEIGHTSYNC_VENV/.complete" ] && exit 10
    _ws_log="$_ws_cache/build-$_ws_key.log"
    : > "$_ws_log"
    _ws_say "building environment $WEIGHTSYNC_VENV (cold: a few minutes, ~10 GB; log: $_ws_log)"
    rm -rf "$WEIGHTSYNC_VENV"
    _ws_step "creating venv" "$_ws_py" -m venv "$WEIGHTSYNC_VENV" || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
    _ws_step "upgrading pip" "$WEIGHTSYNC_VENV/bin/python" -m pip install --upgrade pip \
      || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
    # "# override: PKG==VER" lines in the requirements file replace vLLM's own pin of PKG (vLLM 0.34.0
    # pins flashinfer-python==0.7.3, which PyPI does not serve): vLLM is then installed --no-deps and
    # its other requirements, read from its installed metadata, beside the overrides.
    _ws_over=$(sed -n 's/^# override: *//p' "$_ws_req")
    if [ -n "$_ws_over" ]; then
      _ws_vllm=$(grep -E '^vllm==' "$_ws_req")
      _ws_step "installing $_ws_vllm (no dependencies: the requirements file overrides some)" \
        "$WEIGHTSYNC_VENV/bin/python" -m pip install --progress-bar off --no-deps "$_ws_vllm" \
        || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
      printf '%s\n' "$_ws_over" > "$WEIGHTSYNC_VENV/overrides.txt"
      "$WEIGHTSYNC_VENV/bin/python" - "$WEIGHTSYNC_VENV/overrides.txt" > "$WEIGHTSYNC_VENV/vllm-deps.txt" <<'PY'
import importlib.metadata as md, re, sys
over = {re.split(r"[=<>!~ ;]", l, maxsplit=1)[0].lower().replace("_", "-")
        for l in open(sys.argv[1]) if l.strip()}
for r in md.requires("vllm") or []:
    name = re.split(r"[\[=<>!~ ;(]", r, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" not in r and name not in over:
        print(r)
PY
      _ws_step "installing $(basename "$_ws_req") and vLLM's requirements (overridden: $(echo $_ws_over))" \
        "$WEIGHTSYNC_VENV/bin/python" -m pip install --progress-bar off \
        -r <(grep -vE '^vllm==' "$_ws_req") -r "$WEIGHTSYNC_VENV/vllm-deps.txt" -r "$WEIGHTSYNC_VENV/overrides.txt" \
        || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
    else
      _ws_step "installing $(basename "$_ws_req") (vllm, megatron-core, torch, ...)" \
        "$WEIGHTSYNC_VENV/bin/python" -m pip install --progress-bar off -r "$_ws_req" \
        || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
    fi
    # "# no-deps: PKG==VER" lines: packages whose own pins clash with this stack (verl 0.9.1 asks
    # transformers<5.11, vllm==0.24.0), installed last without dependencies; the requirements file
    # lists what they need at import time
    _ws_nodeps=$(sed -n 's/^# no-deps: *//p' "$_ws_req")
    if [ -n "$_ws_nodeps" ]; then
      # shellcheck disable=SC2086
      _ws_step "installing $(echo $_ws_nodeps) (no dependencies)" \
        "$WEIGHTSYNC_VENV/bin/python" -m pip install --progress-bar off --no-deps $_ws_nodeps \
        || { set +euo pipefail; return 1 2>/dev/null || exit 1; }
    fi
    touch "$WEIGHTSYNC_VENV/.complete"
  ) 9>"$_ws_cache/build-$_ws_key.lock" || _ws_rc=$?
  case $_ws_rc in
    0) _ws_cold=1 ;;
    10) ;;
    *) set +euo pipefail; return 1 2>/dev/null || exit 1 ;;
  esac
fi
# shellcheck disable=SC1091
source "$WEIGHTSYNC_VENV/bin/activate"
[ -z "${_ws_cold:-}" ] || _ws_say "installing weightsync (editable, no dependencies)"
python -m pip install -q --no-deps --no-build-isolation -e "$_ws_root" > "$WEIGHTSYNC_VENV/editable.log" 2>&1 \
  || { cat "$WEIGHTSYNC_VENV/editable.log" >&2; echo "weightsync: editable install failed" >&2; set +euo pipefail; return 1 2>/dev/null || exit 1; }
[ -z "${_ws_cold:-}" ] || _ws_say "environment ready"
unset _ws_cold
unset -f _ws_say _ws_step
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
set +euo pipefail
