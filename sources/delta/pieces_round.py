"""A delta round diffed where the shard lives: the round of a source with ``iter_pieces()``.

The pieces protocol (``core/layouts/pieces.py``) gives each rank boxes of the checkpoint tensors it
answers for. Per group of tensors every rank diffs its boxes against its own snapshot of them, the
ranks exchange per-tensor counts (``exchange.py``) so that all agree on a transfer plan (skip /
sparse / whole) and on any refusal (NaN, a bad piece, pieces that do not tile a tensor) before a
value moves, then the senders send rank 0 only their changed elements and rank 0 assembles and
yields one ``Delta`` per changed tensor. So the trainer's links carry O(changed elements).

Invariants (``DeltaSource`` states the round's contract; these are how this half keeps it):

* Every rank runs the same collectives in the same order: one count exchange per group, then one
  gather of the senders' segments when any rank has one, whatever its own pieces held.
* A consumer that closes the round on rank 0 only stops rank 0's yields: it still finishes every
  group's exchanges, so its peers complete the round instead of timing out, and the round then
  raises ``GeneratorExit`` (the next round is an anchor).
* The snapshot becomes exactly what the round delivers (``Snapshots.commit_group`` per group); an
  interrupted group's pending snapshot is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..core.ground.logs import current_rank, get_logger
from ..core.ground.ranks import multi_rank
from ..core.layouts.pieces import Piece
from .diff import Changed, Snapshots, any_nan
from .exchange import BAD, BOXES, CHANGED, COLS, HELD, NAN, exchange_counts, pack, segment_sizes, unpack
from .records import Delta, DeltaError, DeltaStats

__all__ = ["PiecesRound"]

logger = get_logger(__name__)


def _comm_device() -> torch.device:
    """Where payloads travel: the default group's device (CPU for gloo)."""
    if multi_rank() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PiecesRound:
    """One round over ``source.iter_pieces()``: what it needs of its ``DeltaSource``, passed explicitly
    (the metadata and its index, the groups, this rank's snapshots, the wait bound)."""

    def __init__(self, source: WeightSource, metadata: list[ParamMeta], *, names: list[str],
                 index: dict[str, int], groups: list[tuple[int, int]], snapshots: Snapshots,
                 timeout_s: float) -> None:
        self.source = source
        self.metadata = metadata
        self.names = names
        self.index = index
        self.groups = groups
        self.snapshots = snapshots
        self.timeout_s = timeout_s

    def run(self, anchor: bool, whole_ok: bool, stats: DeltaStats) -> Iterator[Delta]:
        """The round (every rank, collectively): yields on rank 0 only, in metadata order."""
        rank = current_rank()
        multi = multi_rank()
        world = dist.get_world_size() if multi else 1
        metas = self.metadata
        items = iter(self.source.iter_pieces())
        ahead: list[Piece] = []
        draining = False

        def pull() -> Piece | None:
            if ahead:
                return ahead.pop()
            return next(items, None)

        try:
            for lo, hi in self.groups:
                # 1. this rank's pieces of tensors lo..hi-1, diffed against the snapshot
                changes: dict[int, list[Changed]] = {}
                mine: list[tuple[int, Piece]] = []
                # per tensor counts as Python lists (one tensor built per group: indexing a tensor
                # per tensor is a host call each, which a round pays per tensor)
                rows_l = [[0] * COLS for _ in range(hi - lo)]
                problem: str | None = None
                last = lo
                while True:
                    p = pull()
                    if p is None:
                        break
                    i = self.index.get(p.name)
                    if i is None:
                        problem = problem or f"the source yielded {p.name!r}, which its metadata does not declare"
                        continue
                    if i >= hi:
                        ahead.append(p)
                        break
                    if i < last:
                        problem = problem or f"{p.name!r} comes out of metadata order (after {metas[last].name!r})"
                        continue
                    last = i
                    if p.tensor is None:
                        continue
                    k = i - lo
                    why = _box_problem(p, metas[i])
                    if why is not None:
                        rows_l[k][BAD] = 1
                        problem = problem or why
                        continue
                    mine.append((i, p))
                # one diff for the group's pieces (``Snapshots.diff_group``), then its counts
                found = self.snapshots.diff_group(lo, [(p, metas[i].dtype) for i, p in mine], everything=anchor)
                nan = any_nan(found) if not anchor else any(ch.has_nan() for ch in found)
                for (i, p), ch in zip(mine, found):
                    row = rows_l[i - lo]
                    if nan and ch.has_nan():
                        row[NAN] = 1
                    changes.setdefault(i, []).append(ch)
                    row[CHANGED] += ch.count
                    row[HELD] += p.tensor.numel()
                    row[BOXES] += 1
                mine.clear()
                if problem is not None:
                    for row in rows_l:
                        row[BAD] = 1
                    logger.error("rank %d: DeltaSource: %s", rank, problem)
                rows = torch.tensor(rows_l, dtype=torch.int64).view(hi - lo, COLS)
                # 2. every rank's counts
                table = exchange_counts(rows, timeout_s=self.timeout_s, what=f"the delta counts of "
                                        f"{metas[lo].name!r}..") if multi else rows[None]
                stats.collective_bytes += rows.numel() * 8 * (world - 1) if multi else 0
                self._raise_for(table, lo, rank, problem, stats.round, self.names)
                self._check_tiling(table, lo, hi, rank)
                tab = table.tolist()  # [rank][tensor][column], read per tensor below
                totals = table[:, :, CHANGED].sum(0).tolist()
                # 3. the transfer plan: per tensor skip / sparse / whole, the same on every rank
                plan: list[str | None] = []
                for k in range(hi - lo):
                    m = metas[lo + k]
                    total = totals[k]
                    n = math.prod(m.shape)
                    if anchor:
                        plan.append("whole")
                    elif total == 0:
                        plan.append(None)
                    elif whole_ok and total * (4 + m.dtype.itemsize) >= n * m.dtype.itemsize:
                        plan.append("whole")
                    else:
                        plan.append("sparse")
                # 4. payloads to rank 0
                got = self._move(changes, plan, tab, lo, hi, rank, world, stats) if multi else {}
                # 5. the snapshot becomes what this round delivers
                self.snapshots.commit_group()
                # 6. rank 0 assembles and yields (unless its consumer closed the round: then it only
                #    finishes the exchanges, so peers complete the round instead of timing out)
                if rank == 0 and not draining:
                    cursors: dict[int, int] = {}
                    for k, how in enumerate(plan):
                        if how is None:
                            continue
                        i = lo + k
                        d = self._assemble(metas[i], how, changes.get(i, []), got, cursors, tab, k, whole_ok, world)
                        changes.pop(i, None)
                        stats.changed += totals[k]
                        stats.tensors += 1
                        stats.wire_bytes += d.nbytes
                        try:
                            yield d
                        except GeneratorExit:
                            draining = True
                            break
                        del d
                elif rank != 0:
                    for k, how in enumerate(plan):
                        if how is not None:
                            stats.changed += totals[k]
                            stats.tensors += 1
                changes.clear()
                got = {}
            rest = pull()
            if rest is not None:
                raise DeltaError(f"rank {rank}: DeltaSource: the source yielded {rest.name!r} after the last "
                                 "group (out of metadata order)")
            if draining:
                logger.warning("rank %d: delta round %d closed by its consumer: finished its exchanges without "
                               "yielding; the next round is an anchor", rank, stats.round)
                raise GeneratorExit
        finally:
            self.snapshots.drop_pending()
            close = getattr(items, "close", None)
            if callable(close):
                close()

    @staticmethod
    def _raise_for(table: torch.Tensor, lo: int, rank: int, problem: str | None, rnd: int, names: list[str]) -> None:
        """Raise on every rank for a NaN, a bad piece or a tiling error anywhere in this group."""
        bad = (table[:, :, BAD] > 0).nonzero().tolist()
        if bad:
            r, _ = bad[0]
            mine = f" ({problem})" if problem and r == rank else ""
            raise DeltaError(f"rank {rank}: DeltaSource round {rnd}: rank {r} yielded a piece that does not fit "
                             f"the metadata{mine}; no value of this group was sent")
        nan = (table[:, :, NAN] > 0).nonzero().tolist()
        if nan:
            r, k = nan[0]
            raise DeltaError(f"rank {rank}: DeltaSource round {rnd}: {names[lo + k]!r} has NaN among its new "
                             f"values (seen on rank {r}); vLLM's sparse apply would keep the old values there. "
                             "No value of this group was sent")

    def _move(self, changes: dict[int, list[Changed]], plan: list[str | None], table: list,
              lo: int, hi: int, rank: int, world: int, stats: DeltaStats) -> dict[int, torch.Tensor]:
        """Send this rank's segments to rank 0 / receive every rank's there: ``{rank: buffer}`` on 0."""
        from ..core.comm.p2p import Transfer
        from ..core.comm.p2p import gather_to
        from ..core.ground.stats import PassStats

        metas = self.metadata
        sizes = []
        for r in range(world):
            n = 0
            for k, how in enumerate(plan):
                if how is not None:
                    m = metas[lo + k]
                    n += segment_sizes(table[r][k], whole=how == "whole", ndim=len(m.shape),
                                       itemsize=m.dtype.itemsize)
            sizes.append(n)
        senders = [r for r in range(1, world) if sizes[r]]
        if not senders:
            return {}
        dev = _comm_device()
        mine: torch.Tensor | None = None
        if rank in senders:
            segs: list[torch.Tensor] = []
            for k, how in enumerate(plan):
                if how is not None:
                    pack(changes.get(lo + k, []), whole=how == "whole", full_shape=tuple(metas[lo + k].shape),
                         dtype=metas[lo + k].dtype, out=segs)
            mine = torch.cat([s.to(dev) for s in segs])
            assert mine.numel() == sizes[rank], (mine.numel(), sizes[rank])
            stats.collective_bytes += mine.numel()
        if rank != 0 and mine is None:
            return {}
        transfers = [Transfer(r, (sizes[r],), torch.uint8) for r in senders]
        out = gather_to(transfers, 0, local=lambda i: mine, device=dev, timeout_s=self.timeout_s,
                        what=f"delta values of {metas[lo].name!r}..", stats=PassStats())
        if rank != 0:
            return {}
        stats.collective_bytes += sum(sizes[r] for r in senders)
        return dict(zip(senders, out))

    def _check_tiling(self, table: torch.Tensor, lo: int, hi: int, rank: int) -> None:
        held = table[:, :, HELD].sum(0).tolist()
        for k, h in enumerate(held):
            n = math.prod(self.metadata[lo + k].shape)
            if h != n:
                raise DeltaError(
                    f"rank {rank}: DeltaSource: the pieces of {self.metadata[lo + k].name!r} cover {h} elements "
                    f"over all ranks, the tensor has {n} ({type(self.source).__name__}.iter_pieces must tile "
                    "each tensor exactly once)"
                )

    def _assemble(self, meta: ParamMeta, how: str, own: list[Changed], got: dict[int, torch.Tensor],
                  cursors: dict[int, int], table: list, k: int, whole_ok: bool, world: int) -> Delta:
        """Rank 0: tensor ``meta``'s delta from its own changes and every sender's segment
        (``cursors``: where each sender's buffer is read next)."""
        shape = tuple(meta.shape)
        parts: list[tuple[int, Any]] = []
        for r in range(1, world):
            buf = got.get(r)
            if buf is None:
                continue
            at = cursors.get(r, 0)
            at, seg = unpack(buf, at, table[r][k], whole=how == "whole", full_shape=shape, dtype=meta.dtype)
            cursors[r] = at
            parts.append((r, seg))
        if how == "whole":
            dev = own[0].values.device if own else (next(iter(got.values())).device if got else torch.device("cpu"))
            full = torch.empty(shape, dtype=meta.dtype, device=dev)
            boxes = [(tuple(c.piece.offsets), c.whole(meta.dtype)) for c in own]
            for _, seg in parts:
                boxes += seg
            for offsets, vals in boxes:
                full[tuple(slice(o, o + s) for o, s in zip(offsets, vals.shape))] = vals.to(dev)
            flat = full.view(-1)
            if whole_ok:
                return Delta(meta.name, None, flat, shape)
            return Delta(meta.name, torch.arange(flat.numel(), dtype=torch.int32, device=dev), flat, shape)
        from ..core.layouts.pieces import flat_indices

        idx = [flat_indices(c.pos, tuple(c.piece.offsets), tuple(c.piece.tensor.shape), shape).to(torch.int32)
               for c in own if c.count]
        vals = [c.values for c in own if c.count]
        for _, (ind, v) in parts:
            if ind.numel():
                idx.append(ind)
                vals.append(v)
        dev = vals[0].device
        if len(vals) == 1:  # one box (a whole tensor on one rank): no copy
            return Delta(meta.name, idx[0].to(dev), vals[0], shape)
        return Delta(meta.name, torch.cat([i.to(dev) for i in idx]), torch.cat([v.to(dev) for v in vals]), shape)


def _box_problem(p: Piece, meta: ParamMeta) -> str | None:
    t = p.tensor
    if t.dtype != meta.dtype and not (t.dtype.is_floating_point and meta.dtype.is_floating_point):
        return f"a piece of {p.name!r} is {t.dtype}, metadata declares {meta.dtype}"
    shape = tuple(meta.shape)
    if len(p.offsets) != len(shape) or t.dim() != len(shape) or any(
            o < 0 or o + s > f for o, s, f in zip(p.offsets, t.shape, shape)):
        return f"a piece of {p.name!r} at {tuple(p.offsets)} of shape {tuple(t.shape)} is outside {shape}"
    return None
