"""Delta sync: rounds of the elements that changed since the receiver's last round (``DeltaSource``)."""

from .source import Delta, DeltaError, DeltaSource, DeltaStats

__all__ = ["DeltaSource", "Delta", "DeltaStats", "DeltaError"]
