"""The loopback transport: what the trainer's sender and the receiver must agree on, in one place.

Invariant: both sides derive everything that shapes the byte stream -- which tensors go in which
broadcast, how many bytes each one is, the checksum of each parameter -- from the same update info
(names, dtype names, shapes) through the functions below, so the two sides cannot split the stream
differently. Nothing here touches a model or a ``WeightSource``.

The transport is a gloo group private to the sender (group rank 0) and the receivers (ranks
``rank_offset ..``), built from its own ``TCPStore`` with a bounded timeout. It never touches a
default process group, so the trainer's own groups (and whatever backend they use) are unaffected.

Every stream is raw bytes: each tensor travels as a ``uint8`` view of its storage, so any dtype
(bf16, fp8, int) crosses gloo unchanged, and the checksums cover exactly the bytes that travelled.

Sparse mode (``sparse=True``, delta rounds): the update info is vLLM ``sparse_nccl``'s
(``names``, ``dtype_names``, ``shapes``, ``num_updates_list``) plus an optional ``whole`` list of ours
(a patch whose values are the whole tensor, flattened, and no indices: our transport may take a
tensor whole when that is cheaper). Per patch, as vLLM broadcasts it: the int32 indices, then the
values; ``plan_sparse`` lists those broadcasts for both sides from the update info alone.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources import SyncTimeoutError, WeightSyncError

__all__ = [
    "LoopbackWorkerInitInfo",
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "open_transport_group",
    "validate_wire_fields",
    "open_transport_store",
    "join_transport_group",
    "byte_view",
    "nbytes_of",
    "plan_chunks",
    "parse_dtype",
    "parse_update_info",
    "wait_work",
    "SparseEntry",
    "parse_sparse_update_info",
    "sparse_update_info",
    "plan_sparse",
]

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 16 * 1024 * 1024
#: Bound on every transport operation (rendezvous, each broadcast). A dead peer becomes an error.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(kw_only=True)
class LoopbackWorkerInitInfo:
    """What the receiver is told at ``init_weight_transfer_engine`` (JSON-safe, like vLLM's NCCL
    worker init info): where the transport group's store is, its size, the receivers' first group
    rank, and the wire parameters the sender will use, so the two cannot disagree."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    checksums: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: Delta rounds: each ``update_weights`` carries sparse patches (``parse_sparse_update_info``).
    sparse: bool = False

    def __post_init__(self) -> None:
        validate_wire_fields(self, port_zero_ok=False)


def validate_wire_fields(info: Any, *, port_zero_ok: bool) -> None:
    """The checks both init infos share. ``port_zero_ok``: the trainer side may ask for port 0
    (the sender binds a free one); what a receiver is told is always the bound port."""
    lowest = 0 if port_zero_ok else 1
    if not isinstance(info.master_port, int) or not lowest <= info.master_port < 65536:
        hint = " (0: the sender binds a free port)" if port_zero_ok else ""
        raise ValueError(f"init_info.master_port must be a TCP port{hint}, got {info.master_port!r}")
    rank_offset = getattr(info, "rank_offset", 1)
    if not isinstance(info.world_size, int) or info.world_size < 2:
        raise ValueError(
            f"init_info.world_size must be >= 2 (one sender plus at least one receiver), "
            f"got {info.world_size!r}"
        )
    if not 1 <= rank_offset < info.world_size:
        raise ValueError(
            f"init_info.rank_offset must be in [1, world_size={info.world_size}), "
            f"got {rank_offset!r}"
        )
    if getattr(info, "packed_buffer_size_bytes", 1) <= 0:  # sparse init infos have none
        raise ValueError(
            f"init_info.packed_buffer_size_bytes must be > 0, got {info.packed_buffer_size_bytes}"
        )
    if info.timeout_s <= 0:
        raise ValueError(f"init_info.timeout_s must be > 0, got {info.timeout_s}")


