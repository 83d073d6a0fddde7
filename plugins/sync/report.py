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
    #: Delta syncs only (``DeltaSource``; ``None`` otherwise), from the delta's ``last_round``:
    #: whether the round was an anchor, elements changed / in the model, tensors with a change, bytes
    #: on the wire (indices + values) vs the dense sync's, the trainer's collective bytes; and on
    #: the sender what the driver sent: ``send_weight_chunk`` calls and their bytes.
    delta_anchor: bool | None = None
    delta_changed: int | None = None
    delta_elements: int | None = None
    delta_tensors: int | None = None
    delta_wire_bytes: int | None = None
    delta_dense_bytes: int | None = None
    delta_collective_bytes: int | None = None
    delta_chunks: int | None = None
    delta_sent_bytes: int | None = None

    @property
    def changed_fraction(self) -> float | None:
        """Changed elements / model elements of a delta sync (None for dense syncs)."""
        if self.delta_changed is None or not self.delta_elements:
            return None
        return self.delta_changed / self.delta_elements

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
        if self.delta_dense_bytes is not None:
            frac = self.changed_fraction
            wire = self.delta_wire_bytes if self.delta_wire_bytes is not None else self.delta_sent_bytes
            return (
                f"weight sync step {self.step} (version {self.weight_version!r}, {self.backend}"
                f"{', cold' if self.cold else ''}, delta{' anchor' if self.delta_anchor else ''}): "
                + (f"{frac:.4%} changed, " if frac is not None else "")
                + (f"{wire / 1e6:.3f} MB on the wire vs {self.delta_dense_bytes / 1e6:.2f} MB dense"
                   if wire is not None else f"{self.delta_dense_bytes / 1e6:.2f} MB dense")
                + f" in {self.send_seconds:.3f} s{pause}, total {self.total_seconds:.3f} s"
            )
        return (
            f"weight sync step {self.step} (version {self.weight_version!r}, {self.backend}"
            f"{', cold' if self.cold else ''}): {self.tensors} tensors, {self.bytes / 1e6:.2f} MB in "
            f"{self.send_seconds:.3f} s ({self.gbps:.2f} GB/s){pause}, total {self.total_seconds:.3f} s"
        )
