"""The ``"loopback_sparse"`` engine: vLLM ``sparse_nccl``'s trainer protocol over gloo, on CPU.

What ``SparseNCCLTrainerWeightTransferEngine`` does over NCCL, this does over the loopback transport,
so a delta sync (``WeightSync(DeltaSource(...), ...)``) runs end to end in CI without GPUs::

    info = LoopbackSparseTrainerInitInfo("127.0.0.1", 0, world_size=2, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=delta)
    client.start_weight_update()                  # the sender (rank 0)
    engine.send_weight_chunk(patches)             # one chunk: one update_weights RPC
    engine.verify_round()                         # every rank (collective): receiver == dense pass
    client.finish_weight_update(version)

Mirrors vLLM's engine: only the sender (rank 0) joins the transport; ``send_weight_chunk`` /
``send_weights`` return at once on other ranks; per chunk the update info lists ``names``,
``dtype_names``, ``shapes`` and ``num_updates_list``, and per patch the int32 indices then the values
are broadcast (``transport.plan_sparse``); an empty chunk is a no-op. What differs, because this is
our transport:

* a patch may be **whole** (``indices=None``: the values are the whole tensor, flattened; the update
  info's ``whole`` list says which), as ``DeltaSource.iter_deltas(whole_when_cheaper=True)`` yields;
* the receiver applies each chunk through vLLM's own ``load_checkpoint_weight_patches``
  (``weightsync.plugins.loopback.receiver.receiver``), after the same go/no-go handshake as the dense
  loopback (a receiver that rejects a name, dtype or shape makes the sender raise before any byte);
* **verification** (``checksums=True``, the default): ``verify_round()``, called on every rank after
  a round's last chunk (``WeightSync`` does), runs one dense ``iter_full`` pass of the source the
  ``DeltaSource`` wraps; rank 0 computes ``checksum`` of every full tensor and compares them with the
  receiver's full tensors as held after the apply (``full_checksums``), raising ``IntegrityError``
  naming the tensors that differ. The trainer's side is a dense pass rather than anything derived
  from the patches because rank 0 holds only the changed values: the claim checked is "the receiver
  now holds exactly what a dense sync would have given it", independent of the delta machinery.
  It costs one dense pass per round: turn it off (``checksums=False``) to measure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from weightsync.sources import IntegrityError, PassStats, WeightSyncError
from weightsync.sources.toolkit import checksum, get_logger, is_round_source

from ...sync import capabilities

from ..receiver.transport import (
    DEFAULT_TIMEOUT_S,
    LoopbackWorkerInitInfo,
    SparseEntry,
    byte_view,
    plan_sparse,
    sparse_update_info,
    validate_wire_fields,
    wait_work,
)
from .sender import UpdateRpc, open_sender

__all__ = ["SPARSE_BACKEND", "LoopbackSparseTrainerInitInfo", "LoopbackSparseTrainerWeightTransferEngine", "register"]

logger = get_logger(__name__)

SPARSE_BACKEND = "loopback_sparse"


@capabilities.declare(sparse=True, whole_patches=True)
@dataclass
class LoopbackSparseTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the sparse loopback backend: ``SparseNCCLTrainerInitInfo``'s fields
    (no packed wire options: sparse transfers are never packed) plus ``checksums`` (verify each
    round against a dense pass, see the module docstring) and ``timeout_s`` (every transport op).

    Declares (``weightsync.plugins.sync.capabilities``) ``sparse``: ``WeightSync`` drives it with delta
    rounds (``DeltaSource``), and ``whole_patches``: this transport takes whole tensors, so a round is
    ``iter_deltas(whole_when_cheaper=True)``."""

    backend: ClassVar[str] = SPARSE_BACKEND

    master_address: str
    master_port: int
    world_size: int
    checksums: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S

    def worker_init_info(self, master_port: int | None = None) -> LoopbackWorkerInitInfo:
        return LoopbackWorkerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port if master_port is None else master_port,
            world_size=self.world_size,
            rank_offset=1,
            packed=False,
            checksums=self.checksums,
            timeout_s=self.timeout_s,
            sparse=True,
        )


