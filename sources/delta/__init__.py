"""Delta sync: rounds of the elements that changed since the receiver's last round (``DeltaSource``).

A stream transform over any ``WeightSource``. One idea per module:

* ``source``       -- ``DeltaSource``: the round's contract (anchors, exactness, refusals), the diff on
  rank 0 for a source without pieces;
* ``pieces_round`` -- the round of a source with pieces (``core.layouts.pieces``): diffed on the rank
  that owns each shard, counts exchanged, only changed elements sent to rank 0;
* ``diff`` (+ ``diff_triton`` on CUDA) -- snapshots and the bitwise comparison;
* ``exchange``     -- the per-group count table and the packed segments ranks send;
* ``records``      -- ``Delta``, ``DeltaStats``, ``DeltaError``.

May import ``core`` only (never a source package: it asks ``has_pieces()`` and the pieces protocol).
"""

from .source import Delta, DeltaError, DeltaSource, DeltaStats

__all__ = ["DeltaSource", "Delta", "DeltaStats", "DeltaError"]
