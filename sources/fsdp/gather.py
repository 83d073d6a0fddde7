"""Gathering FSDP2 shards: one collective for many parameters, cast before it moves.

Invariant: ``BatchedGather`` yields, for each parameter it was given, exactly
``param.full_tensor().to(wire_dtype)`` -- as a fresh, contiguous tensor that owns its storage (safe
to keep after the next yield) -- while issuing ONE ``all_gather_single`` over the mesh dimension's
group for all of them, and never writing to the module's shards.

Layout facts it relies on (FSDP2, ``torch.chunk`` semantics): a ``Shard(0)`` tensor of ``D`` rows
on ``n`` ranks gives rank ``r`` rows ``[r*c, min((r+1)*c, D))`` with ``c = ceil(D / n)``; trailing
ranks may hold fewer or zero rows. Each rank packs every parameter's local rows, padded to ``c``
rows and cast to the wire dtype, into one flat byte buffer at 16-byte-aligned offsets; the gathered
buffer is ``[n, per_rank_bytes]``, so parameter ``i`` is the column block ``[:, off_i:off_i+len_i]``
and its full tensor is that block read rank-major, trimmed to ``D`` rows. Packing copies the shard
to the gather device, so CPU-offloaded shards are staged by the same copy. HSDP's
``(Replicate, Shard(0))`` is the same gather over the shard dimension's group.

Anything else -- ``_StridedShard`` (FSDP+TP), ``Partial``, ``Shard(d>0)``, two sharded mesh dims --
goes through ``DTensor.full_tensor()`` (``shards.fallback_full``).

Names: a ``GatherShard`` is one parameter's local shard inside one batched gather (not a
``core.layouts.pieces.Piece``, which is a box of a checkpoint tensor).

Posting and collecting. ``BatchedGather.post()`` packs and issues the collective without waiting
for it; iterating waits for it (bounded on gloo) and unpacks. ``FSDPSource`` posts the next group
before it yields this one's tensors (``prefetch.GatherPipeline``); posting is always done by the
thread that iterates, at the same point of the plan on every rank, so every rank issues the same
collectives in the same order. ``drain()`` waits out a posted gather whose tensors nobody will read
(a consumer that stopped early): every rank posted it, so it completes, and the group stays aligned.

Copies. On CPU the send block and the gathered buffer come from the pass's ``buffers.BufferPool``s
(memory already paged in) and go back once nothing reads them. On any device, a one-tensor group
whose blocks carry no padding hands its gathered buffer over as the tensor (``_adopt``: it is the
full tensor, rank-major), so the embeddings are never copied out.

Streams (CUDA). Without a side stream (``stream=None``, what ``overlap=False`` gives) work runs on
the caller's current stream, whatever it is (vLLM's packed NCCL producer resumes the iterator inside
a side stream): before packing, the current stream waits for the default stream (where the optimizer
wrote the shards). With a side stream (the default), packing and the collective run on it: the side
stream first waits for the default stream and for the stream current at ``post()``; an event is
recorded on it after the collective, and each tensor is unpacked on the stream current when the
consumer resumes the iterator, after that stream waited for the event; the gathered buffer is
``record_stream``-ed on that stream, so the allocator does not hand its memory to the next gather
before the unpack ran.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.layouts.rows import chunk_rows
from .buffers import capacity
from ..core.ground.logs import get_logger
from ..core.ground.stats import PassStats

__all__ = [
    "GatherShard",
    "BatchedGather",
    "after_default_stream",
    "side_stream",
]

_ALIGN = 16

#: Shards whose full tensor is smaller than this (bytes) are unpacked in place even with an
#: ``unpacker``: a thread hand-off costs more than their copy.
_HANDOFF_BYTES = 256 << 10

logger = get_logger(__name__)


def _sync_from(stream_of_work, device: torch.device) -> None:
    """Make the caller's current stream wait for ``stream_of_work`` (CUDA only)."""
    if device.type != "cuda" or stream_of_work is None:
        return
    cur = torch.cuda.current_stream(device)
    if cur != stream_of_work:
        cur.wait_stream(stream_of_work)


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def after_default_stream(device: torch.device) -> None:
    if device.type == "cuda":
        _sync_from(torch.cuda.default_stream(device), device)