def _dense_source(source: Any) -> WeightSource | None:
    """The dense source to verify against: the one a ``DeltaSource`` wraps, or ``source`` itself."""
    if source is None:
        return None
    if is_round_source(source):  # the driver's test too (delta_rounds.is_delta_source)
        inner = source.__dict__.get("source", None)
        if inner is None:
            inner = getattr(source, "source", None)
        return inner
    return source


class LoopbackSparseTrainerWeightTransferEngine(TrainerWeightTransferEngine[LoopbackSparseTrainerInitInfo]):
    """Trainer side of the sparse loopback backend; see the module docstring.

    ``last_send`` (a ``PassStats``) counts on the sender what the round's chunks carried so far
    (reset by ``start_round``): patches (``tensors``), bytes (indices + values) and transport ops
    (``collectives``: handshakes and broadcasts); ``chunks``: ``update_weights`` calls, engine life.
    ``start_round`` and ``verify_round`` are the round hooks ``WeightSync`` calls
    (``weightsync.plugins.sync.capabilities.RoundHooks``).
    """

    init_info_cls = LoopbackSparseTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: Any, init_info: LoopbackSparseTrainerInitInfo) -> None:
        super().__init__(client=client, source=None, is_sender=init_info.is_sender, rank=init_info.rank)
        self.init_info = init_info
        self.verify_source = _dense_source(source)
        self.last_send = PassStats()
        self.chunks = 0
        self.verified_rounds = 0
        self._store: Any = None
        self._group: Any = None
        #: Where a send stopped if it left a transport op unmatched (None: aligned).
        self._midstream: str | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: LoopbackSparseTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: Any = None,
    ) -> Self:
        """``source``: the ``DeltaSource`` (or the dense source it wraps) to verify rounds against;
        required when ``checksums`` is on. Checks depend only on the arguments: every rank alike."""
        validate_wire_fields(init_info, port_zero_ok=True)
        if init_info.checksums:
            dense = _dense_source(source)
            if dense is None or not callable(getattr(dense, "iter_full", None)):
                raise ValueError(
                    f"rank {init_info.rank}: loopback_sparse with checksums=True verifies each round "
                    "against a dense pass: pass source= the DeltaSource (or the dense source it wraps); "
                    "or checksums=False"
                )
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            engine._store, engine._group = open_sender(init_info, client)
        return engine

    # -- sending ----------------------------------------------------------------------------------

    def send_weights(self, patches: Iterable[Any] | None = None) -> None:
        """One whole sparse update in its own lifecycle (start, one chunk, finish), as vLLM's
        ``send_weights``: on the sender only; a no-op for no patches. ``WeightSync`` uses
        ``send_weight_chunk`` instead (bounded chunks, and every rank iterating the round)."""
        if not self.is_sender:
            return
        patches = list(patches or ())
        if not patches:
            return
        self.client.start_weight_update()
        self.send_weight_chunk(patches)
        self.client.finish_weight_update()

    def send_weight_chunk(self, patches: Iterable[Any] | None = None) -> None:
        """Broadcast one chunk inside a caller-owned lifecycle (one ``update_weights`` RPC).

        ``patches``: vLLM ``SparseWeightPatch`` / weightsync ``Delta`` objects (``name``,
        ``indices`` int32 1-D or ``None`` for a whole tensor, ``values`` 1-D, ``full_shape``).
        Returns at once on non-senders, and for an empty chunk."""
        if not self.is_sender:
            return
        patches = list(patches or ())
        if not patches:
            return
        if self._group is None:
            raise RuntimeError("loopback_sparse: trainer_init did not open the transport on the sender")
        if self._midstream is not None:
            raise WeightSyncError(
                f"loopback_sparse: an earlier chunk stopped mid-stream ({self._midstream}), so the "
                "transport is misaligned with the receiver; build a new engine (trainer_init)"
            )
        entries = [_entry(p) for p in patches]
        stats = self.last_send
        rpc = UpdateRpc(self.client.update_weights, sparse_update_info(entries))
        self._midstream = "in the update handshake"
        flag = torch.zeros(1, dtype=torch.int64)
        wait_work(self._group.allreduce([flag]), "update handshake", rank=0, abort=rpc.check)
        stats.collectives += 1
        if int(flag.item()) != 0:
            self._midstream = None
            rpc.result(self.init_info.timeout_s)
            raise WeightSyncError("loopback_sparse: a receiver rejected the update (no reason returned)")
        for i, what, _ in plan_sparse(entries):
            p = patches[i]
            data = byte_view(p.indices if what == "indices" else p.values)
            self._midstream = f"in the {what} broadcast of {entries[i].name!r}"
            wait_work(self._group.broadcast(data, 0), f"sparse {what}", rank=0, abort=rpc.check)
            stats.collectives += 1
            stats.bytes += data.numel()
        stats.tensors += len(entries)
        self._midstream = None
        rpc.result(self.init_info.timeout_s)
        self.chunks += 1

    def start_round(self) -> None:
        """Reset the per-round counters (``WeightSync`` calls it on every rank before a round)."""
        self.last_send = PassStats()

    # -- verification -----------------------------------------------------------------------------

    def verify_round(self) -> None:
        """Collective, on every rank, after a round's last chunk and before ``finish``: one dense
        pass of the verified source; rank 0 raises ``IntegrityError`` naming every tensor the
        receiver holds differently. A no-op with ``checksums=False``."""
        if not self.init_info.checksums:
            return
        assert self.verify_source is not None
        sums: dict[str, str] = {}
        for name, tensor in self.verify_source.iter_full():
            if self.is_sender:
                sums[name] = checksum(tensor)
            del tensor
        if not self.is_sender:
            return
        fetch = getattr(self.client, "full_checksums", None)
        if not callable(fetch):
            raise WeightSyncError(
                f"loopback_sparse: client {type(self.client).__name__} has no full_checksums(); "
                "verification needs weightsync's ReceiverClient (or checksums=False)"
            )
        got = fetch(list(sums))
        bad = [n for n in sums if got.get(n) != sums[n]]
        if bad:
            raise IntegrityError(
                f"rank {self.rank}: after the delta round the receiver holds other values than a dense "
                f"pass of the source for {len(bad)} of {len(sums)} tensors: {bad[:10]}"
                + (" ..." if len(bad) > 10 else "")
            )
        self.verified_rounds += 1
        logger.debug("loopback_sparse: receiver equals the dense pass (%d tensors)", len(sums))

    def shutdown(self) -> None:
        self._group = self._store = None


