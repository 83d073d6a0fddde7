"""Is this a multi-rank run? The one test every module asks, instead of spelling it out.

A run is multi-rank when torch.distributed is available, initialised, and its default group has more
than one rank. A single process -- no process group, or a world of one -- never posts a collective:
a one-rank "agreement" would be a collective nobody else joins, and a world of one needs none.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["multi_rank"]


def multi_rank() -> bool:
    """True iff torch.distributed is initialised with a default group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
