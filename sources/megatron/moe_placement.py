"""Who holds, and who sends, each tensor of a Megatron model's MoE layers.

Invariants:

* One exchange per model, cached (``exchange``): every rank's coordinates (``Coords``: rank, pipeline,
  tensor, expert and expert-tensor parallel ranks) and the MoE layers it holds, gathered over the
  control group. Afterwards every rank computes the same holder of every tensor, with no collective.
  Collective: every rank calls it, in the same order (the exporter's first export, its ``plan_owners``
  or the pieces protocol's first pass -- whichever comes first).
* A tensor's holder (``holder``) is the lowest global rank with the wanted coordinates on the
  layer's pipeline stage: the one in rank 0's model-parallel replica (coordinates are sorted by
  rank), the copy the exporter reads.
* Senders (``sender``): rank 0 for everything, unless ``plan_owners`` (``senders="owners"``) chose
  per layer and per expert-parallel rank; ``core/comm/senders.py`` says why each rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..core.ground.errors import UnmappedParameterError
from ..core.ground.stats import PassStats

__all__ = ["Coords", "MoEPlacement"]


@dataclass(frozen=True)
class Coords:
    """One rank's Megatron coordinates (what the plan needs to find a tensor's holder)."""

    rank: int
    pp: int
    tp: int
    ep: int
    etp: int

    @staticmethod
    def mine() -> Coords:
        from megatron.core import parallel_state as ps

        return Coords(
            rank=dist.get_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            tp=ps.get_tensor_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_rank(),
        )


class MoEPlacement:
    """The holders and senders of one model's MoE tensors (module docstring).

    ``local_layers``: the MoE layers this rank holds a module of; ``ep`` / ``experts_per_rank``:
    expert parallelism (global expert ``e`` lives on expert-parallel rank ``e // experts_per_rank``)."""

    def __init__(self, local_layers: Iterable[int], *, ep: int, experts_per_rank: int) -> None:
        self._local = list(local_layers)
        self._ep = ep
        self._experts_per_rank = experts_per_rank
        self._coords: list[Coords] | None = None
        self._stage_of: dict[int, int] | None = None
        #: ``senders="owners"`` (``plan_owners``): layer -> its stage's sender (router, shared experts,
        #: fused experts), and (layer, ep rank) -> the rank sending those experts.
        self._layer_dst: dict[int, int] = {}
        self._expert_dst: dict[tuple[int, int], int] = {}
        #: (layer, ep rank) -> the rank whose experts go to ``_expert_dst`` (expert TP 1, ``plan_owners``)
        self._expert_src: dict[tuple[int, int], int] = {}

    # -- the one exchange -------------------------------------------------------------------------
    def exchange(self, stats: PassStats) -> None:
        """Every rank's coordinates and MoE layers (two ``all_gather_object`` on the control group,
        counted in ``stats``); a no-op once done. Collective: every rank, same order."""
        if self._coords is not None:
            return
        from ..core.check.stream import control_group

        mine = Coords.mine()
        coords: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(coords, mine, group=control_group())
        stats.collectives += 1
        stage_of: dict[int, int] = {}
        for lay in self._local:
            stage_of[lay] = mine.pp
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(self._local), group=control_group())
        stats.collectives += 1
        for c, layers in zip(coords, gathered):
            for lay in layers:
                stage_of.setdefault(lay, c.pp)
        self._coords, self._stage_of = coords, stage_of

    def coords_of(self, rank: int) -> Coords:
        """``rank``'s coordinates (after ``exchange``)."""
        assert self._coords is not None, "MoEPlacement.exchange() has not run"
        return self._coords[rank]

    def stage_of(self, layer: int) -> int:
        """The pipeline stage holding MoE layer ``layer`` (after ``exchange``)."""
        assert self._stage_of is not None, "MoEPlacement.exchange() has not run"
        return self._stage_of[layer]

    def holder(self, layer: int, **want: int) -> int:
        """The lowest global rank on ``layer``'s stage whose coordinates match ``want`` (e.g.
        ``ep=k, etp=r``; none: the layer's first rank) -- the copy the exporter reads."""
        assert self._coords is not None and self._stage_of is not None
        if layer not in self._stage_of:
            raise UnmappedParameterError(f"MoE layer {layer} is held by no rank (expected from Megatron config)")
        stage = self._stage_of[layer]
        for c in self._coords:  # sorted by rank: the lowest rank is in rank 0's replica
            if c.pp == stage and all(getattr(c, k) == v for k, v in want.items()):
                return c.rank
        raise RuntimeError(f"no rank holds layer {layer} with coordinates {want}")

    # -- who sends what (``senders="owners"``; default: rank 0 sends everything) -------------------
    def plan_owners(self, stage_of: dict[int, int], topo: Any, *, spread: bool) -> None:
        """Choose the sender of every MoE tensor (``core/comm/senders.py`` says why each rule):

        * router, its biases, shared experts and gate: replica 0's stage sender (the stage's first
          rank), gathered from its TP peers as before;
        * routed experts of EP rank ``k`` with ``spread`` (expert TP 1, per-expert layout): the lowest
          rank holding them that is a stage sender of its own replica (``topo.replicas``: its TP
          group's first rank), so experts leave from where they live; when every holder is another
          rank's TP peer, the lowest holder sends them to its own replica's stage sender -- the
          sender it already serves, so it serves one sender only.
        * without ``spread`` (expert TP > 1, or the fused layout: one tensor for all experts):
          replica 0's stage sender gathers them, as with ``senders="rank0"``.

        Needs ``exchange`` first; no collective of its own."""
        assert self._coords is not None
        replica_of = {r: i for i, g in enumerate(topo.replicas) for row in g for r in row}
        for layer, stage in stage_of.items():
            first = topo.stage_ranks(stage)[0]
            self._layer_dst[layer] = first
            for k in range(self._ep):
                if not spread:
                    self._expert_dst[(layer, k)] = first
                    continue
                holders = [c.rank for c in self._coords if c.pp == stage and c.ep == k and c.etp == 0]
                senders = [h for h in holders if topo.stage_ranks(stage, replica_of[h])[0] == h]
                src = senders[0] if senders else holders[0]
                self._expert_dst[(layer, k)] = topo.stage_ranks(stage, replica_of[src])[0]
                self._expert_src[(layer, k)] = src

    def sender(self, layer: int, expert: int = -1) -> int:
        """The rank that sends ``layer``'s tensor (``expert``: a routed expert's; -1: the rest)."""
        if expert < 0:
            return self._layer_dst.get(layer, 0)
        return self._expert_dst.get((layer, expert // self._experts_per_rank), self._layer_dst.get(layer, 0))

    def expert_source(self, layer: int, ep_rank: int) -> int | None:
        """The rank ``plan_owners`` chose to send expert-parallel rank ``ep_rank``'s experts of
        ``layer`` from (expert TP 1), or None: the holder (``holder``) sends them."""
        return self._expert_src.get((layer, ep_rank))
