"""``DeltaSource``: any source's stream as the elements that changed since the receiver's last round.

Between two RL syncs most bf16 weights are bit-identical (an update below half a bf16 step rounds
away). ``DeltaSource(source)`` turns each sync into a round of patches in checkpoint coordinates --
vLLM's (0.33, 0.34) ``sparse_nccl`` ``SparseWeightPatch(name, indices, values, full_shape)`` -- holding exactly
the elements whose wire bytes changed since the last delivered round.

Invariants:

* **Exact, always.** Elements are compared bitwise in the wire dtype (``delta/diff.py``). A round's
  patches hold exactly the changed elements (no whole tensor because one element moved, nothing
  missed); a round where nothing changed yields nothing. The first round, any round after
  ``reset()``, every round after one that did not complete (an exception on any rank, a consumer
  failure, a generator closed early) and every ``anchor_every``-th round are **anchors**: every
  element of every tensor, which brings a receiver in any state to the exact current weights.
  Whether a round is an anchor is agreed by every rank before it starts.
* **Diff where the shard lives.** A source with ``iter_pieces()`` (``FSDPSource``,
  ``MegatronSource``; protocol in ``core/layouts/pieces.py``) is diffed on the rank that owns each shard,
  against that rank's snapshot of it; per group of tensors (``group_bytes`` of full tensors) the
  ranks exchange counts, then send rank 0 only their changed elements (``delta/exchange.py``), so
  the trainer's own links carry O(changed elements). Any other source (vLLM's ``ModuleSource``,
  ``SafetensorsSource``, ``FP8Source(...)``) is diffed on rank 0 after its own ``iter_full`` pass.
* **Bounded memory**: the snapshot is one copy of this rank's pieces in the wire dtype (2 bytes per
  element of its shard for bf16), on the pieces' device (``snapshot="device"``) or in host memory
  (``"cpu"``); it changes only with what a round delivers. A round holds one group at a time.
* **Refused before bytes move, on every rank**: a tensor of 2^31 or more elements (vLLM's indices
  are int32), at construction; a NaN among a group's new values (vLLM's apply reads NaN as
  "unchanged" and would keep the old value), a piece outside its tensor or in the wrong dtype, or
  pieces that do not tile a tensor exactly once, at that group's exchange.
* A round **completes** when its iterator is exhausted on this rank. A consumer that fails after
  that (vLLM's ``finish_weight_update`` raised) must call ``reset()`` on every rank; ``WeightSync``
  does. Nothing a user passed is mutated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..core.comm.waits import DEFAULT_TIMEOUT_S, bounded_group, group_ranks, wait_bounded
from ..core.ground.logs import current_rank, get_logger
from ..core.ground.ranks import multi_rank
from ..core.layouts.pieces import has_pieces, whole_piece
from ..core.protocols import senders_of
from .diff import Changed, Snapshots, has_nan
from .pieces_round import PiecesRound
from .records import Delta, DeltaError, DeltaStats

__all__ = ["DeltaSource", "Delta", "DeltaStats", "DeltaError", "INDEX_LIMIT"]

logger = get_logger(__name__)

#: vLLM's sparse indices are int32: a tensor must have fewer elements than this.
INDEX_LIMIT = 1 << 31
#: Default group size where the diff runs as torch ops (CPU): one flat scratch of the group per round.
DEFAULT_GROUP_BYTES = 64 << 20
#: Default group size on hosts with CUDA, where the diff kernels need no scratch of the group's size: a
#: round's host work is per group (one count exchange, one size sync, launches), so fewer, larger groups.
DEFAULT_CUDA_GROUP_BYTES = 512 << 20


class DeltaSource:
    """Rounds of changed elements of ``source``'s tensors (module docstring).

    Args:
        source: any vLLM ``WeightSource``; one with ``iter_pieces()`` is diffed where its shards live.
        anchor_every: also make every ``anchor_every``-th round an anchor (None: only when needed).
        snapshot: ``"device"`` (next to the pieces) or ``"cpu"`` (host memory; pinned for GPU pieces).
        group_bytes: tensors exchanged together, in bytes of full wire tensors (one counts exchange
            and at most one buffer per rank per group). Every rank uses rank 0's: its explicit value,
            or for None (default) its own default -- ``DEFAULT_CUDA_GROUP_BYTES`` where rank 0 has
            CUDA, else ``DEFAULT_GROUP_BYTES`` -- agreed at the first round (``_start_round``), so a
            world where only some ranks have CUDA (gloo) runs with one grouping; a rank passing an
            explicit value other than the agreed one is refused on every rank at that round.
        timeout_s: bound on each exchange (gloo).
    """

    def __init__(self, source: WeightSource, *, anchor_every: int | None = None, snapshot: str = "device",
                 group_bytes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(source, DeltaSource):
            raise TypeError("DeltaSource: the source is already a DeltaSource")
        if not isinstance(source, WeightSource):
            raise TypeError(f"DeltaSource: source must be a vLLM WeightSource, got {type(source).__name__}")
        if anchor_every is not None and (isinstance(anchor_every, bool) or not isinstance(anchor_every, int)
                                         or anchor_every < 1):
            raise ValueError(f"DeltaSource(anchor_every={anchor_every!r}): a positive int or None")
        if group_bytes is not None and (isinstance(group_bytes, bool) or not isinstance(group_bytes, int)
                                        or group_bytes <= 0):
            raise ValueError(f"DeltaSource(group_bytes={group_bytes!r}): a positive int or None")
        self._group_bytes_arg = group_bytes
        self._groups_agreed = False  # multi-rank: the first round agrees (``_agree_groups``)
        if group_bytes is None:  # this rank's own default until the first round agrees on rank 0's
            group_bytes = DEFAULT_CUDA_GROUP_BYTES if torch.cuda.is_available() else DEFAULT_GROUP_BYTES
        if senders_of(source) != "rank0":
            raise ValueError(
                f"rank {current_rank()}: DeltaSource: the wrapped {type(source).__name__} has "
                f"senders={senders_of(source)!r}, but vLLM's sparse_nccl engine (0.33 and 0.34) has "
                "one sender, rank 0, which the delta rounds gather to; build the source with senders='rank0'"
            )
        self.source = source
        self.anchor_every = anchor_every
        self.group_bytes = group_bytes
        self.timeout_s = timeout_s
        self._snap = Snapshots(snapshot)
        self._dirty = True  # no round delivered yet: the first is an anchor
        self._since_anchor = 0
        self.rounds = 0
        self.last_round = DeltaStats()
        self.metadata  # noqa: B018 -- refuses oversize tensors at construction, on every rank

    # ---- metadata ---------------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        """Every tensor the receiver holds: the wrapped source's names, wire dtypes and full shapes."""
        metas = [ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata]
        big = [(m.name, math.prod(m.shape)) for m in metas if math.prod(m.shape) >= INDEX_LIMIT]
        if big:
            raise DeltaError(
                f"rank {current_rank()}: DeltaSource: {big[0][0]!r} has {big[0][1]} elements; vLLM's sparse "
                f"patches index with int32 (< 2^31 elements per tensor): {len(big)} tensor(s) too large"
            )
        return metas

    @cached_property
    def _names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @cached_property
    def _index(self) -> dict[str, int]:
        return {m.name: i for i, m in enumerate(self.metadata)}

    @cached_property
    def _groups(self) -> list[tuple[int, int]]:
        """``[lo, hi)`` metadata ranges of about ``group_bytes`` of full wire tensors each."""
        out, lo, held = [], 0, 0
        for i, m in enumerate(self.metadata):
            n = math.prod(m.shape) * m.dtype.itemsize
            if i > lo and held + n > self.group_bytes:
                out.append((lo, i))
                lo, held = i, 0
            held += n
        if lo < len(self.metadata):
            out.append((lo, len(self.metadata)))
        return out

    #: one sender, rank 0, which every round gathers to (vLLM's sparse_nccl); declared for
    #: ``core/protocols.senders_of``
    senders = "rank0"

    @property
    def pieces_native(self) -> bool:
        """Whether the source is diffed where its shards live (it has ``iter_pieces``)."""
        # the class's own method: a wrapper that forwards attributes (FP8Source) must not lend its
        # source's pieces, which are not what the wrapper sends
        return has_pieces(self.source)

    @property
    def anchor_next(self) -> bool:
        """Whether this rank would start the next round as an anchor (all ranks agree at its start)."""
        return self._dirty or (self.anchor_every is not None and self._since_anchor >= self.anchor_every - 1
                               and self.rounds > 0)

    @property
    def snapshot_bytes(self) -> int:
        return self._snap.nbytes

    def reset(self) -> None:
        """Forget what the receiver holds: the next round is an anchor. Call on every rank."""
        self._dirty = True

    def swap(self, source: WeightSource) -> None:
        """Go on with ``source`` in place of the wrapped one -- the same tensors, newer values (a
        ``SafetensorsSource`` of the next checkpoint; one refuses a folder rewritten under it): the
        receiver and the snapshots carry over, so the next round holds what changed between the
        two. Names, wire dtypes and full shapes must be the same (``DeltaError`` otherwise, before any
        byte), and so must the way it is diffed (pieces or not). Call on every rank."""
        mine = [(m.name, m.dtype, tuple(m.shape)) for m in self.metadata]
        new = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata]
        if new != mine:
            diff = next(((a, b) for a, b in zip(mine, new) if a != b), (len(mine), len(new)))
            raise DeltaError(f"rank {current_rank()}: DeltaSource.swap: the new source's tensors differ "
                             f"(first: {diff[0]} vs {diff[1]}); build a new DeltaSource (its first round is an anchor)")
        if has_pieces(source) != self.pieces_native:
            raise DeltaError(f"rank {current_rank()}: DeltaSource.swap: {type(source).__name__} is diffed "
                             f"{'without' if self.pieces_native else 'with'} pieces, the snapshots were made the other way")
        self.source = source

    # ---- rounds -----------------------------------------------------------------------------------

    @property
    def snapshot_placement(self) -> tuple[frozenset[str], bool]:
        """``(device types holding the snapshot, every host part pinned)``: where ``snapshot=`` put it."""
        return self._snap.placement()

    def iter_patches(self) -> Iterator[Any]:
        """One round as vLLM's ``SparseWeightPatch`` es (int32 indices always explicit). Every rank,
        collectively; yields on rank 0 only."""
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

        bad = [m.name for m in self.metadata if not m.dtype.is_floating_point]
        if bad:
            raise DeltaError(
                f"rank {current_rank()}: DeltaSource.iter_patches: {bad[0]!r} is not floating point; vLLM's "
                "sparse apply needs floating tensors (NaN marks unchanged elements)"
            )
        for d in self.iter_deltas():
            yield SparseWeightPatch(d.name, d.indices, d.values, d.full_shape)

    def iter_deltas(self, *, whole_when_cheaper: bool = False) -> Iterator[Delta]:
        """One round: every rank, collectively; yields on rank 0 only, in metadata order, one
        ``Delta`` per changed tensor. ``whole_when_cheaper``: a tensor goes whole (``indices=None``)
        where that costs fewer bytes than indices and values, and anchors go whole (for transports
        that take whole tensors: patch files, the loopback); otherwise indices are always explicit."""
        anchor = self._start_round()
        stats = self.last_round = DeltaStats(round=self.rounds + 1, anchor=anchor)
        stats.dense_bytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in self.metadata)
        stats.elements = sum(math.prod(m.shape) for m in self.metadata)
        t0 = time.perf_counter()
        k0 = self._snap.kernel_buckets
        self._dirty = True  # until this round completes
        rounds = self._pieces_round if self.pieces_native else self._full_round
        try:
            yield from rounds(anchor, whole_when_cheaper, stats)
            stats.completed = True
        finally:
            stats.seconds = time.perf_counter() - t0
            stats.snapshot_bytes = self._snap.nbytes
            stats.kernel_buckets = self._snap.kernel_buckets - k0
        self._dirty = False
        self.rounds += 1
        self._since_anchor = 0 if anchor else self._since_anchor + 1
        logger.debug("delta round: %s", stats.as_dict())

    def _start_round(self) -> bool:
        """Agree on every rank whether this round is an anchor (any rank needing one decides); at the
        first round, also on the groups (``_agree_groups``), in the same one collective."""
        mine = self.anchor_next
        if not multi_rank():
            return mine
        ranks = group_ranks()
        group = bounded_group(ranks, timeout_s=self.timeout_s, purpose="pass")
        if not self._groups_agreed:
            return self._agree_groups(mine, ranks, group)
        flag = torch.tensor([int(mine)], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        wait_bounded(work, ranks=ranks, what="the delta round's anchor agreement", timeout_s=self.timeout_s)
        if flag.item() and not mine:
            logger.info("delta round is an anchor: another rank needs one")
        return bool(flag.item())

    def _agree_groups(self, mine: bool, ranks: list[int], group: Any) -> bool:
        """The first round's agreement: every rank sends (anchor needed, its explicit ``group_bytes`` or
        0, the group size it would use, CUDA available); every rank takes rank 0's group size, and
        refuses -- every rank the same way, from the same table -- when a rank passed an explicit
        value other than that. Ranks with and without CUDA may mix (the diff runs on each rank's own
        device; the exchange is gloo's): only the grouping must be one, and it is rank 0's."""
        row = torch.tensor([int(mine), self._group_bytes_arg or 0, self.group_bytes, int(torch.cuda.is_available())],
                           dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in ranks]
        work = dist.all_gather(rows, row, group=group, async_op=True)
        wait_bounded(work, ranks=ranks, what="the delta round's anchor and group agreement", timeout_s=self.timeout_s)
        table = [r.tolist() for r in rows]
        agreed = table[0][2]
        odd = [(ranks[i], t[1]) for i, t in enumerate(table) if t[1] and t[1] != agreed]
        if odd:
            raise DeltaError(
                f"rank {current_rank()}: DeltaSource(group_bytes=...): rank 0 groups by {agreed} bytes, rank "
                f"{odd[0][0]} was built with group_bytes={odd[0][1]}; every rank must use the same groups: pass the "
                "same value everywhere (or None: rank 0's)")
        cuda = [ranks[i] for i, t in enumerate(table) if t[3]]
        if cuda and len(cuda) < len(ranks):
            logger.info("DeltaSource: ranks %s have CUDA, the others not: every rank groups by rank 0's %d bytes",
                        cuda, agreed)
        if agreed != self.group_bytes:
            logger.info("rank %d: DeltaSource groups by rank 0's %d bytes (this rank's default: %d)",
                        current_rank(), agreed, self.group_bytes)
            self.group_bytes = agreed
            self.__dict__.pop("_groups", None)  # recomputed from the agreed size
        self._groups_agreed = True
        anchor = any(t[0] for t in table)
        if anchor and not mine:
            logger.info("delta round is an anchor: another rank needs one")
        return anchor

    # ---- a source diffed on rank 0 after its own pass --------------------------------------------------

    def _full_round(self, anchor: bool, whole_ok: bool, stats: DeltaStats) -> Iterator[Delta]:
        """``iter_full`` on every rank (its collectives), diffed on rank 0. Other ranks drain it. A NaN
        is raised on every rank after the pass (peers are inside the source's collectives until then)."""
        rank = current_rank()
        failure: str | None = None
        metas = self.metadata
        draining = False
        for name, tensor in self.source.iter_full():
            if rank != 0 or failure is not None or draining:
                continue
            i = self._index.get(name)
            if i is None or tensor.dtype != metas[i].dtype or tuple(tensor.shape) != tuple(metas[i].shape):
                failure = (f"{name!r}: the source yielded {tuple(tensor.shape)} {tensor.dtype}, metadata "
                           f"declares " + ("nothing" if i is None else f"{tuple(metas[i].shape)} {metas[i].dtype}"))
                continue
            ch = self._snap.diff(whole_piece(name, tensor), metas[i].dtype, everything=anchor)
            if has_nan(ch.values):
                failure = f"{name!r} has NaN among its new values"
                continue
            d = self._emit(name, ch, anchor, whole_ok, metas[i])
            self._snap.commit(ch)
            if d is not None:
                stats.changed += ch.count
                stats.tensors += 1
                stats.wire_bytes += d.nbytes
                try:
                    yield d
                except GeneratorExit:  # finish the source's pass so peers complete its collectives
                    draining = True
        if multi_rank():
            ranks = group_ranks()
            got = [None] * len(ranks)
            dist.all_gather_object(got, failure, group=bounded_group(ranks, timeout_s=self.timeout_s, purpose="pass"))
            failure = got[0]
        if failure is not None:
            raise DeltaError(f"rank {rank}: DeltaSource round {stats.round} (rank 0): {failure}; nothing after it was sent")
        if draining:
            raise GeneratorExit

    def _emit(self, name: str, ch: Changed, anchor: bool, whole_ok: bool, meta: ParamMeta) -> Delta | None:
        shape = tuple(meta.shape)
        n = math.prod(shape)
        if ch.pos is None:
            vals = ch.values.reshape(-1)
            if whole_ok:
                return Delta(name, None, vals, shape)
            return Delta(name, torch.arange(n, dtype=torch.int32, device=vals.device), vals, shape)
        if not ch.count:
            return None
        if whole_ok and ch.count * (4 + meta.dtype.itemsize) >= n * meta.dtype.itemsize:
            return Delta(name, None, ch.whole(meta.dtype).reshape(-1), shape)
        return Delta(name, ch.pos.to(torch.int32), ch.values, shape)

    # ---- a source diffed where its shards live (pieces_round.py) -----------------------------------------

    def _pieces_round(self, anchor: bool, whole_ok: bool, stats: DeltaStats) -> Iterator[Delta]:
        return PiecesRound(self.source, self.metadata, names=self._names, index=self._index, groups=self._groups,
                           snapshots=self._snap, timeout_s=self.timeout_s).run(anchor, whole_ok, stats)

    def __repr__(self) -> str:
        return f"DeltaSource({self.source!r}, anchor_every={self.anchor_every}, snapshot={self._snap.where!r})"
