"""One ``mode="full"`` pass's units that move: each unit's TP shards brought point-to-point to its
sender, concatenated there into the HF tensors and yielded -- with overlap, posted ahead.

Invariants (``MegatronSource``'s module docstring states them for the whole pass):

* Posting order is the pairing order: every rank walks the plan's steps in order and posts each
  unit's sends or receives at that unit's step (``DenseUnits.post``); only the sender may post its
  receives earlier (``look_ahead``), still in plan order, so the transfers between any two ranks
  pair up as without overlap.
* Lookahead, on the sender only: after taking a unit, it posts the receives of the next steps that
  move anything (steps it holds whole move nothing and are looked past) while the units already
  posted ahead hold less than ``ahead_bytes`` of HF tensor bytes (``megatron/ahead.py`` says why a
  byte budget), never past a MoE layer's export (its transfers keep their place). Peers post each
  send at its own step, so a peer never has more than one cast shard out.
* On CPU the sender's concatenation of the units posted ahead runs on one helper thread
  (``ahead.SplitAhead``); a failed wait is raised at its unit's step.
* Memory is accounted in the pass's ``PassStats``: what a posted unit holds until its tensors are
  yielded, and the peak held ahead (``ahead_peak_bytes``). A pass stopped early waits out what it
  posted (``close``).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from ..core.comm.p2p import PostedGather
from ..core.ground.stats import PassStats
from .ahead import SplitAhead
from .plan import Unit
from .units import DenseUnits
from .whole_units import LocalStep, nbytes

__all__ = ["GatheredPass", "Step"]

#: one step of a pass: the unit, how rank 0 exports it whole (or None: it moves), and the MoE layer
#: whose export follows it (or None)
Step = tuple[Unit, LocalStep | None, int | None]


class GatheredPass:
    """The moving units of one ``mode="full"`` pass on this rank (module docstring).

    ``overlap``: post ahead (``look_ahead``); ``helper``: concatenate the units posted ahead on a
    helper thread (the sender, on CPU)."""

    def __init__(
        self,
        units: DenseUnits,
        steps: list[Step],
        stats: PassStats,
        *,
        overlap: bool,
        ahead_bytes: int,
        helper: bool,
        timeout_s: float,
    ) -> None:
        self._units, self._steps, self._stats = units, steps, stats
        self._overlap, self._ahead_bytes, self._timeout_s = overlap, ahead_bytes, timeout_s
        self._posted: dict[int, PostedGather] = {}  # step -> its transfer, posted ahead (overlap)
        self._split_ahead: SplitAhead | None = SplitAhead() if helper else None

    def export(self, k: int, unit: Unit) -> Iterator[tuple[str, torch.Tensor]]:
        """Step ``k``'s unit: its transfer (posted ahead, or posted now), the lookahead past it, then
        on its sender the HF tensors (concatenated by the helper, or here). Every rank of the
        sender's replica calls it at this step; the others send and yield nothing."""
        stats, split_ahead = self._stats, self._split_ahead
        mine = self._posted.pop(k, None) or self._units.post(unit, stats)
        self.look_ahead(k)
        done = split_ahead.take(k) if split_ahead is not None else None  # waited + concatenated
        pieces = mine.finish(self._timeout_s)  # bounded wait (nothing left if the helper waited)
        if split_ahead is not None:  # the sender, CPU: the units posted ahead on the helper
            for j in sorted(self._posted):
                split_ahead.start(j, self._posted[j], partial(self._units.concat, self._steps[j][0], stats=stats,
                                                              gather=self._posted[j]), self._timeout_s)
        copies = 0
        if pieces is not None or done is not None:
            outs, copies = done if done is not None else self._units.concat(unit, pieces, stats=stats)
            del pieces, done
            for name, out in zip(unit.names, outs):
                stats.yielded(nbytes(out.shape, out.dtype))
                yield name, out
            del outs
        stats.hold(-(mine.held_bytes + copies))
        del mine

    def look_ahead(self, k: int) -> None:
        """With overlap, on step ``k``'s sender only: post the receives of the next moving steps
        while what is posted ahead holds less than ``ahead_bytes`` (so less than ``ahead_bytes`` +
        one unit: a unit larger than the budget still goes ahead once what is before it is under
        the budget), never past a MoE layer's export."""
        units, steps, posted, stats = self._units, self._steps, self._posted, self._stats
        rank = units.topo.rank
        if not self._overlap or rank != units.dst(steps[k][0]) or steps[k][2] is not None:
            return
        held = sum(units.unit_bytes(steps[i][0]) for i in posted)
        j = k + 1
        while j < len(steps):
            unit, local, moe_layer = steps[j]
            if local is None and j not in posted and units.dst(unit) == rank:
                if held >= self._ahead_bytes:
                    return
                posted[j] = units.post(unit, stats)
                held += units.unit_bytes(unit)
                stats.ahead_peak_bytes = max(
                    stats.ahead_peak_bytes, sum(g.held_bytes for g in posted.values())
                )
            if moe_layer is not None:
                return
            j += 1

    def close(self) -> None:
        """End of the pass (early or not): stop the helper, then wait out what is still posted ahead
        (bounded by ``timeout_s``: every rank posted the same transfers) and release what it held."""
        if self._split_ahead is not None:
            self._split_ahead.close()
        for g in self._posted.values():  # a consumer stopped early: wait out what was posted ahead
            g.drain(self._timeout_s)
            self._stats.hold(-g.held_bytes)
