"""``FSDPSource.iter_pieces``: each rank's FSDP shard as boxes of the checkpoint tensors, no gather.

The protocol is ``core/layouts/pieces.py``'s. How an ``FSDPSource`` entry becomes pieces:

* **A DTensor with plain placements** (FSDP2 ``Shard(0)``, HSDP ``(Replicate, Shard(0))``, any mix
  of ``Shard``/``Replicate``): the local shard, cast to the wire dtype, is the box DTensor itself
  places it at (``compute_local_shape_and_global_offset``: ``torch.chunk`` rows, uneven shards
  included). Replicas answer once: the rank whose coordinate is 0 on every ``Replicate`` axis, in
  the copy of the mesh that holds global rank 0 (a sub-mesh that does not span the world is a
  replica group of the tensor, like ``dtensor_layout`` says). No collective.
* **A fused-expert entry** (a transform with ``pieces``, e.g. ``experts.ExpertTransform``) sharded on
  dim 0 only: the transform cuts the local expert slice into the boxes of its checkpoint tensors
  (whole per-expert tensors, or the slice of the fused stack). No collective.
* **A plain tensor** (not sharded; ignored or world-size-1 parameters): the whole tensor, from rank 0.
* **Everything else** -- ``_StridedShard`` (FSDP+TP), ``Partial``, a LoRA-merged base weight, a
  transform without ``pieces`` or on a shard not along dim 0 -- is gathered in full by the same
  collective ``iter_local`` uses (``fallback_full`` / the LoRA merge), on every rank of its mesh in
  entry order, and rank 0 yields the result whole.

Values are exactly what ``iter_full`` sends for those elements once cast to the wire dtype: boxes of
the local shard are yielded in the parameter's own dtype and the consumer casts them (casting is
elementwise, so cast-then-cut equals cut-then-cast); gathered tensors are already in the wire dtype.

What the producer reads of the source is exactly ``FSDPPiecesView``: the source builds it and hands
it over, so this module depends on no private member of ``FSDPSource``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core.ground.stats import PassStats
from ..core.hf.naming import CheckpointEntry
from ..core.layouts.pieces import Piece, marker, whole_piece
from .lora_items import LoraItems
from .plan import is_dtensor, is_member
from .shards import fallback_full, gather_device, local_of

__all__ = ["FSDPPiecesView", "fsdp_pieces"]


@dataclass(frozen=True)
class FSDPPiecesView:
    """What ``fsdp_pieces`` needs of an ``FSDPSource``, handed over explicitly.

    ``entries``: the checkpoint entries, in metadata order. ``out_dtypes``: each entry's wire dtype.
    ``resolve()``: every gathered item's tensor as registered now (FSDP2 re-registers parameters,
    so it is called afresh each pass). ``lora``: a PEFT model's items (entries among them, which go
    out LoRA-merged), or None. ``boxes``: this view's cache of ``_plain_box`` results, kept across
    passes for as long as the source keeps the view.
    """

    entries: Sequence[CheckpointEntry]
    out_dtypes: Sequence[torch.dtype]
    resolve: Callable[[], list[torch.Tensor]]
    lora: LoraItems | None = None
    boxes: dict[tuple, tuple[tuple[int, ...], bool] | None] = field(default_factory=dict, compare=False, repr=False)

    def box_of(self, i: int, t) -> tuple[tuple[int, ...], bool] | None:
        """``_plain_box`` of entry ``i``, computed once per (global shape, mesh, placements):
        DTensor's placement arithmetic runs in Python, which a delta round would otherwise pay for
        every parameter, every round."""
        key = (i, tuple(t.shape), id(t.device_mesh), tuple(t.placements))
        if key not in self.boxes:
            self.boxes[key] = _plain_box(t)
        return self.boxes[key]


def _plain_box(t) -> tuple[tuple[int, ...], bool] | None:
    """``(offsets, answers)`` of this rank's local shard of DTensor ``t`` with only ``Shard`` /
    ``Replicate`` placements: where DTensor places it, and whether this rank is the one replica that
    answers for it. None for other placements (``_StridedShard``, ``Partial``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(p) not in (Shard, Replicate) for p in t.placements):
        return None
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    answers = 0 in mesh.mesh.flatten().tolist() and all(
        c == 0 for c, p in zip(coord, t.placements) if type(p) is Replicate
    )
    _, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return tuple(int(o) for o in offsets), answers


def _dim0_only(t, offsets: tuple[int, ...]) -> bool:
    """The local shard is a dim-0 slice (rows ``offsets[0]..``, every other dim whole)."""
    local = local_of(t)
    return all(o == 0 for o in offsets[1:]) and tuple(local.shape[1:]) == tuple(t.shape[1:])


def fsdp_pieces(view: FSDPPiecesView, stats: PassStats, rank: int) -> Iterator[Piece]:
    """The source's pieces on this rank (module docstring), in metadata order, a ``marker`` for every
    name this rank holds nothing of."""
    all_tensors = view.resolve()
    tensors = all_tensors if view.lora is None else view.lora.entry_tensors(all_tensors)
    for i, (e, t, wd) in enumerate(zip(view.entries, tensors, view.out_dtypes)):
        names = [e.name] if e.transform is None else [n for n, _ in e.transform.entries(e.name)]
        yield from _entry_pieces(view, e, t, wd, names, all_tensors, stats, rank, i)


def _entry_pieces(view: FSDPPiecesView, e: CheckpointEntry, t, wd: torch.dtype, names: list[str],
                  all_tensors: list[torch.Tensor], stats: PassStats, rank: int, i: int) -> Iterator[Piece]:
    """One entry's pieces in ``names`` order (its checkpoint names: one, or a transform's), a marker
    for each name no piece covers. The pieces are views of the local shard (or of the one gathered
    tensor), so holding an entry's pieces costs no memory beyond its cast."""
    items: list[Piece] = []
    full = None
    merged = None if view.lora is None else view.lora.merged_item(i)
    if not is_member(t):
        pass  # a DTensor on a mesh without this rank: its members answer
    elif merged is not None:
        full = view.lora.merged_full(merged, all_tensors, view.out_dtypes, stats)  # collective on every member
    elif not is_dtensor(t):
        if rank == 0:
            full = t.detach()  # the consumer casts
    else:
        box = view.box_of(i, t)
        if box is not None and (e.transform is None or (
                hasattr(e.transform, "pieces") and _dim0_only(t, box[0]))):
            offsets, answers = box
            if answers:
                local = local_of(t)  # in its own dtype: the consumer casts (core/layouts/pieces.py)
                if e.transform is None:
                    items.append(Piece(e.name, offsets, local))
                else:
                    items += [Piece(n, tuple(off), block) for n, off, block in e.transform.pieces(e.name, local, offsets[0])]
        else:
            full = fallback_full(t, wd, gather_device(t.device_mesh), stats)  # every member of the mesh
    if full is not None and rank == 0:
        if e.transform is None:
            items.append(whole_piece(e.name, full))
        else:
            items += [whole_piece(n, o) for n, o in e.transform.apply(e.name, full)]
    del full
    if len(names) == 1:
        yield from items or [marker(names[0])]
        return
    by_name: dict[str, list[Piece]] = {}
    for p in items:
        by_name.setdefault(p.name, []).append(p)
    items.clear()
    for n in names:
        yield from by_name.pop(n, None) or [marker(n)]