@dataclass
class GatherShard:
    """One parameter of a batched gather: this rank's local shard of it and where its bytes go."""

    key: object  # caller's handle, returned with the result
    local: torch.Tensor  # this rank's rows (module storage: read only)
    full_shape: tuple[int, ...]
    wire_dtype: torch.dtype
    rows_per_rank: int = 0  # c
    row_numel: int = 0  # prod(full_shape[1:])
    offset: int = 0  # byte offset inside one rank's block
    nbytes: int = 0  # c * row_numel * itemsize (one rank's block of this parameter)


def side_stream(device: torch.device):
    """The side stream gathers on ``device`` run on when they overlap the consumer (one per device,
    created on first use), or None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index))
    return stream


_SIDE_STREAMS: dict[int, object] = {}


class BatchedGather:
    """One all-gather for ``shards`` over ``group`` (``n`` ranks, this rank at ``index``).

    ``post()`` packs and issues it (at most once); iterating posts it if needed, waits for it and
    yields each shard's full tensor; ``drain()`` waits for a posted gather nobody will iterate.
    Memory accounted in ``stats``: from ``post()`` the send block (released once the collective
    completed) and the gathered buffer (released when iteration ends or ``drain()`` returns).
    """

    def __init__(
        self,
        shards: list[GatherShard],
        *,
        group,
        n: int,
        index: int,
        device: torch.device,
        stats: PassStats,
        timeout_s: float,
        stream=None,
    ) -> None:
        self.shards = shards
        self.timeout_s = timeout_s
        self.group = group
        self.n = n
        self.index = index
        self.device = device
        self.stats = stats
        self.stream = stream if device.type == "cuda" else None
        self._send: torch.Tensor | None = None
        self._recv: torch.Tensor | None = None
        self._work = None
        self._event = None
        self._posted_on = None
        #: CPU overlap: an executor that unpacks the next tensor while this one is consumed (the host
        #: copy then overlaps the consumer too); set by ``GatherPipeline``. None: unpack in place.
        self.unpacker = None
        #: CPU: the pass's two ``buffers.BufferPool`` (send blocks, gathered buffers) this gather's
        #: scratch buffers come from and go back to; set by ``GatherPipeline``. None: fresh allocations.
        self.pools = None
        self._send_cost = 0
        self._recv_cost = 0
        self._completed = False  # the collective was waited for and succeeded
        self._early = None  # CPU overlap: (shard index, future) of an unpack started before iteration
        self._early_stop: threading.Event | None = None  # stops ``_early``'s wait (``drain``)
        #: CPU overlap: called (by the iterating thread) once this gather has nothing left to unpack
        #: ahead; returns True when no further call is needed. Set by ``GatherPipeline``.
        self.tail_hook = None
        self._packing = None  # CPU: the send block being packed ahead on a helper thread
        self._state = "new"  # new -> posted -> done (waited) -> released
        off = 0
        for p in shards:
            rows = p.full_shape[0]
            p.rows_per_rank = -(-rows // n)
            p.row_numel = math.prod(p.full_shape[1:])
            p.nbytes = p.rows_per_rank * p.row_numel * p.wire_dtype.itemsize
            p.offset = off
            off += -(-p.nbytes // _ALIGN) * _ALIGN
            want = chunk_rows(rows, n, index)[1]
            if tuple(p.local.shape) != (want, *p.full_shape[1:]):
                raise ValueError(
                    f"shard of {p.key!r} has local shape {tuple(p.local.shape)} but Shard(0) of "
                    f"{p.full_shape} over {n} ranks gives rank {index} {(want, *p.full_shape[1:])}"
                )
        self.block_bytes = off

    @property
    def held_bytes(self) -> int:
        """Bytes this gather holds once posted: send block + gathered buffer."""
        return (self.n + 1) * self.block_bytes

    @property
    def adoptable(self) -> bool:
        """One shard filling its blocks exactly: its full tensor is the gathered buffer (``_adopt``)."""
        return len(self.shards) == 1 and self.shards[0].nbytes == self.block_bytes

    @property
    def what(self) -> str:
        return (
            f"all-gather of {len(self.shards)} tensor(s) {self.shards[0].key!r}..{self.shards[-1].key!r}"
        )

    def _buffer(self, nbytes: int, role: int) -> tuple[torch.Tensor, int]:
        """A uint8 scratch buffer of ``nbytes`` for ``role`` (0: send block, 1: gathered buffer) and
        the bytes holding it costs (accounted here)."""
        if self.pools is not None:
            buf = self.pools[role].take(nbytes)
            cost = capacity(buf)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            cost = nbytes
        self.stats.hold(cost)
        return buf, cost

    def _drop(self, buf: torch.Tensor | None, cost: int, role: int) -> None:
        """Release a scratch buffer. It goes back to the pool (if any) only when no collective can
        still touch it: never posted, or posted and completed (a wait that failed or was never
        made leaves the backend free to write it later)."""
        if buf is None:
            return
        if self.pools is not None and (self._state == "new" or self._completed):
            self.pools[role].give(buf)
        self.stats.hold(-cost)

    def _pack(self) -> None:
        send, self._send_cost = self._buffer(self.block_bytes, 0)
        self._send = send
        for p in self.shards:
            seg = send[p.offset : p.offset + p.nbytes].view(p.wire_dtype).view(
                p.rows_per_rank, p.row_numel
            )
            rows = p.local.shape[0]
            if rows:
                # Cast + stage (offloaded shards are copied host -> device here) in one copy.
                seg[:rows].copy_(p.local.detach().reshape(rows, p.row_numel))
            if rows < p.rows_per_rank:
                seg[rows:].zero_()

    def _alloc_recv(self) -> None:
        self._recv, self._recv_cost = self._buffer(self.n * self.block_bytes, 1)

    def pack_ahead(self, pool) -> None:
        """CPU: pack this rank's send block on ``pool``'s thread now (a local copy, no collective),
        so that ``post()`` later only issues the collective."""
        if self._state == "new" and self._packing is None and self._send is None and self.device.type == "cpu":
            self._packing = pool.submit(self._pack)

    def post(self) -> "BatchedGather":
        """Pack this rank's shards (unless packed ahead) and issue the all-gather, without waiting
        for it (idempotent)."""
        if self._state != "new":
            return self
        self._posted_on = _current_stream(self.device)
        if self.stream is None:
            after_default_stream(self.device)
            if self._packing is not None:
                packing, self._packing = self._packing, None
                packing.result()
            else:
                self._pack()
            self._alloc_recv()
            self._work = _post_all_gather(self._recv, self._send, self.group)
        else:
            side = self.stream
            side.wait_stream(torch.cuda.default_stream(self.device))  # the optimizer's writes
            side.wait_stream(torch.cuda.current_stream(self.device))  # whatever the caller did
            with torch.cuda.stream(side):
                self._pack()
                self._alloc_recv()
                self._work = _post_all_gather(self._recv, self._send, self.group)
                self._event = side.record_event()
        self._state = "posted"
        self.stats.collectives += 1
        return self

    def _wait(self) -> None:
        """Wait for the posted collective (bounded on gloo); release the send block."""
        if self._state != "posted":
            return
        self._state = "done"
        work, self._work = self._work, None
        try:
            if work is not None:
                _wait_all_gather(work, self.group, what=self.what, timeout_s=self.timeout_s)
            self._completed = True
        finally:
            send, self._send = self._send, None
            self._drop(send, self._send_cost, 0)
        self.stats.bytes_received += (self.n - 1) * self.block_bytes

    def _release(self) -> None:
        if self._state in ("posted", "done"):
            if self._state == "posted":  # never waited: the send block is still held
                send, self._send = self._send, None
                self._drop(send, self._send_cost, 0)
            recv, self._recv = self._recv, None
            self._drop(recv, self._recv_cost, 1)
            self._state = "released"

    def discard(self) -> None:
        """Free a gather that was built (perhaps packed ahead) but will never be posted."""
        if self._packing is not None:
            packing, self._packing = self._packing, None
            try:
                packing.result()
            except Exception:  # noqa: BLE001 - nothing will be sent from it
                pass
        if self._state == "new" and self._send is not None:
            send, self._send = self._send, None
            self._drop(send, self._send_cost, 0)
        self._state = "released"

    def _unpack(self, p: GatherShard) -> torch.Tensor:
        """``p``'s full tensor, a fresh allocation, read rank-major out of the gathered buffer."""
        n = self.n
        cols = self._recv.view(n, self.block_bytes)[:, p.offset : p.offset + p.nbytes].view(p.wire_dtype)
        out = torch.empty((n * p.rows_per_rank, p.row_numel), dtype=p.wire_dtype, device=self.device)
        out.view(n, p.rows_per_rank * p.row_numel).copy_(cols)
        return out[: p.full_shape[0]].view(p.full_shape)

    def _adopt(self, p: GatherShard) -> torch.Tensor:
        """A gather of one shard that fills its blocks exactly (no alignment padding): the gathered
        buffer, read rank-major, IS the full tensor (padding rows, if any, at its end). Hand it
        over instead of copying it out: the consumer owns the buffer from here (it is neither
        recycled nor counted as held by this gather any more)."""
        recv, self._recv = self._recv, None
        self.stats.hold(-self._recv_cost)
        self._recv_cost = 0
        return recv.view(p.wire_dtype)[: p.full_shape[0] * p.row_numel].view(p.full_shape)

    def drain(self) -> None:
        """Wait out a posted gather whose tensors will not be read, then free its buffers.

        Every rank posted the same collective at the same point of the plan, so it completes once
        the peers reach it; the wait is bounded (``timeout_s``) on gloo, and its error (a peer that
        failed or never came) is logged, not raised: this runs while another error propagates."""
        try:
            if self._state == "posted":
                self._wait()
        except Exception as e:  # noqa: BLE001 - the pass is already failing; say why this one stopped
            logger.warning("abandoned %s: %s", self.what, e)
        finally:
            if self._early_stop is not None:
                self._early_stop.set()  # an early unpack still waiting for the collective gives up
            _settle(self._early)  # it reads the gathered buffer: done before the buffer is freed
            self._early = None
            self._release()

    def stop_early(self) -> None:
        """An early unpack of this gather still waiting for its collective gives up (it then reads
        nothing); one already unpacking finishes. For ``GatherPipeline.close``, before it waits for
        the helper thread."""
        if self._early_stop is not None:
            self._early_stop.set()

    def _next_big(self, start: int) -> int | None:
        """The first shard from ``start`` on worth a thread hand-off, or None."""
        for j in range(start, len(self.shards)):
            if self.n * self.shards[j].nbytes >= _HANDOFF_BYTES:
                return j
        return None

    def start_early(self) -> bool:
        """CPU overlap: have ``unpacker`` unpack this posted gather's first large tensor as soon as its
        collective completes, before anyone iterates it (called by the previous group's iteration
        once that has nothing left to unpack ahead, so the helper's queue already holds that
        group's unpacks). Never blocks the caller. True once such an unpack is queued (or there is
        none to run).

        Why the helper waits instead of the caller polling: with one group ahead and a consumer
        as slow as the gathers, the collective of this group completes at about the time the
        consumer finishes the previous group -- after the previous group's last tensor was handed
        out, so a completion check made by the iterating thread at tensor boundaries finds it still
        in flight and the unpack of this group's first large tensor (a copy of the whole tensor)
        then ran in the iterating thread, on the critical path, once per group (docs/evidence.md
        has the measured gaps). The helper's job (``_unpack_when_done``) only polls
        ``work.is_completed()`` -- it never calls ``wait``, never touches the board (whose step
        numbers the iterating thread's waits hand out in plan order) and never issues anything: the
        iterating thread still makes the collective's bounded wait when it reaches this group, and
        raises its error there."""
        if self._early is not None or self._state != "posted" or self.unpacker is None:
            return True  # queued already, or nothing left to start early
        j = None if self.adoptable else self._next_big(0)
        if j is None:
            return True
        self._early_stop = threading.Event()
        self._early = (
            j, self.unpacker.submit(self._unpack_when_done, self._work, self.shards[j], self._early_stop)
        )
        return True

    def _unpack_when_done(self, work, p: GatherShard, stop: threading.Event) -> torch.Tensor | None:
        """Helper thread: wait (polling, bounded by ``timeout_s``, stopped by ``stop``) until the
        collective ``work`` completed, then unpack ``p``; None when stopped or timed out (the
        iterating thread then unpacks ``p`` itself after its own bounded wait, which reports the
        failure). A collective that failed completes too: the unpack then reads a buffer nobody
        will use (the iterating thread's wait raises before yielding it)."""
        if work is not None:
            t0 = time.monotonic()
            pause = 5e-5
            while not work.is_completed():
                if stop.is_set() or time.monotonic() - t0 > self.timeout_s:
                    return None
                time.sleep(pause)
                pause = min(pause * 1.25, 5e-4)
        if stop.is_set():
            return None
        return self._unpack(p)

    def __iter__(self) -> Iterator[tuple[object, torch.Tensor]]:
        self.post()
        # CPU overlap: at most one tensor unpacked ahead, on ``unpacker``: the next one worth a
        # thread hand-off (tensors under ``_HANDOFF_BYTES`` in between are unpacked in place), so a
        # large tensor after a run of norms is ready when the consumer reaches it. Once this gather
        # has nothing left to unpack ahead, ``tail_hook`` queues the next posted gather's first
        # unpack on the helper, which starts it once that collective completed (``start_early``):
        # still one tensor ahead in all.
        pending, self._early = self._early, None  # (shard index, future)
        tail_done = False
        try:
            self._wait()
            recv = self._recv
            gathered_on = self._posted_on
            shards = self.shards
            for i, p in enumerate(shards):
                # Unpack lazily, on the stream current at this resume, after the gather's stream.
                if self._event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._event)
                else:
                    _sync_from(gathered_on, self.device)
                full = None
                if pending is not None and pending[0] == i:
                    full = pending[1].result()  # None: an early unpack that gave up waiting
                    pending = None
                if full is None:
                    full = self._adopt(p) if self.adoptable else self._unpack(p)
                if pending is None and self.unpacker is not None:
                    j = self._next_big(i + 1)
                    if j is not None:
                        pending = (j, self.unpacker.submit(self._unpack, shards[j]))
                    elif not tail_done and self.tail_hook is not None:
                        tail_done = self.tail_hook()
                if self.device.type == "cuda":
                    recv.record_stream(torch.cuda.current_stream(self.device))
                yield p.key, full
                del full
        finally:
            if self._early_stop is not None:
                self._early_stop.set()  # (an early unpack still polling a collective that failed)
            _settle(pending)  # reads the gathered buffer: done before it is freed
            self.drain()


def _settle(pending) -> None:
    """Wait for an unpack nobody will read (its error too: it is not anybody's result)."""
    if pending is not None:
        try:
            pending[1].result()
        except Exception:  # noqa: BLE001 - an unpack nobody will read
            pass


def _post_all_gather(out: torch.Tensor, inp: torch.Tensor, group):
    """Issue one all-gather; return the work to wait for (gloo), or None (device backends: issued
    on the current stream, which then waits for it on the device, not on the host)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if dist.get_backend(group) != "gloo":
        fn(out, inp, group=group)
        return None
    return fn(out, inp, group=group, async_op=True)


def _wait_all_gather(work, group, *, what: str, timeout_s: float) -> None:
    """On gloo the wait is bounded: ``groups.wait_bounded`` raises ``SyncTimeoutError`` naming the
    absent ranks, or ``PeerFailedError`` as soon as a checked pass's board reports another rank's
    failure, instead of blocking for the group's timeout. Device backends are left to their own
    watchdog: polling would synchronize the host."""
    from ..core.comm.waits import wait_bounded

    wait_bounded(work, ranks=dist.get_process_group_ranks(group), what=what, timeout_s=timeout_s)
