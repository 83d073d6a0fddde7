"""Rank 0's export of the Megatron units it holds whole: no communication, a flat loop.

At tp=1 every unit of rank 0's pipeline stage is whole on rank 0, and at any tp so are the replicated
ones (norms). Nothing then needs a peer, and an export of such a model is bound by per-tensor host
work, not by bytes (a device copies the bytes far faster than the host dispatches one op per tensor;
``docs/evidence.md`` has the figures). So everything that can be decided once is decided at
construction (``LocalStep``: the parameter, the rows kept, the layout split, the bytes it allocates)
and a pass runs detach / trim / cast / split per unit and nothing else (``WholePass``).

Units whose HF tensors are views of the parameter (every kind whose split does not copy -- column,
row, GLU halves, stacked rows, the vocabulary trim -- when the parameter is already in the wire dtype)
are split once, at construction: ``LocalStep.views`` holds their ``(name, view)`` pairs and a pass
yields them as they are. Nothing is computed per pass for them, so a pass's host work is the QKV
gathers, the batched cast and the yields. A view follows the parameter's values (same storage);
if the parameter's storage is replaced (``param.data = ...``, an offload), ``LocalStep.ptr`` no
longer matches ``param.data_ptr()`` and that pass splits the new storage as any other unit.

Casts of small tensors are batched (``precast``). A bf16 wire from a model that keeps its norms in
fp32 (megatron-core builds norm weights in fp32 unless ``Float16Module`` converts them) would
otherwise launch one cast kernel per norm -- a large share of a dense model's tensors, and more host
time than the rest of the pass. One multi-tensor copy into one new buffer replaces them; the result
is bitwise what the per-tensor casts give (a cast is elementwise). The batch is bounded
(``PRECAST_MAX_NUMEL`` per tensor, ``PRECAST_CAP_BYTES`` in all) and held until the pass ends.

Invariant: every output is contiguous and in the wire dtype, and no output aliases memory the model
could change without the consumer seeing it later than the yield (outputs are views of the
parameter's current storage, or fresh buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple

import torch

from ..core.ground.stats import PassStats
from ..core.layouts.tp import Layout

__all__ = [
    "LocalStep", "WholePass", "local_step", "with_views", "mark_precast", "nbytes", "precast",
    "PRECAST_MAX_NUMEL", "PRECAST_CAP_BYTES",
]

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
    #: ``(name, view of param)`` per HF tensor, split once at construction, when the layout's split
    #: of the parameter (already in the wire dtype) only makes views; else None
    views: tuple[tuple[str, torch.Tensor], ...] | None = None
    ptr: int = 0  # ``param.data_ptr()`` the views were made from
    total: int = 0  # sum of ``sizes``
    #: a ``precast`` step whose split returns its (contiguous, cast) input as its one HF tensor:
    #: the batched cast's piece is yielded as it is (norms)
    identity: bool = False


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` in ``dtype``."""
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
    names: Sequence[str] = (),
    **more: object,
) -> LocalStep:
    """The step for a unit of layout ``kind`` whose whole tensor is ``param`` (``piece_shape`` after
    the vocabulary trim to ``rows``), yielding ``out_shapes`` named ``names`` in ``dtype``."""
    piece = nbytes(piece_shape, dtype)
    cast = 0 if param.dtype == dtype else piece
    split = partial(kind.split, heads_per_group=heads_per_group, head_dim=head_dim, stack_rows=tuple(stack_rows), **more)
    copied = piece if kind.split_copies else 0
    sizes = tuple(nbytes(s, dtype) for s in out_shapes)
    if kind.shifts_values:  # the kind's own to_wire (values change) instead of a plain, batchable cast
        plain = split
        return LocalStep(param, rows, lambda t: plain(kind.to_wire(t, dtype)), piece + copied, sizes, param.dtype,
                         total=sum(sizes))
    step = LocalStep(param, rows, split, cast + copied, sizes, dtype, total=sum(sizes))
    return with_views(step, names) if names and not cast and not copied else step


def with_views(step: LocalStep, names: Sequence[str]) -> LocalStep:
    """``step`` with its ``views`` made from the parameter's current storage, if its split of the
    parameter makes contiguous views only (checked on the outputs, whatever the kind); else
    ``step`` without views."""
    param = step.param.detach()
    t = param if step.rows is None else param[: step.rows]
    with torch.no_grad():
        outs = step.split(t)
    base = param.untyped_storage().data_ptr()
    if len(outs) != len(names) or any(o.untyped_storage().data_ptr() != base or not o.is_contiguous() for o in outs):
        return step._replace(views=None)
    return step._replace(views=tuple(zip(names, outs)), ptr=step.param.data_ptr())


