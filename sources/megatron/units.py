"""This rank's view of the plan's dense units: each unit's shard, wire dtype, vocabulary rows, sender,
and the point-to-point moves that bring a unit's TP shards to its sender.

A dense unit is one Megatron parameter that is not part of a MoE layer's experts (embedding,
attention, dense MLP, norms, output layer, MTP block). ``MegatronSource`` builds one ``DenseUnits`` at
construction and every pass reads it: ``mode="full"`` (``gather_to`` / ``post`` then ``concat``, or
``local_step`` for what rank 0 holds whole), ``mode="local"`` and the pieces protocol
(``megatron/pieces.py``).

Invariants:

* Everything but the moves is a pure function of the plan, the configs and this rank's coordinates:
  every rank computes the same senders, shard shapes and wire dtypes, so transfers pair up.
* A unit's sender (``dst``) gathers the TP shards of its stage in one model-parallel replica
  (``stage_ranks``: replica 0 -- rank 0's -- unless ``senders="owners"`` spread the stage's units
  over the replicas); only TP ranks whose shard holds something send (``senders_of``: one rank for a
  replicated kind, none for a vocabulary shard of padding only).
* A shard travels in the wire dtype, its vocabulary padding cut, contiguous (``shard``); what the
  moves hold beyond the model is accounted in the pass's ``PassStats`` by the caller's rules below.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.comm.p2p import PostedGather, Transfer, gather_to, post_gather
from ..core.comm.senders import Senders
from ..core.ground.stats import PassStats
from ..core.layouts.rows import vocab_rows
from ..core.layouts.tp import VOCAB
from .plan import Geometry, Unit
from .topology import Topology
from .walk import Bound
from .whole_units import LocalStep, local_step, nbytes

__all__ = ["DenseUnits", "unit_bytes"]


def unit_bytes(unit: Unit, dtype: torch.dtype) -> int:
    """Bytes of ``unit``'s HF tensors in wire dtype ``dtype`` (what its sender holds once concatenated)."""
    return sum(nbytes(shape, dtype) for shape in unit.shapes)


