"""What one adapter-only sync did: ``AdapterSyncReport``, the per-sync report a training loop logs
(as ``weightsync.plugins.sync.SyncReport`` for full syncs): wall clocks around each phase on this
rank, the adapter's tensors and bytes (the same on every rank), the files' size (rank 0's only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AdapterSyncReport"]


@dataclass(frozen=True)
class AdapterSyncReport:
    step: int
    weight_version: str
    rank: int
    #: the name requests use for this version, and the folder it was loaded from (rank 0)
    lora_name: str
    path: str | None
    tensors: int
    #: adapter tensor bytes (the safetensors payload) and the files' size on disk (rank 0)
    bytes: int
    file_bytes: int | None
    gather_seconds: float
    write_seconds: float
    load_seconds: float
    pause_seconds: float
    total_seconds: float
    collectives: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self, prefix: str = "weightsync/") -> dict[str, float]:
        """Numeric fields only, prefixed, as ``SyncReport.metrics`` (what a trainer's logger takes;
        ``file_bytes`` is rank 0's only)."""
        return {prefix + k: float(v) for k, v in self.as_dict().items()
                if not isinstance(v, (bool, str)) and v is not None}

    def summary(self) -> str:
        return (f"rank {self.rank}: adapter {self.lora_name!r} v{self.weight_version}: {self.tensors} tensors, "
                f"{self.bytes} B, gather {self.gather_seconds * 1e3:.1f} ms, write {self.write_seconds * 1e3:.1f} ms, "
                f"load {self.load_seconds * 1e3:.1f} ms, total {self.total_seconds * 1e3:.1f} ms")
