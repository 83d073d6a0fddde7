"""The delta send phase of ``WeightSync``: one round of a ``DeltaSource`` through a sparse engine
(vLLM's ``sparse_nccl``, ``SparseNCCLTrainerInitInfo``, or the CPU ``LoopbackSparseTrainerInitInfo``).

Why a phase of its own: vLLM's sparse (0.33, 0.34) trainer engine takes no source, its
``send_weights(patches)`` holds the whole round in memory (``list(patches)``) and returns at once on
non-senders, whose collectives would then never run. So the send becomes, on every rank: iterate
the round (``delta.iter_patches()``: the diff's collectives; patches appear on rank 0 only) and, on
the sender, one ``start_weight_update``, ``send_weight_chunk`` per chunk of at most ``chunk_bytes``
of indices + values (a larger patch alone), the engine's ``verify_round()`` if it has one (every
rank, ``capabilities.RoundHooks``), then ``finish_weight_update(weight_version)``.

Invariants, and why:

* **Every rank drives the round's iterator**, the sender's chunks bounded, so memory stays bounded
  and the diff's collectives line up on every rank.
* **The round is agreed before ``verify_round`` and the commit**: ``verify_round`` is a collective
  pass; a sender whose consumer failed must not leave its peers alone in it. A rank whose round
  failed drains the round's iterator so its peers' collectives complete.
* **A failed round is followed by an anchor**: any failure of the send, on any rank, makes every
  rank call ``delta.reset()`` (``failed``) before raising, so the next sync brings the receiver, in
  whatever state the failed round left it, to the exact weights.
* **Pairing**: a delta source with a dense engine, or a plain source with a sparse one, is refused
  at construction (``check_pairing``, arguments only: the same verdict on every rank); dense syncs
  never come here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import Board, get_logger, is_round_source, multi_rank

from . import capabilities
from .clients import CommittingClient
from .outcomes import agree, describe

__all__ = ["DEFAULT_CHUNK_BYTES", "DeltaRounds", "check_pairing", "is_delta_source", "patch_bytes"]

logger = get_logger(__name__)

#: Bytes of indices + values per ``send_weight_chunk`` in a delta round (a larger patch goes alone).
DEFAULT_CHUNK_BYTES = 256 << 20


def is_delta_source(source: Any) -> bool:
    """A ``DeltaSource`` (or anything declaring its round API, ``toolkit.is_round_source``): what a
    sparse engine is fed from."""
    return is_round_source(source)


def patch_bytes(patch: Any) -> int:
    """Bytes of one patch's indices (none for a whole patch) and values."""
    idx = patch.indices
    n = patch.values.numel() * patch.values.element_size()
    return n + (0 if idx is None else idx.numel() * idx.element_size())


