"""The processes one launch started: torchrun, its ranks and every helper they started, orphans included.

Why: a rank that dies by a signal runs no ``finally``, so what it started -- the demo's vLLM server
(API server, EngineCore, Worker, in a process group of their own), a receiver process -- is orphaned,
and nothing in torchrun knows about it. The launcher is the one process that outlives every rank,
so it keeps the list and is the one that stops what is left.

Invariants:

* **Nothing a launch started outlives it.** ``ProcessTree`` makes the launcher a child subreaper
  (Linux ``PR_SET_CHILD_SUBREAPER``) for the launch's duration, so a helper whose parent died is
  re-parented to the launcher instead of init and stays findable; ``snapshot()`` (called every few
  tenths of a second while the launch runs) records every process under torchrun and every process
  group it leads or joins; ``stop()`` signals every recorded group that still has a live member
  (SIGTERM, a bounded wait, then SIGKILL), reaps the orphans it inherited and ends the subreaper
  role. Groups are killed, never names: only what this launch started is touched.
* **Ranks are known by pid and rank** (``RANK`` in each rank's environment, as torchrun sets it), so
  the launcher can say which rank died or is stopped (``gone``, ``stopped``) without asking a rank.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time

__all__ = ["ProcessTree", "descendants", "state_of"]

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry, ppid in _parents().items():
        children.setdefault(ppid, []).append(entry)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                out[int(entry)] = int(stat[1])
    return out


def _stat(pid: int) -> list[str] | None:
    """``/proc/pid/stat`` after the command name: [state, ppid, pgrp, ...], or None (gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state_of(pid: int) -> str | None:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), or None when gone."""
    stat = _stat(pid)
    return stat[0] if stat else None


def _alive(pid: int) -> bool:
    return state_of(pid) not in (None, "Z")


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            try:
                return int(item[5:])
            except ValueError:
                return None
    return None


def _set_subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: orphans go to init, found only while their parent lives
        return False


class ProcessTree:
    """What ``root`` (torchrun, started in its own session) and its descendants are and were (module
    docstring). Build it right before starting ``root``; ``stop()`` in a ``finally``."""

    def __init__(self) -> None:
        self.root: subprocess.Popen | None = None
        self._before = {p for p, pp in _parents().items() if pp == os.getpid()}  # not ours to reap
        self._subreaper = _set_subreaper(True)
        self.pids: set[int] = set()  # every process seen under root
        self.groups: set[int] = set()  # every process group they were in (not the launcher's own)
        self.ranks: dict[int, int] = {}  # pid -> rank, for the ranks torchrun started

    def watch(self, root: subprocess.Popen) -> None:
        self.root = root
        self.snapshot()

    def snapshot(self) -> None:
        """Record what runs under ``root`` now, and the orphans re-parented to the launcher."""
        if self.root is None:
            return
        parents = _parents()
        now = [p for p in descendants(self.root.pid) if p in parents]
        now += [p for p in self._orphans(parents) if p not in now]
        own = os.getpgrp()
        for pid in now:
            stat = _stat(pid)
            if stat is None or stat[0] == "Z":
                continue
            self.pids.add(pid)
            if int(stat[2]) != own:
                self.groups.add(int(stat[2]))
            if pid not in self.ranks and parents.get(pid) == self.root.pid:
                rank = _rank_of(pid)
                if rank is not None:
                    self.ranks[pid] = rank

    def _orphans(self, parents: dict[int, int]) -> list[int]:
        """The launcher's children that it did not start itself: helpers of this launch whose parent
        died (subreaper), recognized by a pid or group seen under ``root`` before."""
        me = os.getpid()
        root = self.root.pid if self.root is not None else None
        out = []
        for pid, ppid in parents.items():
            if ppid != me or pid in self._before or pid == root:
                continue
            stat = _stat(pid)
            if stat is not None and (pid in self.pids or int(stat[2]) in self.groups):
                out.append(pid)
        return out

    def gone(self) -> list[int]:
        """Ranks (by rank) seen running that have ended."""
        return sorted(r for pid, r in self.ranks.items() if not _alive(pid))

    def stopped(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of the ranks stopped now (SIGSTOP / SIGTSTP: state ``T``)."""
        return sorted((r, pid) for pid, r in self.ranks.items() if state_of(pid) == "T")

    def signal_ranks(self, sig: int) -> None:
        for pid in self.ranks:
            if _alive(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def live_groups(self) -> set[int]:
        """The recorded groups that still hold a live process (a pgid with no live member is never
        signalled: its number may be reused)."""
        live = set()
        for pid in _parents():
            stat = _stat(pid)
            if stat is not None and stat[0] != "Z" and int(stat[2]) in self.groups:
                live.add(int(stat[2]))
        return live

    def stop(self, grace_s: float) -> list[int]:
        """Stop everything recorded that is still alive: root, then SIGTERM to every live group (a
        stopped process gets SIGCONT, so it can act on it), up to ``grace_s`` for them to end, SIGKILL
        to what is left; reap inherited orphans; end the subreaper role. Returns the groups that had
        to be signalled (empty when everything had ended by itself)."""
        try:
            self.snapshot()
            if self.root is not None and self.root.poll() is None:
                self.root.kill()  # torchrun first: it restarts nothing and reports nothing from here on
                self.root.wait()
            live = self.live_groups()
            for sig in (signal.SIGTERM, signal.SIGCONT):
                for g in live:
                    try:
                        os.killpg(g, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + grace_s
            while self.live_groups() and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.1)
            for g in self.live_groups():
                logger.warning("killing process group %d (still running %.0f s after SIGTERM)", g, grace_s)
                try:
                    os.killpg(g, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            t0 = time.monotonic()
            while self.live_groups() and time.monotonic() - t0 < 10:
                self._reap()
                time.sleep(0.05)
            self._reap()
            return sorted(live)
        finally:
            if self._subreaper:
                _set_subreaper(False)
                self._subreaper = False

    def _reap(self) -> None:
        """Collect the exit of every orphan the launcher inherited (else they stay zombies)."""
        for pid in self._orphans(_parents()):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
