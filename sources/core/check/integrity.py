"""End-to-end integrity: per-parameter checksums, computed by the trainer during the stream and
compared against what a receiver reports.

Invariant: ``checksum_tensor`` is a pure function of a tensor's dtype, shape and bytes, computed on
the tensor's own device without a host sync (one int64 reduction over the bytes reinterpreted as
same-width integers); ``resolve_checksums`` syncs once per pass. Two tensors with equal bytes have
equal checksums on every device, so a receiver that computes the same function over what it
received (before any post-processing) can be compared parameter by parameter with ``compare_checksums``.
It is a wrap-around sum: it catches a receiver that kept stale or garbage bytes, a truncated or
shifted buffer, zeros; it is blind to a permutation of equal-width elements (use sha256 over the
bytes, as vLLM's ``/weight_checker`` does, where a host copy is acceptable).

What vLLM 0.33 and 0.34 expose on the receiving side (read from ``vllm/entrypoints/rl/online/api_router.py``
and ``vllm/model_executor/model_loader/weight_checksum.py``):

* ``POST /weight_checker {"action": "checksum"}`` returns ``{"checksums": {key: sha256}}`` where
  ``key`` is ``"dp{i}:pp{j}:pcp{k}:tp{l}:" + <vLLM module parameter name>`` and the digest covers the
  *loaded* parameter (after vLLM fused q/k/v and gate/up, sharded by vLLM's TP, possibly quantized).
  Its keys and bytes are not the checkpoint tensors the trainer sent, so it cannot be compared with
  trainer checksums; it can tell whether the served weights changed at all (see
  ``weightsync.plugins.sync.check_weights_changed``). ``"reset"`` zeroes every weight;
  ``"compare"`` diffs against a baseline the caller supplies.
* ``GET /weight_info`` returns only ``{"weight_version": ...}``.
* No engine reports per-parameter checksums of what it received; the NCCL / IPC worker engines load
  straight into the model. A receiver that can (weightsync's loopback receiver does) implements
  ``ReportsChecksums``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

from ..ground.errors import IntegrityError, WeightSyncError  # noqa: F401 (re-export)

__all__ = [
    "IntegrityError",
    "ReportsChecksums",
    "checksum_tensor",
    "resolve_checksums",
    "checksum",
    "compare_checksums",
]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@runtime_checkable
class ReportsChecksums(Protocol):
    """A receiver that can report ``{checkpoint name: checksum}`` of what it received in the last
    round, computed with ``checksum`` over the received bytes before any post-processing."""

    def weight_checksums(self) -> Mapping[str, str]: ...


def checksum_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``tensor``'s device: the wrap-around sum of its bytes read as integers of the
    element width. No host sync, no full-size temporary (the reduction accumulates in int64)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    width = flat.element_size()
    if width not in _INT_OF_WIDTH:  # complex128 and friends: fall back to bytes
        flat, width = flat.view(torch.uint8), 1
    return torch.sum(flat.view(_INT_OF_WIDTH[width]), dtype=torch.int64)


def _fmt(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def resolve_checksums(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Turn ``[(name, checksum_tensor(...))]`` into ``{name: hex}`` with one transfer per device."""
    pairs = list(pairs)
    if not pairs:
        return {}
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, s) in enumerate(pairs):
        by_device.setdefault(s.device, []).append(i)
    out: list[str] = [""] * len(pairs)
    for idx in by_device.values():
        values = torch.stack([pairs[i][1] for i in idx]).tolist()
        for i, v in zip(idx, values):
            out[i] = _fmt(int(v))
    return {name: out[i] for i, (name, _) in enumerate(pairs)}


def checksum(tensor: torch.Tensor) -> str:
    """``checksum_tensor`` resolved to its hex string (syncs the device; for receivers and tests)."""
    return _fmt(int(checksum_tensor(tensor)))


def compare_checksums(
    sent: Mapping[str, str],
    received: Mapping[str, str],
    *,
    rank: int = 0,
    receiver: str = "receiver",
) -> None:
    """Raise ``IntegrityError`` naming the first parameter (in ``sent`` order) that the receiver did
    not report or reports with another checksum, and any name it reports that was never sent."""
    for name, value in sent.items():
        got = received.get(name)
        if got is None:
            raise IntegrityError(
                f"rank {rank}: {receiver} reported no checksum for {name!r} "
                f"(sent {len(sent)} parameters, {receiver} reported {len(received)})"
            )
        if got != value:
            raise IntegrityError(
                f"rank {rank}: {receiver} holds other bytes for {name!r} than were sent: "
                f"sent checksum {value}, {receiver} has {got}"
            )
    extra = [n for n in received if n not in sent]
    if extra:
        raise IntegrityError(
            f"rank {rank}: {receiver} reports {len(extra)} parameters that were never sent, "
            f"first {extra[0]!r}"
        )