class DeltaRounds:
    """The delta send phase (module docstring), on every rank.

    ``last_send`` counts, on the sender, the last round's ``patches``, ``bytes`` (indices + values),
    ``chunks`` and ``max_chunk_bytes``."""

    def __init__(self, delta: Any, init_info: TrainerInitInfo, client: CommittingClient, *,
                 chunk_bytes: int, timeout_s: float) -> None:
        self.delta = delta
        self.init_info = init_info
        self.client = client
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.last_send: dict[str, int] = {}
        self._patches: Iterator[Any] | None = None

    @property
    def rank(self) -> int:
        return self.init_info.rank

    @property
    def is_sender(self) -> bool:
        return self.init_info.is_sender

    @property
    def engine_source(self) -> Any:
        """The ``source`` the engine is built with: vLLM's sparse engine refuses any source; ours
        (``capabilities.declares_sparse``) takes the delta to verify rounds against."""
        return self.delta if capabilities.declares_sparse(self.init_info) else None

    def begin(self, board: Board | None) -> None:
        """Before the sync's send: no round in flight yet."""
        self._patches = None

    def send(self, engine: TrainerWeightTransferEngine, board: Board | None, version: str) -> None:
        """One delta round: every rank drives the round's iterator (its collectives); the sender
        sends bounded chunks inside one start/finish lifecycle. Then the ranks agree that the round
        went through everywhere before the engine's ``verify_round`` and the commit."""
        patches = self._patches = self._round()  # a generator: nothing runs yet
        err: BaseException | None = None
        try:
            self._send_chunks(engine, patches)
        except BaseException as e:  # noqa: BLE001 - agreed below, then re-raised
            err = e
            self._drain(e, patches)
        failed = agree(board, "delta round", err, rank=self.rank, timeout_s=self.timeout_s) if board is not None else {}
        if err is not None:
            raise err
        if failed:
            me = dist.get_rank()
            raise WeightSyncError(
                f"rank {me}: the delta round failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            )
        capabilities.verify_round(engine)
        if self.is_sender:
            self.client.finish_weight_update(self.client.version)

    def recover(self, err: BaseException, engine: TrainerWeightTransferEngine | None) -> None:
        """This rank's send failed: drain what is left of the round so its peers complete it."""
        self._drain(err, self._patches)

    def failed(self) -> None:
        """The send failed on some rank (agreed), on every rank: reset the delta, so the next sync is
        an anchor."""
        try:
            self.delta.reset()
        except BaseException as e:  # noqa: BLE001 - the round's own failure is what gets raised
            logger.error("rank %d: delta.reset() after a failed round failed: %s", self.rank, describe(e))

    def report_fields(self, wire_bytes: int) -> dict[str, Any]:
        """The ``SyncReport``'s ``delta_*`` fields for the last round (``wire_bytes``: a dense
        sync's, when the delta does not say)."""
        last = getattr(self.delta, "last_round", None)
        sent = self.last_send
        return dict(
            delta_anchor=getattr(last, "anchor", None),
            delta_changed=getattr(last, "changed", None),
            delta_elements=getattr(last, "elements", None),
            delta_tensors=getattr(last, "tensors", None),
            delta_wire_bytes=getattr(last, "wire_bytes", None),
            delta_dense_bytes=getattr(last, "dense_bytes", wire_bytes),
            delta_collective_bytes=getattr(last, "collective_bytes", None),
            delta_chunks=sent.get("chunks") if self.is_sender else None,
            delta_sent_bytes=sent.get("bytes") if self.is_sender else None,
        )

    def _round(self) -> Iterator[Any]:
        """The round's iterator: vLLM's ``SparseWeightPatch`` es (indices always explicit), or, for
        an engine that takes whole patches (``capabilities.takes_whole_patches``: our loopback), the
        delta's ``iter_deltas(whole_when_cheaper=True)``: a tensor whole where that is cheaper."""
        if capabilities.takes_whole_patches(self.init_info):
            return iter(self.delta.iter_deltas(whole_when_cheaper=True))
        return iter(self.delta.iter_patches())

    def _send_chunks(self, engine: TrainerWeightTransferEngine, patches: Iterator[Any]) -> None:
        sent = self.last_send = {"patches": 0, "bytes": 0, "chunks": 0, "max_chunk_bytes": 0}
        capabilities.start_round(engine)
        if self.is_sender:
            self.client.start_weight_update()
        chunk: list[Any] = []
        nbytes = 0

        def flush() -> None:
            nonlocal chunk, nbytes
            engine.send_weight_chunk(chunk)  # type: ignore[attr-defined]
            sent["chunks"] += 1
            sent["max_chunk_bytes"] = max(sent["max_chunk_bytes"], nbytes)
            chunk, nbytes = [], 0

        for patch in patches:
            if not self.is_sender:  # vLLM's contract: patches appear on the sender only
                continue
            size = patch_bytes(patch)
            if chunk and nbytes + size > self.chunk_bytes:
                flush()
            chunk.append(patch)
            nbytes += size
            sent["patches"] += 1
            sent["bytes"] += size
        if chunk:
            flush()

    def _drain(self, err: BaseException, patches: Iterator[Any] | None) -> None:
        """This rank's delta round failed. Run the round's iterator to its end, discarding patches,
        so peers blocked in its collectives complete them and reach the outcome exchange (then every
        rank resets the delta). A round the delta source itself raised in is closed already."""
        if patches is None or not multi_rank():
            return
        try:
            n = sum(1 for _ in patches)
        except BaseException as e:  # noqa: BLE001 - the source failed too; peers hear it
            logger.error("draining the delta round after %s failed: %s", describe(err), describe(e))
            return
        if n:
            logger.warning("delta round failed (%s); drained %d patches so peers complete it", describe(err), n)


def check_pairing(source: Any, init_info: TrainerInitInfo, delta: bool) -> None:
    """A delta source needs a sparse engine and a sparse engine a delta source; sparse engines take
    no packed wire options. The same verdict on every rank (arguments only), before any byte."""
    sparse = capabilities.is_sparse_backend(init_info)
    backend = init_info.backend
    if delta and getattr(init_info, "use_load_plan", False):
        raise ValueError(
            f"WeightSync: rank {init_info.rank}: init_info.use_load_plan=True (vLLM 0.34: the workers plan "
            "direct writes from the metadata sent at init) cannot serve delta rounds: a DeltaSource sends "
            "sparse patches through sparse_nccl, which has no load plan; use_load_plan is for dense NCCL "
            "syncs of a source whose metadata is the same every round (every weightsync source's is)"
        )
    if delta and not sparse:
        raise TypeError(
            f"WeightSync: rank {init_info.rank}: a DeltaSource sends patches, but backend {backend!r} "
            f"({type(init_info).__name__}) sends dense tensors; use vLLM's SparseNCCLTrainerInitInfo "
            "(backend 'sparse_nccl') or weightsync's LoopbackSparseTrainerInitInfo, or pass the "
            "wrapped source itself for dense syncs"
        )
    if sparse and not delta:
        raise TypeError(
            f"WeightSync: rank {init_info.rank}: backend {backend!r} sends sparse patches; wrap the "
            f"source in DeltaSource(...) (got {type(source).__name__})"
        )
    if sparse:
        bad = [f for f in ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
               if f in getattr(init_info, "__dataclass_fields__", {}) and getattr(init_info, f, None)]
        if bad:
            raise ValueError(
                f"WeightSync: rank {init_info.rank}: backend {backend!r} takes no packed wire options "
                f"(sparse transfers are never packed); init_info sets {bad}"
            )
