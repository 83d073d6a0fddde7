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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..core.layouts.pieces import Piece, marker, whole_piece
from ..core.ground.stats import PassStats
from .gather import fallback_full, gather_device, local_of
from .plan import is_dtensor, is_member

__all__ = ["fsdp_pieces"]


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


def _box_of(src: Any, i: int, t) -> tuple[tuple[int, ...], bool] | None:
    """``_plain_box`` of entry ``i``, computed once per (global shape, mesh, placements): DTensor's
    placement arithmetic costs ~0.15 ms a parameter in Python, which a delta round would pay for
    every parameter, every round."""
    cache = src.__dict__.setdefault("_piece_boxes", {})
    key = (i, tuple(t.shape), id(t.device_mesh), tuple(t.placements))
    if key not in cache:
        cache[key] = _plain_box(t)
    return cache[key]


def _dim0_only(t, offsets: tuple[int, ...]) -> bool:
    """The local shard is a dim-0 slice (rows ``offsets[0]..``, every other dim whole)."""
    local = local_of(t)
    return all(o == 0 for o in offsets[1:]) and tuple(local.shape[1:]) == tuple(t.shape[1:])


def fsdp_pieces(src: Any, stats: PassStats, rank: int) -> Iterator[Piece]:
    """``src``'s pieces on this rank (module docstring), in metadata order, a ``marker`` for every
    name this rank holds nothing of."""
    all_tensors = src._resolve()
    tensors = src._entry_tensors(all_tensors)
    wds = src._out_dtypes
    merges = {} if src.lora is None else src._lora_items[0]
    for i, (e, t, wd) in enumerate(zip(src.entries, tensors, wds)):
        names = [e.name] if e.transform is None else [n for n, _ in e.transform.entries(e.name)]
        yield from _entry_pieces(src, e, t, wd, names, merges, all_tensors, stats, rank, i)


def _entry_pieces(src, e, t, wd, names, merges, all_tensors, stats, rank, i) -> Iterator[Piece]:
    """One entry's pieces in ``names`` order (its checkpoint names: one, or a transform's), a marker
    for each name no piece covers. The pieces are views of the local shard (or of the one gathered
    tensor), so holding an entry's pieces costs no memory beyond its cast."""
    items: list[Piece] = []
    full = None
    if not is_member(t):
        pass  # a DTensor on a mesh without this rank: its members answer
    elif merges and src._entry_item[i] in merges:
        full = src._merged_full(src._entry_item[i], all_tensors, stats)  # collective on every member
    elif not is_dtensor(t):
        if rank == 0:
            full = t.detach()  # the consumer casts
    else:
        box = _box_of(src, i, t)
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
