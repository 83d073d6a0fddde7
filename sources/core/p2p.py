"""Point-to-point "gather to one rank": the one mover both Megatron paths (dense TP shards and MoE
expert pieces) use to bring pieces to the sender.

Invariants:

* Every participant calls ``gather_to`` with the same ``pieces`` list (same order, same sources,
  shapes and dtypes, computed from configs), so sends and receives pair up without tags.
* Only ``dst`` allocates receive buffers; a source rank sends exactly the pieces it is named for,
  each produced by ``local(i)`` (already in its wire dtype and contiguous). Other ranks do nothing.
* Every wait is bounded by ``timeout_s`` on gloo (``groups.wait_p2p``): a peer that never takes its
  side makes this rank raise ``SyncTimeoutError`` naming the peer and ``what`` -- on the receiver
  and on every sender alike. Waiting on each request keeps the tensors alive until the transfer
  finished, whatever stream the caller is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .waits import wait_p2p
from .stats import PassStats

__all__ = ["Piece", "gather_to"]


class Piece(NamedTuple):
    """One tensor moving to ``dst``: the global rank holding it, and how ``dst`` receives it."""

    src: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def gather_to(
    pieces: Sequence[Piece],
    dst: int,
    *,
    local: Callable[[int], torch.Tensor],
    device: torch.device,
    timeout_s: float,
    what: str,
    stats: PassStats,
) -> list[torch.Tensor] | None:
    """Bring ``pieces`` to global rank ``dst``: on ``dst`` the tensors in ``pieces`` order (its own
    from ``local(i)``), elsewhere None once this rank's sends completed.

    ``what`` names the transfer in errors (e.g. the HF parameter). ``stats`` counts each send or
    receive as a collective and the received bytes; memory held is the caller's to account."""
    rank = dist.get_rank()
    if rank == dst:
        out: list[torch.Tensor] = []
        waits = []
        for i, p in enumerate(pieces):
            if p.src == rank:
                out.append(local(i))
                continue
            buf = torch.empty(p.shape, dtype=p.dtype, device=device)
            waits.append((p.src, dist.irecv(buf, src=p.src)))
            stats.collectives += 1
            stats.bytes_received += buf.numel() * buf.element_size()
            out.append(buf)
        for src, w in waits:
            wait_p2p(w, peer=src, what=f"receive of {what} on rank {rank} from rank {src}", timeout_s=timeout_s)
        return out
    sends = []
    for i, p in enumerate(pieces):
        if p.src == rank:
            t = local(i)
            sends.append((t, dist.isend(t, dst=dst)))
            stats.collectives += 1
    for _t, w in sends:
        wait_p2p(w, peer=dst, what=f"send of {what} from rank {rank} to rank {dst}", timeout_s=timeout_s)
    return None
