"""Pieces: a rank's share of the checkpoint tensors, in checkpoint coordinates, without a gather.

A source that can say *where* each of its local shards sits inside the full Hugging Face tensor lets
a stream transform work where the shard lives instead of on gathered tensors: ``DeltaSource``
diffs each piece against a snapshot of the same piece on the rank that owns it, so the trainer's
collectives carry only the changed elements (``sources/delta/``).

The protocol (``iter_pieces()``, implemented by ``FSDPSource`` and ``MegatronSource``):

* Called on **every** rank, collectively. Each rank yields, for **every** metadata name and in
  metadata order, the ``Piece`` s of it that it answers for -- or one ``marker(name)`` (no tensor)
  when it answers for none. So every rank passes every name at the same point of its stream, and a
  consumer that runs its own collectives at name boundaries (``DeltaSource``'s exchanges) meets its
  peers there whatever the source gathers in between.
* Over all ranks, the pieces of each metadata name **tile its full tensor exactly once**: no element
  is covered twice (replicas -- HSDP's replicate axis, TP ranks holding a replicated norm, DP
  replicas of a Megatron model -- answer from one rank only) and none is left out.
* ``tensor`` holds the block's values as a dense pass would send them (shifted, permuted,
  vocabulary-trimmed), **in the wire dtype** the metadata declares -- or, for a floating tensor, in
  a floating dtype whose plain elementwise cast (``.to(wire dtype)``) gives exactly those bytes (an
  FSDP shard in its fp32 master dtype): the consumer casts, into memory it reuses. Any strides. It may alias the model's storage, and stays valid until the pass ends (a source
  never reuses a piece's memory within a pass); the consumer never writes to it.
* **Stable**: a rank yields the same ``(name, offsets, shape)`` every pass for the same model, so a
  consumer can keep per-piece state (a snapshot) between passes.
* A source may run collectives inside ``iter_pieces`` (a fallback gather for a layout it cannot cut
  into blocks: then one rank yields the whole tensor as one piece, the others a marker) only while
  producing the first item of a name, and every rank runs the same ones there; it must not depend
  on the consumer's own collectives between items.

A block is a box: ``offsets[d] <= i_d < offsets[d] + tensor.shape[d]`` in every dim ``d``. Layouts
whose shard is not one box (a TP rank's ``[q_r; k_r; v_r]`` rows of a flat ``[q; k; v]``) yield one
piece per box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple, Protocol, runtime_checkable

import torch

__all__ = ["Piece", "PiecesSource", "has_pieces", "marker", "whole_piece", "flat_indices", "piece_flat_range"]


class Piece(NamedTuple):
    """One box of checkpoint tensor ``name``: its start in the full tensor and its values
    (``tensor`` None: a marker -- this rank holds nothing of ``name``)."""

    name: str
    offsets: tuple[int, ...]
    tensor: torch.Tensor | None


@runtime_checkable
class PiecesSource(Protocol):
    """A ``WeightSource`` that also yields its rank's pieces, as this module's docstring states.

    The one declaration of the protocol: a stream transform asks ``has_pieces(source)``, a source
    implements ``iter_pieces`` (``FSDPSource``, ``MegatronSource``), and nothing probes for it in
    any other way."""

    def iter_pieces(self) -> Iterator[Piece]: ...


def has_pieces(source: object) -> bool:
    """Whether ``source`` implements the pieces protocol (its class defines ``iter_pieces``)."""
    return callable(getattr(type(source), "iter_pieces", None))


def marker(name: str) -> Piece:
    """This rank passes ``name`` holding nothing of it."""
    return Piece(name, (), None)


def whole_piece(name: str, tensor: torch.Tensor) -> Piece:
    """The whole tensor as one piece (offsets all zero)."""
    return Piece(name, (0,) * tensor.dim(), tensor)


def piece_flat_range(offsets: tuple[int, ...], shape: tuple[int, ...], full_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` of the flat indices a box covers when they are one contiguous run of the full
    tensor (the box spans every dim after its first non-trivial one fully: a dim-0 slice, a whole
    tensor, one expert of a fused stack); None otherwise."""
    if len(offsets) != len(full_shape) or len(shape) != len(full_shape):
        raise ValueError(f"piece of rank {len(shape)} at offsets {offsets} in a tensor of shape {full_shape}")
    if not full_shape:
        return (0, 1)
    # leading dims where the box has extent 1, then one dim of any extent, then full trailing dims
    d = 0
    while d < len(shape) - 1 and shape[d] == 1:
        d += 1
    if any(offsets[k] != 0 or shape[k] != full_shape[k] for k in range(d + 1, len(shape))):
        return None
    strides = [math.prod(full_shape[k + 1:]) for k in range(len(full_shape))]
    start = sum(o * s for o, s in zip(offsets, strides))
    return start, start + math.prod(shape)


def flat_indices(local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...],
                 full_shape: tuple[int, ...]) -> torch.Tensor:
    """Flat indices into the full tensor (int64) of the box elements at row-major positions ``local``
    (int64, 1-D) of a box of ``shape`` starting at ``offsets``."""
    run = piece_flat_range(offsets, shape, full_shape)
    if run is not None:
        return local + run[0] if run[0] else local
    out = torch.zeros_like(local)
    rest = local
    for d in range(len(shape) - 1, -1, -1):
        coord = rest % shape[d] if d else rest
        rest = rest // shape[d]
        out += (coord + offsets[d]) * math.prod(full_shape[d + 1:])
    return out
