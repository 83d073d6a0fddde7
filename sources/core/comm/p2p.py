"""Point-to-point "gather to one rank": the one mover both Megatron paths (dense TP shards and MoE
expert shards) and delta's round use to bring tensors to the sender.

Invariants:

* Every participant calls ``gather_to`` with the same ``transfers`` list (same order, same sources,
  shapes and dtypes, computed from configs), so sends and receives pair up without tags.
* Only ``dst`` allocates receive buffers; a source rank sends exactly the transfers it is named for,
  each tensor produced by ``local(i)`` (already in its wire dtype and contiguous). Other ranks do nothing.
* Every wait is bounded by ``timeout_s`` on gloo (``waits.wait_p2p``): a peer that never takes its
  side makes this rank raise ``SyncTimeoutError`` naming the peer and ``what`` -- on the receiver
  and on every sender alike. Waiting on each request keeps the tensors alive until the transfer
  finished, whatever stream the caller is on.
* ``post_gather`` is the same transfer split in two -- post now, ``finish`` later -- so a source can
  have the next unit's transfer in flight while its consumer handles this one (overlap). Posting
  order is the pairing order: every participant must post in the same unit order (p2p messages
  between two ranks match first-posted to first-posted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..ground.logs import get_logger
from ..ground.stats import PassStats
from .waits import wait_p2p

__all__ = ["Transfer", "PostedGather", "gather_to", "post_gather"]

logger = get_logger(__name__)


class Transfer(NamedTuple):
    """One tensor moving to ``dst``: the global rank holding it, and how ``dst`` receives it.

    (Not a checkpoint piece -- ``core/layouts/pieces.Piece`` is a box of a checkpoint tensor; this
    is one point-to-point message of a gather.)"""

    src: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class PostedGather:
    """A ``gather_to`` whose sends and receives are posted and not yet waited for
    (``post_gather``). ``finish()`` waits (bounded) and returns what ``gather_to`` returns;
    ``drain()`` waits it out without raising (a consumer stopped the pass early: every rank posted
    the same transfers, so they complete and the peers stay aligned) and drops the buffers.
    ``held_bytes``: receive buffers plus pieces cast for sending, the memory it holds until then."""

    def __init__(self, out: list[torch.Tensor] | None, waits: list, peer_of: str, what: str, held_bytes: int) -> None:
        self._out, self._waits, self._peer_of, self._what = out, waits, peer_of, what
        self.held_bytes = held_bytes

    def completed(self) -> bool:
        """Every posted transfer already completed (a poll, never a wait: a helper thread may call it)."""
        return all(w.is_completed() for _peer, w, _keep in list(self._waits))

    @property
    def pieces(self) -> list[torch.Tensor] | None:
        """On ``dst``: the pieces in order (valid once ``completed()``); elsewhere None."""
        return self._out

    def release_pieces(self) -> None:
        """Drop the reference to the received pieces (their consumer made its outputs from them)."""
        self._out = None

    def finish(self, timeout_s: float) -> list[torch.Tensor] | None:
        rank = dist.get_rank()
        for peer, w, _keep in self._waits:
            if self._peer_of == "dst":
                what = f"send of {self._what} from rank {rank} to rank {peer}"
            else:
                what = f"receive of {self._what} on rank {rank} from rank {peer}"
            wait_p2p(w, peer=peer, what=what, timeout_s=timeout_s)
        self._waits = []
        return self._out

    def drain(self, timeout_s: float) -> None:
        try:
            self.finish(timeout_s)
        except Exception as e:  # noqa: BLE001  (the pass is being abandoned; its own error wins)
            logger.warning("rank %d: abandoned transfer of %s did not complete: %s", dist.get_rank(), self._what, e)
        self._out = None


def post_gather(
    transfers: Sequence[Transfer],
    dst: int,
    *,
    local: Callable[[int], torch.Tensor],
    device: torch.device,
    what: str,
    stats: PassStats,
) -> PostedGather:
    """Post ``gather_to``'s sends (a source rank) or receives (``dst``) without waiting."""
    rank = dist.get_rank()
    held = 0
    if rank == dst:
        out: list[torch.Tensor] = []
        waits = []
        for i, p in enumerate(transfers):
            if p.src == rank:
                out.append(local(i))
                continue
            buf = torch.empty(p.shape, dtype=p.dtype, device=device)
            waits.append((p.src, dist.irecv(buf, src=p.src), None))
            stats.collectives += 1
            stats.bytes_received += buf.numel() * buf.element_size()
            held += buf.numel() * buf.element_size()
            out.append(buf)
        return PostedGather(out, waits, "src", what, held)
    sends = []
    for i, p in enumerate(transfers):
        if p.src == rank:
            t = local(i)
            # the request holds the tensor until the transfer finished, whatever stream the caller is on
            sends.append((dst, dist.isend(t, dst=dst), t))
            stats.collectives += 1
    return PostedGather(None, sends, "dst", what, held)


def gather_to(
    transfers: Sequence[Transfer],
    dst: int,
    *,
    local: Callable[[int], torch.Tensor],
    device: torch.device,
    timeout_s: float,
    what: str,
    stats: PassStats,
) -> list[torch.Tensor] | None:
    """Bring ``transfers`` to global rank ``dst``: on ``dst`` the tensors in ``transfers`` order (its own
    from ``local(i)``), elsewhere None once this rank's sends completed.

    ``what`` names the transfer in errors (e.g. the HF parameter). ``stats`` counts each send or
    receive as a collective and the received bytes; memory held is the caller's to account."""
    return post_gather(transfers, dst, local=local, device=device, what=what, stats=stats).finish(timeout_s)
