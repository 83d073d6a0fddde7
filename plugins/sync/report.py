"""What one sync did: the per-sync report a training loop logs.

Invariant: a report is built from numbers measured in this process during this sync (wall clocks
around each phase, the source's own ``last_pass`` counters) and from the metadata every rank shares
(wire tensors and bytes). ``wire_bytes`` is what the receiver gets and is identical on every rank;
``rank_*`` fields are this rank's own work and differ between ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SyncReport"]


@dataclass(frozen=True)
class SyncReport:
    step: int
    weight_version: str
    backend: str
    rank: int
    is_sender: bool
    #: Parameters and bytes on the wire (from metadata: every rank reports the same).
    tensors: int
    bytes: int
    #: Seconds in ``send_weights`` (all four protocol phases), in pause, in resume, and end to end.
    send_seconds: float
    pause_seconds: float
    resume_seconds: float
    total_seconds: float
    pause_mode: str | None
    #: This rank's source counters for the pass (``None`` if the source keeps no ``last_pass``).
    rank_tensors: int | None = None
    rank_bytes: int | None = None
    collectives: int | None = None
    peak_extra_bytes: int | None = None
    #: Whether this sync also built the trainer engine (the first sync pays the rendezvous).
    cold: bool = False

    @property
    def gbps(self) -> float:
        """Wire GB/s (1e9 bytes) over the send phase."""
        return self.bytes / self.send_seconds / 1e9 if self.send_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d

    def metrics(self, prefix: str = "weightsync/") -> dict[str, float]:
        """Numeric fields only, prefixed: what a trainer's logger (HF ``Trainer.log``, Lightning
        ``log_dict``, wandb) accepts."""
        out: dict[str, float] = {}
        for k, v in self.as_dict().items():
            if isinstance(v, bool) or v is None or isinstance(v, str):
                continue
            out[prefix + k] = float(v)
        return out

    def summary(self) -> str:
        pause = f", pause {self.pause_mode} {self.pause_seconds * 1e3:.1f} ms" if self.pause_mode else ""
        return (
            f"weight sync step {self.step} (version {self.weight_version!r}, {self.backend}"
            f"{', cold' if self.cold else ''}): {self.tensors} tensors, {self.bytes / 1e6:.2f} MB in "
            f"{self.send_seconds:.3f} s ({self.gbps:.2f} GB/s){pause}, total {self.total_seconds:.3f} s"
        )
