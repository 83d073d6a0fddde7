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
goes through ``DTensor.full_tensor()`` (``fallback_full``), which is correct there where a
hand-rolled concat is not; the local shard is cast (and staged) first, without ``redistribute``.

Streams (CUDA): work runs on the caller's current stream, whatever it is (vLLM's packed NCCL
producer resumes the iterator inside a side stream). Before packing, the current stream waits for
the default stream (where the optimizer wrote the shards); before handing out a tensor produced on
another stream, the current stream waits for that stream and the tensor is recorded on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.layout import chunk_rows
from ..core.stats import PassStats

__all__ = [
    "chunk_rows",
    "gather_device",
    "ShardPiece",
    "BatchedGather",
    "fallback_full",
    "batchable_axis",
    "local_of",
    "after_default_stream",
]

_ALIGN = 16


def local_of(dt) -> torch.Tensor:
    """A DTensor's local shard, detached (read only). ``_local_tensor`` skips the autograd
    function ``to_local()`` runs, a measurable per-parameter cost with ~1,000 parameters."""
    local = getattr(dt, "_local_tensor", None)
    if local is None:
        local = dt.to_local()
    return local.detach()


def gather_device(mesh) -> torch.device:
    """The device collectives of ``mesh`` run on: cpu for gloo meshes, the current accelerator
    device otherwise (what FSDP2 itself gathers on, also under ``CPUOffloadPolicy``)."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    mod = torch.get_device_module(kind)
    return torch.device(kind, mod.current_device())


def batchable_axis(dt) -> int | None:
    """The mesh axis of a DTensor's single ``Shard(0)`` placement when every other axis is
    ``Replicate`` (FSDP2, HSDP), else None. Subclasses (``_StridedShard``) do not qualify."""
    from torch.distributed.tensor import Replicate, Shard

    axis = None
    for i, p in enumerate(dt.placements):
        if type(p) is Shard and p.dim == 0 and axis is None:
            axis = i
        elif type(p) is Replicate:
            continue
        else:
            return None
    if axis is None or dt.ndim == 0:
        return None
    return axis


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
class ShardPiece:
    """One parameter of a batched gather: its local shard and where its bytes go."""

    key: object  # caller's handle, returned with the result
    local: torch.Tensor  # this rank's rows (module storage: read only)
    full_shape: tuple[int, ...]
    wire_dtype: torch.dtype
    rows_per_rank: int = 0  # c
    row_numel: int = 0  # prod(full_shape[1:])
    offset: int = 0  # byte offset inside one rank's block
    nbytes: int = 0  # c * row_numel * itemsize (one rank's block of this parameter)


class BatchedGather:
    """One all-gather for ``pieces`` over ``group`` (``n`` ranks, this rank at ``index``)."""

    def __init__(
        self,
        pieces: list[ShardPiece],
        *,
        group,
        n: int,
        index: int,
        device: torch.device,
        stats: PassStats,
        timeout_s: float,
    ) -> None:
        self.pieces = pieces
        self.timeout_s = timeout_s
        self.group = group
        self.n = n
        self.index = index
        self.device = device
        self.stats = stats
        off = 0
        for p in pieces:
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

    def __iter__(self) -> Iterator[tuple[object, torch.Tensor]]:
        n, block = self.n, self.block_bytes
        after_default_stream(self.device)
        send = torch.empty(block, dtype=torch.uint8, device=self.device)
        self.stats.hold(block)
        for p in self.pieces:
            seg = send[p.offset : p.offset + p.nbytes].view(p.wire_dtype).view(
                p.rows_per_rank, p.row_numel
            )
            rows = p.local.shape[0]
            if rows:
                # Cast + stage (offloaded shards are copied host -> device here) in one copy.
                seg[:rows].copy_(p.local.detach().reshape(rows, p.row_numel))
            if rows < p.rows_per_rank:
                seg[rows:].zero_()
        recv = torch.empty(n * block, dtype=torch.uint8, device=self.device)
        self.stats.hold(n * block)
        what = f"all-gather of {len(self.pieces)} tensor(s) {self.pieces[0].key!r}..{self.pieces[-1].key!r}"
        _all_gather(recv, send, self.group, what=what, timeout_s=self.timeout_s)
        self.stats.collectives += 1
        self.stats.bytes_received += (n - 1) * block
        del send
        self.stats.hold(-block)
        gathered_on = _current_stream(self.device)
        table = recv.view(n, block)
        try:
            for p in self.pieces:
                # Unpack lazily, on the stream current at this resume, after the gather's stream.
                _sync_from(gathered_on, self.device)
                cols = table[:, p.offset : p.offset + p.nbytes].view(p.wire_dtype)
                out = torch.empty(
                    (n * p.rows_per_rank, p.row_numel), dtype=p.wire_dtype, device=self.device
                )
                out.view(n, p.rows_per_rank * p.row_numel).copy_(cols)
                full = out[: p.full_shape[0]].view(p.full_shape)
                if self.device.type == "cuda":
                    recv.record_stream(torch.cuda.current_stream(self.device))
                yield p.key, full
        finally:
            del table, recv
            self.stats.hold(-n * block)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, *, what: str, timeout_s: float) -> None:
    """One all-gather. On gloo (CPU) it is bounded: ``groups.wait_bounded`` raises
    ``SyncTimeoutError`` naming the absent ranks, or ``PeerFailedError`` as soon as a checked
    pass's board reports another rank's failure, instead of blocking for the group's timeout.
    Device backends are left to their own watchdog: polling would synchronize the host."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if dist.get_backend(group) != "gloo":
        fn(out, inp, group=group)
        return
    from ..core.waits import wait_bounded

    work = fn(out, inp, group=group, async_op=True)
    wait_bounded(work, ranks=dist.get_process_group_ranks(group), what=what, timeout_s=timeout_s)


def fallback_full(dt, wire_dtype: torch.dtype, device: torch.device, stats: PassStats) -> torch.Tensor:
    """``dt.full_tensor()`` in ``wire_dtype``, casting (and staging) the local shard first.

    Counts one collective per non-Replicate mesh axis (what DTensor's redistribution issues).
    The result is contiguous; for a Replicate-only DTensor already in the wire dtype on the gather
    device it aliases the module's storage (nothing was gathered).
    """
    from torch.distributed.tensor import DTensor, Replicate

    after_default_stream(device)
    local = local_of(dt)
    staged = local.to(device=device, dtype=wire_dtype)
    src = DTensor.from_local(
        staged, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
    full = src.full_tensor()
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: materialize it
    if callable(wait):
        full = wait()
    n_coll = sum(1 for p in dt.placements if not isinstance(p, Replicate))
    stats.collectives += n_coll
    if n_coll:
        stats.bytes_received += full.numel() * full.element_size() - staged.numel() * staged.element_size()
    return full.contiguous()