def mark_precast(steps: list[LocalStep | None], dtype: torch.dtype) -> list[LocalStep | None]:
    """``steps`` with ``precast`` set on the small casts to ``dtype``, in order, up to ``PRECAST_CAP_BYTES``."""
    total, out = 0, []
    for s in steps:
        if s is not None and s.dtype == dtype and s.param.dtype != dtype and s.rows is None and s.param.numel() <= PRECAST_MAX_NUMEL:
            size = s.param.numel() * dtype.itemsize
            if total + size <= PRECAST_CAP_BYTES:
                total += size
                probe = torch.empty(s.param.shape, dtype=dtype, device=s.param.device)
                outs = s.split(probe)
                same = len(outs) == 1 and outs[0].data_ptr() == probe.data_ptr() and outs[0].shape == probe.shape
                s = s._replace(precast=True, identity=same)
        out.append(s)
    return out


def precast(steps: list[LocalStep], dtype: torch.dtype) -> tuple[Iterator[torch.Tensor], int]:
    """The cast of every ``steps[i].param`` (all marked ``precast``), in order, and the bytes held.

    One new buffer in ``dtype``, split into one contiguous piece per parameter, filled by one
    ``torch._foreach_copy_`` (a cast where the dtypes differ; a few multi-tensor kernels) -- faster
    than a cast per tensor, and than a ``torch.cat`` of them cast once: ``cat`` of many inputs is
    host-bound itself. The buffer is new every pass: a yielded piece is never overwritten by a later pass.
    """
    sizes = [s.param.numel() for s in steps]
    flat = torch.empty(sum(sizes), dtype=dtype, device=steps[0].param.device)
    out = [p if s.param.dim() == 1 else p.view(s.param.shape) for p, s in zip(flat.split(sizes), steps)]
    with torch.no_grad():  # the sources are parameters; nothing here is part of a graph
        torch._foreach_copy_(out, [s.param for s in steps])
    return iter(out), flat.numel() * dtype.itemsize


class WholePass:
    """One pass over the units rank 0 holds whole (``LocalStep`` s), in the order the pass meets
    them: ``start`` runs the batched cast of the steps marked ``precast``; ``export`` yields one
    unit's HF tensors by the one of its three ways that applies; ``account`` adds what was yielded
    and held to the pass's stats when the pass ends (early or not)."""

    def __init__(self, precast_steps: list[LocalStep], dtype: torch.dtype) -> None:
        self._precast, self._dtype = precast_steps, dtype
        self._casts: Iterator[torch.Tensor] = iter(())
        self._precast_bytes = 0  # the batched cast's buffer, held until the pass ends
        self._held = 0  # the largest cast-and-split allocation of one unit
        self._tensors = self._bytes = 0

    def start(self) -> None:
        """The batched cast of every ``precast`` step (one buffer for the whole pass)."""
        if self._precast:
            self._casts, self._precast_bytes = precast(self._precast, self._dtype)

    def export(self, names: Sequence[str], step: LocalStep) -> Iterator[tuple[str, torch.Tensor]]:
        """One unit's HF tensors, named ``names``: its views split at construction (while the
        parameter's storage is the one they were made from), its piece of the batched cast (its split
        is the identity), or its cast and split now."""
        if step.views is not None and step.param.data_ptr() == step.ptr:
            return self._views(step)
        if step.identity:
            return self._cast_piece(names, step)
        return self._cast_and_split(names, step)

    def _views(self, step: LocalStep) -> Iterator[tuple[str, torch.Tensor]]:
        self._tensors += len(step.views)
        self._bytes += step.total
        yield from step.views

    def _cast_piece(self, names: Sequence[str], step: LocalStep) -> Iterator[tuple[str, torch.Tensor]]:
        self._tensors += 1
        self._bytes += step.total
        yield names[0], next(self._casts)

    def _cast_and_split(self, names: Sequence[str], step: LocalStep) -> Iterator[tuple[str, torch.Tensor]]:
        if step.precast:
            t = next(self._casts)
        else:
            t = step.param.detach()
            if step.rows is not None:
                t = t[: step.rows]
            if t.dtype != step.dtype:
                t = t.to(step.dtype)
        outs = step.split(t)
        del t
        self._held = max(self._held, step.extra)
        for name, out, size in zip(names, outs, step.sizes):
            self._tensors += 1
            self._bytes += size
            yield name, out
        del outs

    def account(self, stats: PassStats) -> None:
        """Add the tensors and bytes yielded, and the memory held, to ``stats`` (at the pass's end)."""
        stats.tensors += self._tensors
        stats.bytes += self._bytes
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, self._precast_bytes + self._held)
