"""The ``"loopback"`` engine: a CPU weight-transfer backend for vLLM's trainer factory, over gloo.

A test and demo transport -- not a replacement for vLLM's NCCL/IPC engines. It lets CI, our tests
and the demo run a real multi-rank sync without GPUs, through the same trainer-side API and the same
four-phase protocol a vLLM server speaks::

    import weightsync.plugins.loopback  # registers backend "loopback"
    info = LoopbackTrainerInitInfo("127.0.0.1", port, world_size=2, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights()   # on every trainer rank

Structure mirrors ``NCCLTrainerWeightTransferEngine``: built on every trainer rank; rank 0 is the
only sender; ``trainer_init`` on the sender runs the client's ``init_weight_transfer_engine`` in a
thread while it opens its end of the transport; non-senders only drive ``iter_full()`` so the
trainer-side gathers line up. What it adds, and why:

* every rank checks its stream against ``metadata`` (``check_stream``), and the first send verifies
  that all ranks hold the same metadata, so a divergent rank raises instead of hanging;
* a go/no-go handshake before the first byte: a receiver that rejects the update info (unknown
  name, wrong shape or dtype) makes the sender raise before anything is broadcast;
* optional per-parameter checksum (``weightsync.sources.core.check.integrity.checksum_tensor``) of the bytes
  sent, shipped after the stream and checked by the receiver (vLLM's receivers verify nothing end
  to end);
* the outcome is agreed across trainer ranks at the end of ``send_weights``: if the sender failed,
  every rank raises (naming the sender's error) instead of ranks 1.. continuing into the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from weightsync.sources import PassStats, WeightSyncError, check_stream, verify_metadata_agreement
from weightsync.sources.toolkit import Board, checksum_tensor, get_logger, multi_rank, next_tag

from ..receiver.transport import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_TIMEOUT_S,
    LoopbackWorkerInitInfo,
    byte_view,
    plan_chunks,
    validate_wire_fields,
    wait_work,
)
from .sender import UpdateRpc, open_sender

__all__ = [
    "BACKEND",
    "LoopbackTrainerInitInfo",
    "LoopbackTrainerWeightTransferEngine",
    "register",
]

logger = get_logger(__name__)

BACKEND = "loopback"


@dataclass
class LoopbackTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for the loopback backend.

    ``master_address``/``master_port``: where the sender (trainer rank 0) hosts the transport
    group's ``TCPStore`` (``master_port=0``: the sender binds a free port and tells the receivers,
    the race-free choice); ``world_size``: 1 sender + the number of receivers. ``packed`` batches
    parameters into flat byte buffers of ``packed_buffer_size_bytes``; ``checksums`` ships a
    checksum per parameter after the stream. ``timeout_s`` bounds the rendezvous and every transport op.
    The sender forwards the wire fields to the receivers at ``trainer_init`` so they cannot
    disagree.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    checksums: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S

    def worker_init_info(self, master_port: int | None = None) -> LoopbackWorkerInitInfo:
        """What the receivers are told; ``master_port``: the port the sender's store is bound to
        (differs from ``self.master_port`` when that is 0)."""
        return LoopbackWorkerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port if master_port is None else master_port,
            world_size=self.world_size,
            rank_offset=1,
            packed=self.packed,
            packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            checksums=self.checksums,
            timeout_s=self.timeout_s,
        )


class _Stream:
    """The source's pass as one iterator that remembers whether the *source* raised, so a
    transfer failure can finish the pass (``drain``) and keep every rank's gathers in step."""

    def __init__(self, pairs: Any) -> None:
        self._it = iter(pairs)
        self.source_failed = False

    def __iter__(self) -> "_Stream":
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self.source_failed = True
            raise

    def drain(self) -> None:
        if self.source_failed:
            return
        try:
            for _ in self:
                pass
        except BaseException as e:  # noqa: BLE001 - the transfer error is the one to report
            logger.warning("rank 0: finishing the pass after a failed transfer raised: %s", e)


