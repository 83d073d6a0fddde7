"""What a delta round produces: one tensor's change (``Delta``), the round's statistics
(``DeltaStats``) and the error a round raises when it cannot be exact (``DeltaError``).

Plain records shared by the round's producers (``source.py``'s rank-0 diff and ``pieces_round.py``'s
diff where the shard lives) and read by every consumer (the driver, patch files, benchmarks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from ..core.ground.errors import WeightSyncError

__all__ = ["Delta", "DeltaError", "DeltaStats"]


class DeltaError(WeightSyncError):
    """A delta round cannot be exact (NaN among new values, pieces that do not tile a tensor, ...)."""


class Delta(NamedTuple):
    """One tensor's change: ``indices`` (int32, 1-D, unique flat indices into the full tensor) and
    ``values`` (1-D, wire dtype), or ``indices=None`` and ``values`` = the whole tensor, flattened."""

    name: str
    indices: torch.Tensor | None
    values: torch.Tensor
    full_shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: values, plus int32 indices when sparse."""
        n = self.values.numel()
        return n * self.values.element_size() + (0 if self.indices is None else 4 * n)


@dataclass
class DeltaStats:
    """One round on this rank (``changed`` / ``elements`` / ``tensors`` / ``wire_bytes`` are the
    round's totals; rank 0's are what it yielded, other ranks learn them from the counts)."""

    round: int = 0
    anchor: bool = False
    changed: int = 0
    elements: int = 0
    tensors: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    collective_bytes: int = 0
    snapshot_bytes: int = 0
    #: buckets (a group's pieces of one wire dtype on one device) diffed by the Triton kernels
    #: (``diff_triton``; CUDA) rather than the torch ops
    kernel_buckets: int = 0
    seconds: float = 0.0
    completed: bool = False

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed_fraction": self.changed_fraction}
