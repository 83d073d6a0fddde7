"""Rank 0's layout work for the unit received ahead, on a helper thread (CPU, overlap).

With overlap, rank 0 posts the next units' point-to-point receives before it hands on the current
unit's tensors (``GatheredPass.look_ahead``, ``megatron/gathered.py``). What remained in the
iterating thread is rank 0's own host work once those pieces arrived: the concatenation of the TP
shards and the QKV / GLU splits (``Layout.concat``) -- on CPU a copy of every byte, which nothing
overlapped (``docs/evidence.md``, bench_overlap_megatron). ``SplitAhead`` moves it to one helper
thread, as FSDPSource's helper unpacks the next gathered tensor (``fsdp/prefetch.py``):

* The helper never posts a transfer: posting stays in the iterating thread, in plan order, so
  the peers pair up as without it. It waits for the unit's receives -- ``PostedGather.finish``,
  gloo's own bounded wait (``waits.wait_p2p``), the same wait the iterating thread would make:
  gloo's point-to-point work completes only inside ``wait`` (``is_completed`` never advances on
  its own), so a helper that only polled would start no earlier than the iterating thread -- and
  then runs the unit's ``concat`` on the received pieces.
* The iterating thread, at that unit's step, takes the helper's outputs: a wait that failed
  (``SyncTimeoutError`` naming the peer and the parameter) is raised there, at that unit's step,
  as before; a pass that stops early waits out the helper (bounded by the same ``timeout_s``)
  before draining what is still posted.
* Memory: the helper drops the pieces once concatenated, so ahead of the unit being yielded rank 0
  holds each posted unit's pieces *or* its outputs, never both once a concat is done -- what is
  ahead stays within the lookahead's byte bound (``GatheredPass.look_ahead``); while a concat runs,
  its input and output coexist, as they do in the iterating thread.
* CPU only: on CUDA the concatenation is an asynchronous kernel already, issued on the caller's
  stream in the iterating thread (``MegatronSource`` does not start a helper there).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from ..core.comm.p2p import PostedGather
from ..core.ground.ranks import multi_rank

__all__ = ["AHEAD_BYTES", "AHEAD_BYTES_MANY_CORES", "SplitAhead", "cores_per_local_rank", "default_ahead_bytes"]

#: How far rank 0 posts receives ahead (``MegatronSource(ahead_bytes=)``, ``GatheredPass.look_ahead``):
#: one more unit is posted while the units posted ahead and not yet yielded hold less than this
#: many bytes of HF tensors.
#: Why bytes and not one unit: a layer's units differ several-fold in size (an ``o_proj`` against
#: the ``fc1`` after it), and with one unit ahead the transfer and concatenation of a large unit
#: could only overlap the consumer's time on the small unit before it -- the rest was a pause. Why
#: "less than" (one unit may overshoot): a unit larger than the budget (``lm_head``) must still be
#: posted while the layer before it is consumed, not only once nothing else is ahead -- or its
#: transfer and concatenation are a pause of their own at the end of the pass. Memory: rank 0 holds
#: the unit being yielded plus less than the budget + one unit posted ahead (each as received pieces
#: or as concatenated outputs), plus the one concatenation the helper is running (its input and
#: output coexist).
#:
#: Why the default depends on the cores (``default_ahead_bytes``): what is posted ahead moves and is
#: concatenated by gloo's threads and the helper while the consumer runs, so it only helps where
#: those threads have cores of their own. With several cores per rank the larger budget was faster
#: for a little more peak memory; with few it was slower (more copies in flight on the cores the
#: consumer and gloo need). The measurements (bench_overlap_megatron) are in ``docs/evidence.md``.
AHEAD_BYTES = 64 << 20
#: The budget where each local rank has at least ``_MANY_CORES`` cores (``default_ahead_bytes``).
AHEAD_BYTES_MANY_CORES = 128 << 20
_MANY_CORES = 4


def cores_per_local_rank() -> float:
    """The CPUs this process may run on, shared by the ranks of this host: ``LOCAL_WORLD_SIZE``
    (torchrun sets it), else the world size (one host), else 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        ranks = int(local)
    elif multi_rank():
        ranks = dist.get_world_size()
    else:
        ranks = 1
    return cores / ranks


def default_ahead_bytes() -> int:
    """``AHEAD_BYTES_MANY_CORES`` where each local rank has ``_MANY_CORES`` cores or more, else
    ``AHEAD_BYTES`` (see above why the cores decide)."""
    return AHEAD_BYTES_MANY_CORES if cores_per_local_rank() >= _MANY_CORES else AHEAD_BYTES


class SplitAhead:
    """One helper thread working through the units posted ahead, in plan order (see the module
    docstring): one job per posted unit, so its work is bounded by what is posted ahead."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[int, tuple[Future, threading.Event]] = {}

    def start(self, step: int, gather: PostedGather, fn: Callable[[list], Any], timeout_s: float) -> None:
        """Wait for ``gather``'s receives (``step``'s unit) and run ``fn(pieces)``, on the helper."""
        if step in self._jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-split")
        stop = threading.Event()
        self._jobs[step] = (self._pool.submit(self._run, gather, fn, stop, timeout_s), stop)

    @staticmethod
    def _run(gather: PostedGather, fn: Callable[[list], Any], stop: threading.Event, timeout_s: float) -> Any:
        if stop.is_set():
            return None
        pieces = gather.finish(timeout_s)  # bounded (gloo's own wait); raises naming peer and tensor
        if pieces is None or stop.is_set():
            return None
        return fn(pieces)  # (``fn`` drops the pieces its outputs replace: memory bound unchanged)

    def take(self, step: int) -> Any:
        """The helper's result for ``step`` (waiting for it; its wait's error raised here), or None
        when none ran for it."""
        job = self._jobs.pop(step, None)
        return None if job is None else job[0].result()

    def close(self) -> None:
        """Wait out the helper's jobs (each bounded by its wait's ``timeout_s``; results and errors
        dropped: the pass is ending) and end the thread."""
        jobs, self._jobs = self._jobs, {}
        for _fut, stop in jobs.values():
            stop.set()
        for fut, _stop in jobs.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a result nobody will read
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