class LoopbackTrainerWeightTransferEngine(TrainerWeightTransferEngine[LoopbackTrainerInitInfo]):
    """Trainer side of the loopback backend; see the module docstring.

    ``last_send`` (a ``PassStats``) counts, on the sender, what crossed the transport in the last
    ``send_weights``: tensors, bytes, broadcasts (``collectives``) and seconds; on other ranks the
    tensors and bytes their ``iter_full`` yielded.
    """

    init_info_cls = LoopbackTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: LoopbackTrainerInitInfo,
    ) -> None:
        super().__init__(
            client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank
        )
        self.init_info = init_info
        self.last_send = PassStats()
        self.sends = 0
        self._store: Any = None
        self._group: Any = None
        self._sent_meta: list[ParamMeta] | None = None
        self._agreed = False
        #: Where the last send stopped if it left a transport op unmatched (None: aligned).
        self._midstream: str | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: LoopbackTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        # Checks below depend only on the arguments and metadata, identical on every rank, so
        # every rank raises alike and no rank is left in a rendezvous.
        if source is None:
            raise ValueError("loopback trainer weight transfer requires a WeightSource (source=...)")
        if not source.implements_iter_full():
            raise TypeError(
                f"loopback broadcast sends full tensors, but {type(source).__name__} does not "
                "implement iter_full()"
            )
        for m in source.metadata:
            if m.owners is not None and m.owners[0] != 0:
                raise ValueError(
                    f"rank {init_info.rank}: parameter {m.name!r} is owned by ranks {m.owners}, "
                    "but the loopback backend has a single sender, rank 0: every parameter's "
                    "owners must start at rank 0"
                )
        validate_wire_fields(init_info, port_zero_ok=True)  # every rank, before anything moves
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            engine._store, engine._group = open_sender(init_info, client)
        return engine

    # -- send -----------------------------------------------------------------------------------

    def send_weights(self, weight_version: str | None = None) -> None:
        """One full sync, on every trainer rank. Raises on every rank if any rank failed."""
        assert self.source is not None
        stats = self.last_send.start()
        error: BaseException | None = None
        try:
            meta = self.source.metadata
            if not self._agreed:
                verify_metadata_agreement(meta, what="loopback sync metadata", timeout_s=self.init_info.timeout_s)
                self._agreed = True
            mine = [m for m in meta if m.owners is None or self.rank in m.owners]
            stream = _Stream(check_stream(self.source.iter_full(), mine, rank=self.rank))
            if self.is_sender:
                try:
                    self._send(stream, meta, stats, weight_version)
                except BaseException:
                    # The transfer failed but the source did not: finish the pass without sending,
                    # so the other ranks' gathers complete and they reach the outcome exchange.
                    stream.drain()
                    raise
            else:
                for _, t in stream:
                    stats.yielded(t.numel() * t.element_size())
        except BaseException as e:  # noqa: BLE001 - agreed below, then re-raised
            error = e
        stats.stop()
        self._agree_outcome(error)
        self.sends += 1

    def _update_info(self, meta: list[ParamMeta]) -> dict[str, list]:
        if meta == self._sent_meta:
            return {"names": [], "dtype_names": [], "shapes": []}
        return {
            "names": [m.name for m in meta],
            "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
            "shapes": [list(m.shape) for m in meta],
        }

    def _wire(self, name: str, data: torch.Tensor) -> torch.Tensor:
        """The bytes that go on the wire for ``name`` (identity; a test hook)."""
        return data

    def _send(
        self,
        pairs: Any,
        meta: list[ParamMeta],
        stats: PassStats,
        weight_version: str | None,
    ) -> None:
        info = self.init_info
        if self._group is None:
            raise RuntimeError("loopback: trainer_init did not open the transport on the sender")
        if self._midstream is not None:
            raise WeightSyncError(
                f"loopback: an earlier send_weights on this engine stopped mid-stream "
                f"({self._midstream}), so its transport group is misaligned with the receiver; "
                "build a new engine (trainer_init) to re-join"
            )
        self.client.start_weight_update()
        rpc = UpdateRpc(self.client.update_weights, self._update_info(meta))
        self._midstream = "in the update handshake"
        # Go/no-go: receivers contribute 1 if they reject the update info. Nothing is sent on "no".
        flag = torch.zeros(1, dtype=torch.int64)
        wait_work(self._group.allreduce([flag]), "update handshake", rank=0, abort=rpc.check)
        stats.collectives += 1
        self._midstream = "before the first broadcast"
        if int(flag.item()) != 0:
            self._midstream = None  # nothing else was issued: the group is aligned
            rpc.result(info.timeout_s)  # carries the receiver's reason
            raise WeightSyncError("loopback: a receiver rejected the update (no reason returned)")

        sizes = [m.dtype.itemsize * _numel(m.shape) for m in meta]
        chunks = plan_chunks(sizes, packed=info.packed, buffer_size=info.packed_buffer_size_bytes)
        crcs = torch.zeros(len(meta), dtype=torch.int64)
        it = iter(enumerate(pairs))
        pending: list[torch.Tensor] = []
        for chunk in chunks:
            pending.clear()
            for i in chunk:
                # Zero-byte parameters travel in no chunk: consume them as they come.
                j, (name, tensor) = next(it)
                while j != i:
                    stats.yielded(0)
                    j, (name, tensor) = next(it)
                data = byte_view(tensor)
                if info.checksums:
                    crcs[i] = checksum_tensor(tensor)
                pending.append(self._wire(name, data))
                stats.yielded(data.numel())
            buf = pending[0] if len(pending) == 1 else torch.cat(pending)
            self._midstream = f"in the broadcast carrying {name!r}"
            wait_work(self._group.broadcast(buf, 0), "broadcast", rank=0, abort=rpc.check)
            stats.collectives += 1
        for _ in it:  # trailing zero-byte parameters, and check_stream's end-of-stream check
            stats.yielded(0)
        if info.checksums:
            self._midstream = "in the checksum broadcast"
            wait_work(self._group.broadcast(crcs, 0), "checksums", rank=0, abort=rpc.check)
            stats.collectives += 1
        self._midstream = None  # every transport op matched: the next round starts aligned
        rpc.result(info.timeout_s)
        self.client.finish_weight_update(weight_version)
        self._sent_meta = meta

    def _agree_outcome(self, error: BaseException | None) -> None:
        """Every trainer rank learns whether every other rank (the sender above all) succeeded, within
        the transport's ``timeout_s``: one bounded exchange on the store (``Board.exchange``), so a
        stopped or dead peer is named in a ``SyncTimeoutError`` after ``timeout_s``. A gloo all-gather
        here waited for its group's own timeout (``timeout_s`` + 30 s of slack; 330 s by default): the
        soak's ``stop`` class found the surviving rank silent long past the sync timeout."""
        if multi_rank():
            mine = "ok" if error is None else f"{type(error).__name__}: {error}"
            try:
                got = Board(next_tag("loopback-outcome")).exchange(
                    mine, ranks=list(range(dist.get_world_size())), timeout_s=self.init_info.timeout_s,
                    what="the loopback sync's outcome exchange")
            except WeightSyncError as e:
                if error is not None:
                    raise error from e
                raise
            failed = [(r, msg) for r, msg in sorted(got.items()) if msg != "ok"]
            if error is None and failed:
                r, msg = failed[0]
                raise WeightSyncError(
                    f"rank {self.rank}: the loopback sync failed on rank {r}: {msg}"
                )
        if error is not None:
            raise error

    def shutdown(self) -> None:
        self._group = self._store = None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def register() -> None:
    """Register ``"loopback"`` in vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, LoopbackTrainerWeightTransferEngine)