def open_transport_store(
    master_address: str, master_port: int, *, rank: int, world_size: int, timeout_s: float
) -> Any:
    """The transport group's ``TCPStore``: hosted by group rank 0, joined by the others.

    On rank 0, ``master_port=0`` binds a free port chosen by the kernel (read it back as
    ``store.port`` and hand *that* to the receivers): the port is never released between being
    picked and being bound, so two groups opened at once can never race for it. A fixed port that
    is taken raises ``WeightSyncError`` naming it instead of waiting out the timeout.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, dist.DistStoreError) as e:  # type: ignore[attr-defined]
        if rank == 0 and "EADDRINUSE" in str(e):
            raise WeightSyncError(
                f"loopback transport: {master_address}:{master_port} is already in use; pass "
                "master_port=0 to let the sender bind a free port and tell the receivers"
            ) from e
        raise SyncTimeoutError(
            f"loopback transport: group rank {rank} of {world_size} could not reach the store at "
            f"{master_address}:{master_port} within {timeout_s:.0f}s: {e}"
        ) from e


def join_transport_group(store: Any, *, rank: int, world_size: int, timeout_s: float) -> Any:
    """The private gloo group over ``store``. Blocks until all ``world_size`` members joined, at
    most ``timeout_s``; a member that never comes raises ``SyncTimeoutError``."""
    try:
        return dist.ProcessGroupGloo(
            dist.PrefixStore("weightsync/loopback", store),
            rank,
            world_size,
            datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistStoreError) as e:  # type: ignore[attr-defined]
        raise SyncTimeoutError(
            f"loopback transport: group rank {rank} of {world_size} could not form the group at "
            f"{store.host}:{store.port} within {timeout_s:.0f}s: {e}"
        ) from e


def open_transport_group(
    master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[Any, Any]:
    """Join the private transport group; group rank 0 hosts the store. Returns ``(store, group)``.

    Blocks until all ``world_size`` members joined, at most ``timeout_s``; a member that never comes
    raises ``SyncTimeoutError`` naming the address instead of waiting forever.
    """
    store = open_transport_store(
        master_address, master_port, rank=rank, world_size=world_size, timeout_s=timeout_s
    )
    return store, join_transport_group(store, rank=rank, world_size=world_size, timeout_s=timeout_s)


#: How long ``wait_work`` still gives a work item to complete once ``abort()`` raised (seconds).
ABORT_GRACE_S = 2.0


def wait_work(
    work: Any, what: str, *, rank: int, abort: Any = None, poll_s: float = 0.005, grace_s: float = ABORT_GRACE_S,
) -> None:
    """Wait for a gloo work item; while waiting, ``abort()`` (if given) may raise to stop early
    (e.g. the receiver's RPC already failed, so the peer will never join). The work's own timeout
    (the group's) bounds the wait otherwise.

    Once ``abort()`` raises, the work still gets ``grace_s`` to complete before the error is raised:
    a peer that matched this op and failed right after (a receiver that consumed the whole stream,
    then reported a load error) answers while gloo's thread may not yet have marked our side of the
    op done -- on a loaded host, often. Raising then would call the transport misaligned (the
    engine refuses every later send) although every op matched; a work that completes within the
    grace returns normally and the caller reads the peer's error from its RPC instead."""
    if abort is not None:
        import time

        while not work.is_completed():
            try:
                abort()
            except BaseException:
                deadline = time.monotonic() + grace_s
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(poll_s)
                if not work.is_completed():
                    raise
                break
            time.sleep(poll_s)
    try:
        work.wait()
    except RuntimeError as e:
        raise SyncTimeoutError(f"loopback transport: group rank {rank}: {what} failed: {e}") from e


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` tensor sharing its storage (requires contiguity)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def parse_dtype(name: str, *, param: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update_info: parameter {param!r} has unknown dtype name {name!r}")
    return dtype


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def parse_update_info(
    update_info: dict[str, Any],
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``[(name, dtype, shape)]`` from the NCCL-shaped dict ``{names, dtype_names, shapes}``."""
    if not isinstance(update_info, dict):
        raise ValueError(f"update_info must be a dict, got {type(update_info).__name__}")
    unknown = set(update_info) - {"names", "dtype_names", "shapes"}
    if unknown:
        raise ValueError(f"update_info has unknown keys {sorted(unknown)}")
    names = list(update_info.get("names", []))
    dtypes = list(update_info.get("dtype_names", []))
    shapes = list(update_info.get("shapes", []))
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names, "
            f"{len(shapes)} shapes"
        )
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"update_info names parameter {dup!r} twice")
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        shape = tuple(int(x) for x in s)
        if any(x < 0 for x in shape):
            raise ValueError(f"update_info: parameter {n!r} has a negative shape {shape}")
        out.append((str(n), parse_dtype(d, param=n), shape))
    return out


@dataclass(frozen=True)
class SparseEntry:
    """One patch of a sparse chunk: ``count`` values for checkpoint tensor ``name`` (full ``shape``,
    wire ``dtype``); ``whole``: the values are the whole tensor, flattened, and no indices travel."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    whole: bool = False

    @property
    def index_bytes(self) -> int:
        return 0 if self.whole else 4 * self.count

    @property
    def value_bytes(self) -> int:
        return self.count * self.dtype.itemsize


def sparse_update_info(entries: list[SparseEntry]) -> dict[str, list]:
    """The update info of a sparse chunk: vLLM ``sparse_nccl``'s four lists, plus ``whole`` when
    any patch is whole (what ``parse_sparse_update_info`` reads back)."""
    info: dict[str, list] = {
        "names": [e.name for e in entries],
        "dtype_names": [str(e.dtype).removeprefix("torch.") for e in entries],
        "shapes": [list(e.shape) for e in entries],
        "num_updates_list": [e.count for e in entries],
    }
    if any(e.whole for e in entries):
        info["whole"] = [e.whole for e in entries]
    return info


def parse_sparse_update_info(update_info: dict[str, Any]) -> list[SparseEntry]:
    """``[SparseEntry]`` from a sparse update info; raises ``ValueError`` naming the patch for a
    negative count, a count above the tensor's elements, or a whole patch of the wrong length."""
    if not isinstance(update_info, dict):
        raise ValueError(f"update_info must be a dict, got {type(update_info).__name__}")
    if "num_updates_list" not in update_info:
        raise ValueError("sparse update_info needs num_updates_list (one count per name)")
    unknown = set(update_info) - {"names", "dtype_names", "shapes", "num_updates_list", "whole"}
    if unknown:
        raise ValueError(f"sparse update_info has unknown keys {sorted(unknown)}")
    dense = parse_update_info({k: update_info[k] for k in ("names", "dtype_names", "shapes") if k in update_info})
    counts = [int(c) for c in update_info["num_updates_list"]]
    whole = [bool(w) for w in update_info.get("whole", [False] * len(counts))]
    if not len(counts) == len(whole) == len(dense):
        raise ValueError(
            f"sparse update_info lists differ in length: {len(dense)} names, {len(counts)} counts, "
            f"{len(whole)} whole flags"
        )
    out = []
    for (name, dtype, shape), n, w in zip(dense, counts, whole):
        numel = math.prod(shape)
        if n < 0 or n > numel:
            raise ValueError(f"update_info: patch {name!r} has {n} updates for a {numel}-element tensor")
        if w and n != numel:
            raise ValueError(f"update_info: whole patch {name!r} has {n} values for a {numel}-element tensor")
        out.append(SparseEntry(name, dtype, shape, n, w))
    return out


def plan_sparse(entries: list[SparseEntry]) -> list[tuple[int, str, int]]:
    """The broadcasts of a sparse chunk, in order: ``(entry index, "indices" | "values", bytes)`` --
    per patch its int32 indices (none when whole), then its values, as vLLM's ``sparse_nccl`` sends
    them; zero-byte ones are skipped on both sides."""
    plan = []
    for i, e in enumerate(entries):
        for what, n in (("indices", e.index_bytes), ("values", e.value_bytes)):
            if n:
                plan.append((i, what, n))
    return plan


def plan_chunks(nbytes: list[int], *, packed: bool, buffer_size: int) -> list[list[int]]:
    """Which parameters travel in which broadcast, as lists of indices into the update info.

    Unpacked: one broadcast per non-empty parameter. Packed: consecutive parameters share a flat
    buffer while it stays within ``buffer_size``; a parameter larger than the buffer travels alone.
    Empty parameters travel in no broadcast (nothing to send). Both sides call this with the same
    sizes, which is what keeps the stream aligned.
    """
    chunks: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, n in enumerate(nbytes):
        if n == 0:
            continue
        if not packed:
            chunks.append([i])
            continue
        if cur and cur_bytes + n > buffer_size:
            chunks.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += n
    if cur:
        chunks.append(cur)
    return chunks
