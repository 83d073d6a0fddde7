"""How ``weightsync plan`` writes a byte count: binary units (KiB, MiB, GiB) everywhere, so no line
states the same bytes once in GiB and once in GB (a 57 GiB refit must not read as "61.1 GB" in the
next line). Rates stay in GB/s, the unit ``--wire-gbps`` / ``--gather-gbps`` take."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below 1024 of it: ``176.75 KiB``, ``56.89 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
