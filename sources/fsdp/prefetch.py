"""Overlap: the next gather group is in flight while the consumer handles this one.

``GatherPipeline`` walks a pass's plan (``plan.Step`` list) and decides, step by step, which
batched gathers are posted (``BatchedGather.post()``: packed and issued, not waited for) before the
current step's tensors are yielded. What it guarantees:

* **Same collectives, same order, on every rank.** Whether and when a gather is posted is a pure
  function of the plan, ``overlap`` and ``prefetch_bytes`` -- all identical across ranks -- and the
  posting is done by the thread that iterates the source, at fixed points (right before a step's
  first tensor is yielded). So every rank issues exactly the collectives of the non-overlapped pass,
  in the same order, only earlier; a consumer's own collectives (vLLM's broadcasts) interleave with
  them at the same points on every rank (the TRL hang came from a second thread posting gathers at
  times that differed across ranks).
* **Bounded bytes in flight.** Gathers posted ahead of the step being yielded hold at most
  ``prefetch_bytes`` (send block + gathered buffer of each), except that the next gather is always
  allowed alone whatever its size (as ``group_bytes`` lets a larger tensor gather alone).
  ``prefetch_bytes=None`` (the default): exactly one group ahead. So the source's extra memory is the
  group being yielded plus what is ahead: two groups by default.
* **Never across a synchronous collective.** The ``full_tensor()`` fallback (``Step.kind ==
  "full"``) is a collective issued and completed in place; nothing is posted past it, and at that
  step nothing is in flight (what AReaL does before an incompatible collective). Steps without a
  collective (plain tensors, one-rank shard axes) are looked past.
* **Host copies overlap too (CPU).** On CPU one helper thread does the two local copies: it packs the
  send block of the gather after the one posted ahead (so posting it costs the iterating thread
  nothing), and unpacks a gather's tensors (the copy out of the gathered buffer into each fresh
  tensor) one tensor ahead of the consumer (the next one large enough to be worth the hand-off).
  The first large tensor of the gather posted ahead is queued on it as soon as the group being
  yielded has nothing left to unpack ahead, and starts once that collective completed (the helper
  polls ``is_completed``; ``BatchedGather.start_early`` says why the iterating thread cannot be
  the one to notice). It never issues a collective nor makes its bounded wait (posting and waiting
  stay in the iterating thread, in plan order, so board steps and errors keep their place). It adds one send block (~1/n of a group) and one unpacked tensor to the bound.
  Device tensors are packed on the side stream and unpacked on the consumer's stream (asynchronous
  already).
* **Scratch buffers are recycled (CPU).** Send blocks and gathered buffers come from the pass's
  two ``buffers.BufferPool`` (one per role, so a send block never pins a gathered buffer's worth
  of memory) and go back to it once their collective completed and their last tensor
  was unpacked, so the groups of a pass reuse memory already paged in instead of faulting in fresh
  memory per group (the pool's idle buffers are counted in the pass's extra bytes and freed when the
  pass ends). With or without overlap: it is not an overlap, only less work per group.
* **Early stop.** ``close()`` drains every gather posted and not consumed -- and the one ``take``
  handed out last, if the pass stopped before iterating it -- : it waits for it (bounded on gloo)
  and frees it. The helper thread is stopped first (early unpacks told to give up, its jobs
  finished), so no buffer is released while the helper still packs into or unpacks from it. When every rank stops at the same step (a consumer that raises on every
  rank alike, a driver that closes the pass on every rank), every rank posted the same gathers, so
  they all complete and the process groups stay aligned: the next pass works. When ranks stop at
  different points the groups cannot stay aligned, overlapped or not (a rank waits in a gather the
  other never posts): the waiting ranks raise ``SyncTimeoutError`` / ``PeerFailedError`` within
  ``timeout_s`` on gloo (their device backend's timeout otherwise) and the mesh's process groups
  must be rebuilt before the next pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .buffers import BufferPool
from .gather import BatchedGather
from .plan import Step

__all__ = ["GatherPipeline", "step_role"]


def step_role(step: Step) -> str:
    """``"gather"`` (a multi-rank batched gather: may be posted ahead), ``"sync"`` (a
    collective run in place: the lookahead stops there) or ``"free"`` (no collective)."""
    if step.kind == "full":
        return "sync"
    if step.kind == "batched" and step.mesh.size(step.axis) > 1:
        return "gather"
    return "free"


class GatherPipeline:
    """Posts the batched gathers of ``steps`` ahead of the consumer (see the module docstring).

    ``make(k)`` builds step ``k``'s ``BatchedGather`` (only called for ``"gather"`` steps, once).
    Use: at each step ``k`` call ``take(k)`` for a gather step (its gather, posted) and ``ahead(k)``
    before yielding the step's first tensor; ``close()`` in a ``finally``.
    """

    def __init__(
        self,
        steps: Sequence[Step],
        make: Callable[[int], BatchedGather],
        *,
        overlap: bool,
        prefetch_bytes: int | None,
    ) -> None:
        self.roles = [step_role(s) for s in steps]
        self.make = make
        self.overlap = overlap
        self.prefetch_bytes = prefetch_bytes
        self._posted: dict[int, BatchedGather] = {}  # posted, not yet taken
        self._built: dict[int, BatchedGather] = {}  # built by a lookahead that could not post it
        self._next = 0  # first step not yet considered for posting
        self.peak_ahead_bytes = 0
        self._pool = None  # CPU: the one helper thread that unpacks the next piece
        #: the gather ``take`` handed out last: the iterating ``for`` owns it once its iteration
        #: started, but if the pass fails before that (``ahead`` raising right after ``take``) no one
        #: else would ever drain it, so ``close`` does (draining twice is a no-op)
        self._taken: BatchedGather | None = None
        self._buffer_pools: tuple[BufferPool, BufferPool] | None = None  # CPU: send/gathered, recycled

    def take(self, k: int) -> BatchedGather:
        """Step ``k``'s gather, posted (now, if the lookahead did not reach it)."""
        gather = self._posted.pop(k, None)
        if gather is None:
            gather = self._gather(k).post()
            self._built.pop(k, None)
        self._next = max(self._next, k + 1)
        self._taken = gather
        return gather

    def ahead(self, k: int) -> None:
        """Post gathers after step ``k`` within the bound (nothing when overlap is off)."""
        if not self.overlap:
            return
        j = max(self._next, k + 1)
        held = sum(g.held_bytes for g in self._posted.values())
        while j < len(self.roles):
            role = self.roles[j]
            if role == "sync":
                break
            if role == "gather":
                if self._posted and self.prefetch_bytes is None:
                    break
                nxt = self._gather(j)
                if self._posted and held + nxt.held_bytes > self.prefetch_bytes:
                    break
                self._posted[j] = nxt.post()  # posted, then moved: a post that raises leaves it built (discarded)
                del self._built[j]
                held += nxt.held_bytes
                self.peak_ahead_bytes = max(self.peak_ahead_bytes, held)
            j += 1
        self._next = j
        # CPU: pack the gather after those already posted on the helper thread (a local copy, no
        # collective), so that posting it later costs the iterating thread nothing.
        while j < len(self.roles) and self.roles[j] == "free":
            j += 1
        if j < len(self.roles) and self.roles[j] == "gather":
            gather = self._gather(j)
            if gather.unpacker is not None:
                gather.pack_ahead(gather.unpacker)

    def _gather(self, k: int) -> BatchedGather:
        gather = self._built.get(k)
        if gather is None:
            gather = self._built[k] = self.make(k)
            if gather.device.type == "cpu":
                gather.pools = self._buffers(gather)
                if self.overlap:
                    gather.unpacker = self._unpacker()
                    gather.tail_hook = self._start_next_early
        return gather

    def _start_next_early(self) -> bool:
        """Queue the first unpack of the earliest gather posted ahead (it starts once that
        collective completed)."""
        if not self._posted:
            return True
        return self._posted[min(self._posted)].start_early()

    def _buffers(self, gather: BatchedGather) -> tuple[BufferPool, BufferPool]:
        if self._buffer_pools is None:  # send blocks, gathered buffers: each reused in its own role
            self._buffer_pools = (BufferPool(gather.stats), BufferPool(gather.stats))
        return self._buffer_pools

    def _unpacker(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-unpack")
        return self._pool

    def close(self) -> None:
        """Drain every gather posted and not consumed (bounded; errors are logged, not raised).

        Ownership, in this order: first every early unpack still waiting for a collective is told
        to give up and the helper thread is shut down (it finishes the packing or unpacking it
        holds), and only then are buffers released -- discarded, drained, given back to the pools,
        the pools freed. So no buffer is ever released, recycled or freed while the helper thread
        still writes into it or reads from it, whatever point the pass stopped at."""
        posted, self._posted = self._posted, {}
        built, self._built = self._built, {}
        taken, self._taken = self._taken, None
        try:
            for gather in [*([taken] if taken is not None else []), *posted.values()]:
                gather.stop_early()
            self._stop_helper()
            for gather in built.values():
                gather.discard()
            if taken is not None:
                taken.drain()  # a no-op when its own iteration drained it
            for k in sorted(posted):
                posted[k].drain()
        finally:
            self._stop_helper()
            if self._buffer_pools is not None:
                for pool in self._buffer_pools:
                    pool.close()
                self._buffer_pools = None

    def _stop_helper(self) -> None:
        """Wait until the helper thread finished every job it was given, then end it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
