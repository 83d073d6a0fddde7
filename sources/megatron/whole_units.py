"""Rank 0's export of the Megatron units it holds whole: no communication, a flat loop.

At tp=1 every unit of rank 0's pipeline stage is whole on rank 0, and at any tp so are the replicated
ones (norms). Nothing then needs a peer, and an export of such a model is bound by per-tensor host
work, not by bytes: a Qwen3-1.7B-shaped model is 310 tensors and 3.2 GiB, which an H200 copies in
1.6 ms -- about 5 us per tensor. So everything that can be decided once is decided at construction
(``LocalStep``: the parameter, the rows kept, the layout split, the bytes it allocates) and a pass
runs detach / trim / cast / split per unit and nothing else.

Casts of small tensors are batched (``precast``). A bf16 wire from a model that keeps its norms in
fp32 (megatron-core builds norm weights in fp32 unless ``Float16Module`` converts them) would
otherwise launch one cast kernel per norm -- 113 of Qwen3-1.7B's 310 tensors, more host time than
the rest of the pass. One multi-tensor copy into one new buffer replaces them; the result is
bitwise what the per-tensor casts give (a cast is elementwise). The batch is bounded
(``PRECAST_MAX_NUMEL`` per tensor, ``PRECAST_CAP_BYTES`` in all) and held until the pass ends.

Invariant: every output is contiguous and in the wire dtype, and no output aliases memory the model
could change without the consumer seeing it later than the yield (outputs are views of the
parameter, or fresh buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple

import torch

from ..core.layout import Layout

__all__ = ["LocalStep", "local_step", "mark_precast", "precast", "PRECAST_MAX_NUMEL", "PRECAST_CAP_BYTES"]

#: Largest tensor (elements) whose cast is batched: a bigger cast is bound by bytes, not launches.
PRECAST_MAX_NUMEL = 1 << 20
#: Bound on the wire bytes one pass pre-casts (held until the pass ends).
PRECAST_CAP_BYTES = 64 << 20


class LocalStep(NamedTuple):
    """How rank 0 exports one unit it holds whole."""

    param: torch.Tensor
    rows: int | None  # vocabulary rows to keep (None: all)
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # layout split into the HF tensors
    extra: int  # bytes the cast and the split allocate, held until the unit's tensors are yielded
    sizes: tuple[int, ...]  # bytes of each HF tensor, in order
    dtype: torch.dtype  # the wire dtype of its HF tensors
    precast: bool = False  # its cast is done in the pass's batched cast (``precast``)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def local_step(
    param: torch.Tensor,
    *,
    kind: Layout,
    rows: int | None,
    piece_shape: Sequence[int],
    out_shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    heads_per_group: int,
    head_dim: int,
    stack_rows: tuple[int, ...] = (),
    **more: object,
) -> LocalStep:
    """The step for a unit of layout ``kind`` whose whole tensor is ``param`` (``piece_shape`` after
    the vocabulary trim to ``rows``), yielding ``out_shapes`` in ``dtype``."""
    piece = nbytes(piece_shape, dtype)
    cast = 0 if param.dtype == dtype else piece
    split = partial(kind.split, heads_per_group=heads_per_group, head_dim=head_dim, stack_rows=tuple(stack_rows), **more)
    copied = piece if kind.split_copies else 0
    sizes = tuple(nbytes(s, dtype) for s in out_shapes)
    if kind.shifts_values:  # the kind's own to_wire (values change) instead of a plain, batchable cast
        plain = split
        return LocalStep(param, rows, lambda t: plain(kind.to_wire(t, dtype)), piece + copied, sizes, param.dtype)
    return LocalStep(param, rows, split, cast + copied, sizes, dtype)


def mark_precast(steps: list[LocalStep | None], dtype: torch.dtype) -> list[LocalStep | None]:
    """``steps`` with ``precast`` set on the small casts to ``dtype``, in order, up to ``PRECAST_CAP_BYTES``."""
    total, out = 0, []
    for s in steps:
        if s is not None and s.dtype == dtype and s.param.dtype != dtype and s.rows is None and s.param.numel() <= PRECAST_MAX_NUMEL:
            size = s.param.numel() * dtype.itemsize
            if total + size <= PRECAST_CAP_BYTES:
                total += size
                s = s._replace(precast=True)
        out.append(s)
    return out


def precast(steps: list[LocalStep], dtype: torch.dtype) -> tuple[Iterator[torch.Tensor], int]:
    """The cast of every ``steps[i].param`` (all marked ``precast``), in order, and the bytes held.

    One new buffer in ``dtype``, split into one contiguous piece per parameter, filled by one
    ``torch._foreach_copy_`` (a cast where the dtypes differ; a few multi-tensor kernels). On an
    H200 this is 0.13 ms for Qwen3-1.7B's 113 fp32 norms, against 1.1 ms for a cast per tensor and
    0.8 ms for a ``torch.cat`` of them cast once -- ``cat`` of many inputs is host-bound itself.
    The buffer is new every pass: a yielded piece is never overwritten by a later pass.
    """
    sizes = [s.param.numel() for s in steps]
    flat = torch.empty(sum(sizes), dtype=dtype, device=steps[0].param.device)
    out = [p if s.param.dim() == 1 else p.view(s.param.shape) for p, s in zip(flat.split(sizes), steps)]
    with torch.no_grad():  # the sources are parameters; nothing here is part of a graph
        torch._foreach_copy_(out, [s.param for s in steps])
    return iter(out), flat.numel() * dtype.itemsize
