"""What one pass of a source did, for the per-sync report and the benchmarks.

Invariant: counters are per rank and per pass (reset when a pass starts), and count only work the
source itself issued: tensors and bytes it yielded, collectives it launched, and the peak of extra
bytes it held for gathering beyond the module's own storage (and, of those, the peak held by
collectives posted ahead of the unit being yielded, when the source overlaps).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

__all__ = ["PassStats"]

#: ``hold`` may be called from a source's helper thread (an FSDP gather unpacked ahead on CPU).
_HOLD_LOCK = threading.Lock()


@dataclass
class PassStats:
    tensors: int = 0
    bytes: int = 0
    collectives: int = 0
    bytes_received: int = 0
    peak_extra_bytes: int = 0
    #: of ``peak_extra_bytes``: the most bytes held by collectives posted ahead of the unit being
    #: yielded (overlap; 0 when off or when nothing was posted ahead)
    ahead_peak_bytes: int = 0
    seconds: float = 0.0
    _t0: float = field(default=0.0, repr=False)
    _extra: int = field(default=0, repr=False)

    def start(self) -> "PassStats":
        self.__init__()  # type: ignore[misc]
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0

    def yielded(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes

    def hold(self, nbytes: int) -> None:
        """Account ``nbytes`` of extra memory now held (negative to release)."""
        with _HOLD_LOCK:
            self._extra += nbytes
            self.peak_extra_bytes = max(self.peak_extra_bytes, self._extra)

    @property
    def held_bytes(self) -> int:
        """Extra bytes ``hold`` has accounted and not yet released (what is held right now)."""
        return self._extra

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}
