"""The receiving end of one dense loopback chunk, in one place: validation, the go/no-go handshake,
the chunk plan and the checksums.

Used by both receivers of the ``"loopback"`` backend: ``LoopbackReceiver`` (our stand-in for a vLLM
worker, ``receiver.py``) and ``LoopbackWorkerEngine`` (the worker side inside a real vLLM server,
``loopback/worker/engine.py``). What each receiver does with a tensor (copy it into a module, or hand it to
vLLM's ``model.load_weights``) is its own ``load`` callback; what shapes the byte stream is here.

Invariants (both receivers):

* The update info is parsed and ``check``-ed *before* the handshake; a rejection answers "no", so the
  sender raises before any byte moves, and the error is raised here.
* Once the handshake said "go", exactly the bytes the update info declares are consumed, through the
  same ``plan_chunks`` as the sender, even when ``load`` fails (the first load error is raised after
  the stream), so the transport stays aligned for the next round of the same engine.
* With checksums on, the checksum of every received parameter (its bytes as received) is compared
  with the sender's after the stream; a mismatch raises ``ChecksumMismatchError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from weightsync.sources import IntegrityError, WeightSyncError
from weightsync.sources.toolkit import checksum_tensor

from .transport import (
    LoopbackWorkerInitInfo,
    nbytes_of,
    parse_update_info,
    plan_chunks,
    wait_work,
)

__all__ = ["ChecksumMismatchError", "DenseRound", "Plan", "handshake", "receive_dense", "typed"]

#: ``[(name, dtype, shape)]``, as ``transport.parse_update_info`` returns it.
Plan = list[tuple[str, torch.dtype, tuple[int, ...]]]


class ChecksumMismatchError(IntegrityError):
    """The bytes a receiver got for a parameter are not the bytes the sender sent."""


@dataclass
class DenseRound:
    """What one dense chunk left behind: its plan, and why it failed (``failed``: ``None`` when it
    did not), in the words the receivers report."""

    plan: Plan = field(default_factory=list)
    failed: str | None = None


def typed(entry: tuple[str, torch.dtype, tuple[int, ...]], data: torch.Tensor) -> torch.Tensor:
    """A received parameter's bytes (``uint8``) as the tensor its plan entry declares (a view)."""
    _, dtype, shape = entry
    return data.view(dtype).view(shape) if data.numel() else torch.empty(shape, dtype=dtype)


def handshake(group: Any, group_rank: int, error: BaseException | None, *, index: int) -> None:
    """Go/no-go: every group member contributes 1 if it rejects; the sender sends only on 0.
    Raises ``error`` (this receiver's reason) or, when another receiver said no, a ``WeightSyncError``."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    wait_work(group.allreduce([flag]), "update handshake", rank=group_rank)
    if error is not None:
        raise error
    if int(flag.item()) != 0:
        raise WeightSyncError(f"receiver {index}: another receiver rejected the update")


def receive_dense(
    group: Any,
    group_rank: int,
    init: LoopbackWorkerInitInfo,
    update_info: dict[str, Any],
    *,
    index: int,
    last_plan: Plan | None,
    check: Callable[[Plan], None],
    load: Callable[[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor], Any],
    outcome: DenseRound,
    precheck: Callable[[], None] | None = None,
) -> Plan:
    """Receive one dense ``update_info`` chunk from group rank 0; returns its plan.

    ``precheck()`` (a state check, e.g. "inside an update") and ``check(plan)`` (names, dtypes,
    shapes against the receiver's model) run before the handshake; their errors answer "no".
    An empty update info reuses ``last_plan``. ``load(entry, data)`` gets each received parameter:
    its plan entry ``(name, dtype, shape)`` and its bytes (a ``uint8`` view of the receive buffer;
    ``typed(entry, data)`` is the tensor); it may raise, and the stream goes on. ``outcome.failed`` says why the chunk failed, when it did (also on raise).
    """
    error: Exception | None = None
    plan: Plan = []
    try:
        if precheck is not None:
            precheck()
        plan = parse_update_info(update_info)
        if not plan:
            if last_plan is None:
                raise ValueError("empty update_info, but no previous update to reuse")
            plan = last_plan
        else:
            check(plan)
    except Exception as e:  # answered "no" below, then raised
        error = e
    outcome.plan = plan
    try:
        handshake(group, group_rank, error, index=index)
    except BaseException as e:
        outcome.failed = str(e) if e is error else "another receiver rejected the update"
        raise
    sizes = [nbytes_of(d, s) for _, d, s in plan]
    crcs: list[int] = [0] * len(plan)
    load_error: BaseException | None = None

    def take(i: int, data: torch.Tensor) -> None:
        # A failed load must not stop the stream: keep consuming exactly what the update info
        # declares (discarding it), so the sender finishes and the transport stays aligned for the
        # next round; the first error is raised once the stream is over.
        nonlocal load_error
        if load_error is not None:
            return
        try:
            crcs[i] = int(checksum_tensor(typed(plan[i], data)))
            load(plan[i], data)
        except Exception as e:  # noqa: BLE001 - raised after the stream
            load_error = e

    for chunk in plan_chunks(sizes, packed=init.packed, buffer_size=init.packed_buffer_size_bytes):
        buf = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8)
        wait_work(group.broadcast(buf, 0), "broadcast", rank=group_rank)
        off = 0
        for i in chunk:
            take(i, buf[off : off + sizes[i]])
            off += sizes[i]
    for i in range(len(plan)):
        if sizes[i] == 0:
            take(i, torch.empty(0, dtype=torch.uint8))
    if init.checksums:
        expected = torch.zeros(len(plan), dtype=torch.int64)
        wait_work(group.broadcast(expected, 0), "checksums", rank=group_rank)
    if load_error is not None:
        outcome.failed = f"loading failed: {load_error}"
        raise load_error
    if init.checksums:
        bad = [plan[i][0] for i in range(len(plan)) if int(expected[i]) != crcs[i]]
        if bad:
            outcome.failed = f"checksum mismatch on {bad}"
            raise ChecksumMismatchError(
                f"receiver {index}: the bytes received for {len(bad)} parameter(s) do not "
                f"match the sender's checksums: {bad[:10]}" + (" ..." if len(bad) > 10 else "")
            )
    return plan
