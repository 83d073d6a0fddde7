"""Host gather buffers recycled within one pass (CPU gathers).

Why: a batched gather on CPU needs two scratch buffers -- this rank's send block and the gathered
``[n, block]`` buffer -- that nobody outside the source ever sees. Allocated fresh for every group,
each is new memory from the kernel (glibc maps large allocations, and any size once the mmap
threshold is lowered), so every byte is page-faulted and zeroed before gloo or the packing copy
writes it, several times the cost of the same copy into memory already touched (docs/evidence.md
has the measurement). The groups of one pass repeat the same sizes (one per decoder layer), so the buffers of
group ``k`` are what group ``k + 2`` needs: handing them back and taking them again turns a
per-group page-fault bill into a per-pass one. CUDA needs none of this (the caching allocator
already recycles, and stream semantics are its business), so only CPU gathers use a pool.

Invariants:

* A buffer is handed out to one holder at a time: ``take`` removes it from the idle list, ``give``
  puts it back only after the holder's last reader is done (the collective completed and every
  tensor was unpacked out of it -- the caller's contract).
* Memory is bounded and accounted. Idle buffers are counted in the pass's ``PassStats`` like
  buffers in use (``hold`` on ``give``, released on ``take``), so ``peak_extra_bytes`` includes
  them; holders account a buffer's whole capacity (``capacity(buf)``), not just the bytes they
  use. At most ``max_idle`` buffers stay idle; a request no idle buffer fits frees the idle buffers
  smaller than it before allocating, so the pool never keeps a set of small buffers and a large one
  side by side; ``close()`` frees every idle buffer at the end of the pass (the trainer gets its
  memory back between syncs).
* Contents are garbage: a holder writes every byte it reads (the send block is packed and padded,
  the gathered buffer is filled by the collective).
"""

from __future__ import annotations

import threading

import torch

from ..core.ground.stats import PassStats

__all__ = ["BufferPool", "capacity"]


def capacity(buf: torch.Tensor) -> int:
    """Bytes of the allocation behind ``buf`` (what holding it costs)."""
    return buf.untyped_storage().nbytes()


class BufferPool:
    """Idle uint8 host buffers of one pass, best fit first (see the module docstring)."""

    def __init__(self, stats: PassStats, *, max_idle: int = 2) -> None:
        self.stats = stats
        self.max_idle = max_idle
        self._idle: list[torch.Tensor] = []  # whole allocations, never views
        self._lock = threading.Lock()  # the CPU helper thread packs (takes) while the iterator gives
        self.taken = 0  # buffers handed out
        self.allocated = 0  # of them, new allocations (the rest were recycled)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on the host, in an idle buffer that fits (the smallest) or a
        new one. Its contents are undefined. The caller accounts ``capacity()`` of it."""
        with self._lock:
            self.taken += 1
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fits:
                buf = self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
                self.stats.hold(-buf.numel())
                return buf[:nbytes]
            small = [b for b in self._idle if b.numel() < nbytes]
            self._idle = [b for b in self._idle if b.numel() >= nbytes]
            freed = sum(b.numel() for b in small)
            del small
            if freed:
                self.stats.hold(-freed)
            self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Hand back a buffer from ``take`` whose holder is done with it (every reader finished)."""
        base = buf if buf.storage_offset() == 0 and buf.numel() == capacity(buf) else _whole(buf)
        with self._lock:
            self._idle.append(base)
            self.stats.hold(base.numel())
            if len(self._idle) > self.max_idle:
                smallest = self._idle.pop(min(range(len(self._idle)), key=lambda i: self._idle[i].numel()))
                self.stats.hold(-smallest.numel())

    def close(self) -> None:
        """Free every idle buffer (end of pass)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.stats.hold(-sum(b.numel() for b in idle))


def _whole(view: torch.Tensor) -> torch.Tensor:
    """The whole uint8 allocation behind ``view`` (a prefix view handed out by ``take``)."""
    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage(), 0, (capacity(view),))