def _entry(patch: Any) -> SparseEntry:
    """The ``SparseEntry`` of one patch, checked as vLLM's ``_validate_patch`` checks (and a whole
    patch's length), naming the tensor."""
    name, values, indices = patch.name, patch.values, patch.indices
    shape = tuple(int(d) for d in patch.full_shape)
    numel = 1
    for d in shape:
        numel *= d
    if values.ndim != 1:
        raise ValueError(f"loopback_sparse: patch {name!r}: values must be 1-D, got shape {tuple(values.shape)}")
    if indices is None:
        if values.numel() != numel:
            raise ValueError(f"loopback_sparse: whole patch {name!r} has {values.numel()} values for {numel} elements")
        return SparseEntry(name, values.dtype, shape, numel, True)
    if indices.dtype != torch.int32 or indices.ndim != 1:
        raise ValueError(f"loopback_sparse: patch {name!r}: indices must be int32 1-D, got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if indices.numel() != values.numel():
        raise ValueError(f"loopback_sparse: patch {name!r}: {indices.numel()} indices for {values.numel()} values")
    return SparseEntry(name, values.dtype, shape, int(values.numel()), False)


def register() -> None:
    """Register ``"loopback_sparse"`` in vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    if SPARSE_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(SPARSE_BACKEND, LoopbackSparseTrainerWeightTransferEngine)
