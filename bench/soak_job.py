"""A soak "job": two trainer ranks (``soak_rank.rank_main``) forked from one forkserver that has torch,
transformers, vLLM and weightsync imported, joined by a gloo group whose store the parent hosts.

Why a forkserver: a killed job is relaunched many times per soak; a fresh interpreter per rank
would pay ~10 s of imports per relaunch on a busy 2-core machine, a fork of the preloaded server pays
milliseconds -- and each job still starts from a clean process (no process group, no state).

Invariants: every wait on a rank is bounded (``collect``'s deadline); ``stop()`` ends the job
whatever state its ranks are in (asks them to exit, then SIGCONT + SIGKILL what is left) and
returns which ranks had to be killed, so the soak can check that nothing of a dead job survives.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

__all__ = ["Job", "PRELOAD"]

logger = logging.getLogger("weightsync.bench.soak.job")

PRELOAD = [
    "torch", "torch.distributed", "transformers", "requests", "vllm.distributed.weight_transfer",
    "weightsync.sources", "weightsync.plugins", "weightsync.plugins.sync",
    "weightsync.plugins.loopback.trainer", "weightsync.plugins.testbed.vllm_server", "soak_rank",
]

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


class Job:
    """Two ranks, a pipe to each; ``send`` a command, ``collect`` their answers within a deadline."""

    def __init__(self, cfg: dict[str, Any], world: int = 2, start_timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        from soak_rank import rank_main

        self.world = world
        self.store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
        )
        self.conns, self.procs = [], []
        self.pending: dict[int, dict[str, Any]] = {}  # answers read while waiting on other ranks
        for r in range(world):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=rank_main, args=(r, world, self.store.port, child, cfg, dict(os.environ)),
                             name=f"soak-rank{r}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        ready = self.collect(start_timeout_s, want="ready")
        missing = [r for r in range(world) if r not in ready]
        if missing:
            self.stop()
            raise RuntimeError(f"soak job: ranks {missing} not ready within {start_timeout_s:.0f} s")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: dict[str, Any]) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(cmd)
                except (BrokenPipeError, OSError):
                    pass

    def collect(self, bound_s: float, want: str = "result", events: list | None = None,
                ranks: list[int] | None = None, on_event=None) -> dict[int, dict[str, Any]]:
        """Each rank's next answer (``want="result"``: a sync's outcome; ``"ready"``), until every rank
        in ``ranks`` answered, died, or ``bound_s`` passed. Events (``stopping``) go to ``events`` and
        ``on_event``. A rank that died is answered ``{"died": exitcode}``."""
        ranks = list(range(self.world)) if ranks is None else ranks
        got: dict[int, dict[str, Any]] = {r: self.pending.pop(r) for r in ranks if r in self.pending}
        deadline = time.monotonic() + bound_s
        while len(got) < len(ranks) and time.monotonic() < deadline:
            progressed = False
            for r in ranks:
                if r in got:
                    continue
                c, p = self.conns[r], self.procs[r]
                try:
                    if c.poll(0):
                        msg = c.recv()
                        progressed = True
                        if "event" in msg and msg["event"] != want:
                            if events is not None:
                                events.append(msg)
                            if on_event is not None:
                                on_event(msg)
                            continue
                        got[r] = msg
                        continue
                except (EOFError, OSError):  # the rank's end closed: it died
                    p.join(2)
                    got[r] = {"died": p.exitcode, "rank": r}
                    continue
                if not p.is_alive() and not c.poll(0):
                    got[r] = {"died": p.exitcode, "rank": r}
            for r in range(self.world):  # events of ranks not waited on (a rank about to stop itself)
                if r in ranks:
                    continue
                try:
                    if self.conns[r].poll(0):
                        msg = self.conns[r].recv()
                        if "event" in msg:
                            if events is not None:
                                events.append(msg)
                            if on_event is not None:
                                on_event(msg)
                        else:
                            self.pending[r] = msg
                except (EOFError, OSError):
                    pass
            if not progressed:
                time.sleep(0.02)
        return got

    def stop(self, bound_s: float = 10.0) -> list[int]:
        """End the job; returns the ranks that had to be killed (they did not exit when asked)."""
        self.send({"op": "exit"})
        deadline = time.monotonic() + bound_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        killed = []
        for r, p in enumerate(self.procs):
            if p.is_alive():
                killed.append(r)
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.join(5)
        for c in self.conns:
            c.close()
        del self.store
        return killed
