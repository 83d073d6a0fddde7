"""Moving one group's changes to rank 0: a counts exchange, then one byte buffer per rank.

Invariants:

* **Every rank learns every rank's counts** (one small all-gather on a bounded gloo group per
  group of tensors), so a NaN, a tiling error or a bad piece on any rank raises on every rank
  before that group's values move, and every rank derives the same transfer plan from the same
  table without further messages.
* **O(changed elements) on the trainer's links**: a rank sends rank 0 one buffer per group holding,
  per tensor, its changed elements' int32 flat indices and values (``sparse``) or, where whole
  tensors are cheaper or required (anchors), its boxes' headers and values (``whole``). Ranks with
  nothing to send send nothing. Segments are 8-byte aligned so rank 0 views them in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core.layouts.pieces import flat_indices
from ..core.comm.waits import bounded_group, group_ranks, wait_bounded
from .diff import Changed

__all__ = ["COLS", "NAN", "BAD", "exchange_counts", "pack", "segment_sizes", "unpack"]

#: counts table columns, per rank and tensor: changed elements, elements held, boxes held, NaN seen,
#: a bad piece (wrong dtype / outside the tensor / out of order) seen
CHANGED, HELD, BOXES, NAN, BAD = range(5)
COLS = 5


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def exchange_counts(rows: torch.Tensor, *, timeout_s: float, what: str) -> torch.Tensor:
    """``[world, tensors, COLS]``: every rank's ``rows`` (bounded all-gather on a gloo group)."""
    ranks = group_ranks()
    group = bounded_group(ranks, timeout_s=timeout_s, purpose="pass")
    out = [torch.empty_like(rows) for _ in ranks]
    work = dist.all_gather(out, rows, group=group, async_op=True)
    wait_bounded(work, ranks=ranks, what=what, timeout_s=timeout_s)
    return torch.stack(out)


def segment_sizes(row: Sequence[int], *, whole: bool, ndim: int, itemsize: int) -> int:
    """Bytes one rank sends for one tensor, from its counts row (the same rule on both ends)."""
    if whole:
        return 16 * ndim * int(row[BOXES]) + _pad8(int(row[HELD]) * itemsize) if row[HELD] else 0
    c = int(row[CHANGED])
    return _pad8(4 * c) + _pad8(c * itemsize) if c else 0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def pack(changes: list[Changed], *, whole: bool, full_shape: tuple[int, ...], dtype: torch.dtype,
         out: list[torch.Tensor]) -> None:
    """Append this rank's segments for one tensor to ``out`` (``segment_sizes`` bytes)."""
    dev = changes[0].values.device if changes else torch.device("cpu")

    def pad(n: int) -> None:
        if n % 8:
            out.append(torch.zeros(8 - n % 8, dtype=torch.uint8, device=dev))

    if whole:
        ndim = len(full_shape)
        if not changes:
            return
        head = torch.tensor([list(c.piece.offsets) + list(c.piece.tensor.shape) for c in changes],
                            dtype=torch.int64).reshape(-1)
        out.append(_bytes(head.to(dev)))
        n = 0
        for c in changes:
            v = c.whole(dtype).reshape(-1)
            out.append(_bytes(v))
            n += v.numel() * v.element_size()
        pad(n)
        assert head.numel() == 2 * ndim * len(changes)
        return
    idx = [flat_indices(c.pos, tuple(c.piece.offsets), tuple(c.piece.tensor.shape), full_shape)
           for c in changes if c.count]
    if not idx:
        return
    ind = torch.cat(idx).to(torch.int32)
    out.append(_bytes(ind))
    pad(ind.numel() * 4)
    vals = torch.cat([c.values for c in changes if c.count])
    out.append(_bytes(vals))
    pad(vals.numel() * vals.element_size())


def unpack(buf: torch.Tensor, at: int, row: Sequence[int], *, whole: bool, full_shape: tuple[int, ...],
           dtype: torch.dtype) -> tuple[int, list[tuple[tuple[int, ...], torch.Tensor]] | tuple[torch.Tensor, torch.Tensor]]:
    """Read one rank's segment for one tensor at byte ``at`` of ``buf``: ``(next at, boxes)`` for
    ``whole`` (each ``(offsets, values shaped as the box)``), else ``(next at, (indices, values))``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if whole:
        ndim, nbox = len(full_shape), int(row[BOXES])
        head = buf[at: at + 16 * ndim * nbox].view(torch.int64).view(nbox, 2, ndim).tolist() if ndim else [[[], []]] * nbox
        at += 16 * ndim * nbox
        boxes = []
        start = at
        for offsets, shape in head:
            n = math.prod(shape) * itemsize
            boxes.append((tuple(offsets), buf[at: at + n].view(dtype).view(tuple(shape))))
            at += n
        return start + _pad8(at - start), boxes
    c = int(row[CHANGED])
    ind = buf[at: at + 4 * c].view(torch.int32)
    at += _pad8(4 * c)
    vals = buf[at: at + c * itemsize].view(dtype)
    return at + _pad8(c * itemsize), (ind, vals)
