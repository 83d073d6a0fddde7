"""CPU stand-in for vLLM's ``PyNcclCommunicator``, shared by the CPU worlds and the GPU harness's dry runs.

vLLM's NCCL engines (dense, sparse; 0.33 and 0.34) read ``device``, ``rank``, ``world_size``,
``available``, ``disabled`` and call ``broadcast(tensor, src, stream)`` and ``destroy()``; this class
gives them exactly that over a gloo group of its own (a TCP store at ``host:port``), so vLLM's real
engines move real bytes between CPU processes. Like ``PyNcclCommunicator``, ``broadcast`` returns
without doing anything when ``disabled`` is set (how the preflight's controls simulate an NCCL that
vLLM could not load). ``log`` records ``(src, nbytes)`` of every broadcast this member took part in.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

__all__ = ["GlooCommunicator"]


class GlooCommunicator:
    """One member of a transfer world of ``world_size`` (module docstring)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")
        self.available, self.disabled = True, False
        self.nccl = None
        self.log: list[tuple[int, int]] = []
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self._group = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Broadcast ``tensor``'s bytes from ``src`` (as bytes: gloo has no kernel for every dtype)."""
        if self.disabled or tensor.numel() == 0:
            return
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._group.broadcast([buf.view(-1).view(torch.uint8)], opts).wait()
        if buf is not tensor:
            tensor.copy_(buf)
        self.log.append((src, tensor.numel() * tensor.element_size()))

    def destroy(self) -> None:
        self._group = None