class DenseUnits:
    """This rank's dense units (module docstring).

    Args:
        topo: this rank's coordinates and the replicas' grids.
        geometry: the shapes read from ``hf_config`` (vocabulary, heads per group, head dim).
        layout_kw: the family's extra keyword arguments for its layout kinds.
        bound: plan key -> this rank's Megatron parameter (units of this rank's stage only).
        wire_dtypes: plan key -> the unit's wire dtype.
        senders: ``"rank0"`` or ``"owners"`` (``core/comm/senders.py``).
        unit_replica: plan key -> the replica that gathers and sends it (``senders="owners"``;
            a unit not listed: replica 0).
        device: where receive buffers live (the parameters' device).
        timeout_s: bound on every point-to-point wait.
    """

    def __init__(
        self,
        *,
        topo: Topology,
        geometry: Geometry,
        layout_kw: dict[str, Any],
        bound: dict[tuple, Bound],
        wire_dtypes: dict[tuple, torch.dtype],
        senders: Senders,
        unit_replica: dict[tuple, int],
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.topo = topo
        self.geometry = geometry
        self.layout_kw = layout_kw
        self.bound = bound
        self.wire_dtypes = wire_dtypes
        self.senders = senders
        self.unit_replica = unit_replica
        self.device = device
        self.timeout_s = timeout_s

    # ---- who sends, what each shard is ---------------------------------------------------------

    def dst(self, unit: Unit) -> int:
        """The global rank that sends ``unit``'s HF tensors (and gathers its TP shards): rank 0, or
        with ``senders="owners"`` the first rank of its stage in its replica."""
        return 0 if self.senders == "rank0" else self.stage_ranks(unit)[0]

    def stage_ranks(self, unit: Unit) -> tuple[int, ...]:
        """The TP ranks (in TP order) that gather ``unit`` for its sender: its stage in its replica."""
        return self.topo.stage_ranks(unit.stage, self.unit_replica.get(unit.key, 0))

    def senders_of(self, unit: Unit) -> tuple[int, ...]:
        """Global ranks whose shard of ``unit`` the sender needs, in TP order (empty shards dropped)."""
        ranks = self.stage_ranks(unit)
        if unit.kind.dim is None:  # every TP rank holds all of it (norms, duplicated linears)
            return ranks[:1]
        if unit.kind is VOCAB:
            return tuple(r for t, r in enumerate(ranks) if self.piece_rows(unit, t) > 0)
        return ranks

    def piece_rows(self, unit: Unit, tp_rank: int) -> int | None:
        """Rows of TP shard ``tp_rank`` that are real vocabulary (None: not a vocab unit)."""
        if unit.kind is not VOCAB:
            return None
        start, stop = vocab_rows(self.geometry.vocab, self.geometry.padded_vocab, self.topo.tp, tp_rank)
        return stop - start

    def piece_shape(self, unit: Unit, tp_rank: int) -> tuple[int, ...]:
        """The shape of TP shard ``tp_rank`` of ``unit`` as it travels (vocabulary padding cut)."""
        rows = self.piece_rows(unit, tp_rank)
        return unit.shard_shape if rows is None else (rows, *unit.shard_shape[1:])

    def geometry_kw(self, unit: Unit) -> dict[str, Any]:
        """The keyword arguments ``unit.kind``'s ``split`` / ``concat`` / ``boxes`` take."""
        return {
            "heads_per_group": self.geometry.heads_per_group,
            "head_dim": self.geometry.head_dim,
            "stack_rows": tuple(s[0] for s in unit.shapes),
            **self.layout_kw,
        }

    def unit_bytes(self, unit: Unit) -> int:
        """Bytes of ``unit``'s HF tensors in its wire dtype (what its sender holds once concatenated)."""
        return unit_bytes(unit, self.wire_dtypes[unit.key])

    def local_step(self, unit: Unit) -> LocalStep | None:
        """How this rank exports ``unit`` when it is its sender and alone holds all of it, else None
        (``megatron.whole_units``): every unit of its stage at tp=1, replicated ones (norms) at any tp."""
        topo = self.topo
        dst = self.dst(unit)
        if topo.rank != dst or unit.stage != topo.pp_rank or self.senders_of(unit) != (dst,) or unit.key not in self.bound:
            return None
        return local_step(
            self.bound[unit.key].param,
            kind=unit.kind,
            rows=self.piece_rows(unit, 0),
            piece_shape=self.piece_shape(unit, 0),
            out_shapes=unit.shapes,
            dtype=self.wire_dtypes[unit.key],
            names=unit.names,
            **self.geometry_kw(unit),
        )

    # ---- the moves -----------------------------------------------------------------------------

    def shard(self, unit: Unit, stats: PassStats) -> torch.Tensor:
        """This rank's shard of ``unit`` in the wire dtype, vocabulary padding cut, contiguous (a new
        tensor is held in ``stats`` until the caller releases it)."""
        param = self.bound[unit.key].param.detach()
        rows = self.piece_rows(unit, self.topo.tp_rank)
        if rows is not None:
            param = param[:rows]
        piece = unit.kind.to_wire(param, self.wire_dtypes[unit.key]).contiguous()
        if piece.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            stats.hold(piece.numel() * piece.element_size())
        return piece

    def _transfers(self, unit: Unit) -> list[Transfer]:
        stage_ranks = self.stage_ranks(unit)
        wd = self.wire_dtypes[unit.key]
        return [Transfer(src, self.piece_shape(unit, stage_ranks.index(src)), wd) for src in self.senders_of(unit)]

    def gather_to(self, unit: Unit, dst: int, stats: PassStats) -> list[torch.Tensor] | None:
        """Point-to-point gather of ``unit``'s shards to global rank ``dst`` (``p2p.gather_to``).

        Returns the shards in TP order on ``dst``; on a sender returns None after its send has
        completed (and released what its shard held). Every participant walks the plan in the same
        order, so sends and receives pair up."""
        rank = self.topo.rank
        transfers = self._transfers(unit)
        got = gather_to(
            transfers, dst, local=lambda i: self.shard(unit, stats), device=self.device,
            timeout_s=self.timeout_s, what=repr(unit.names[0]), stats=stats,
        )
        if got is None:
            if any(p.src == rank for p in transfers):
                stats.hold(-stats.held_bytes)
            return None
        stats.hold(sum(t.numel() * t.element_size() for t, p in zip(got, transfers) if p.src != rank))
        return got

    def post(self, unit: Unit, stats: PassStats) -> PostedGather:
        """``unit``'s gather to its sender, posted (``p2p.post_gather``); its ``held_bytes`` is the
        memory it holds until finished (receive buffers, shards cast for sending), already in ``stats``."""
        before = stats.held_bytes
        posted = post_gather(
            self._transfers(unit), self.dst(unit), local=lambda i: self.shard(unit, stats), device=self.device,
            what=repr(unit.names[0]), stats=stats,
        )
        stats.hold(posted.held_bytes)
        posted.held_bytes = stats.held_bytes - before
        return posted

    def concat(
        self, unit: Unit, pieces: list[torch.Tensor], *, stats: PassStats, gather: PostedGather | None = None
    ) -> tuple[tuple, int]:
        """``unit``'s HF tensors from its received shards, and the bytes of those that are copies
        (held from now on; outputs that are views of a shard are held already). With ``gather``
        (the helper, ``megatron/ahead.py``), shards no output is a view of are dropped at once and
        no longer counted: ahead of the unit being yielded its sender holds its shards or its outputs."""
        outs = unit.kind.concat(pieces, **self.geometry_kw(unit))
        have = {p.untyped_storage().data_ptr() for p in pieces}
        copies = sum(nbytes(o.shape, o.dtype) for o in outs if o.untyped_storage().data_ptr() not in have)
        stats.hold(copies)
        if gather is not None and copies and not any(o.untyped_storage().data_ptr() in have for o in outs):
            stats.hold(-gather.held_bytes)
            gather.held_bytes = 0
            gather.release_pieces()
        return outs, copies
