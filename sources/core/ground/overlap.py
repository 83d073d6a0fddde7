"""The one switch for overlap, shared by every source that posts collectives ahead of its consumer.

``FSDPSource`` posts the next gather group, ``MegatronSource`` the next unit's point-to-point
gather, before yielding the current tensors (``fsdp/prefetch.py``, ``megatron/source.py``). Both take
``overlap=None`` to mean this default, so one environment variable turns overlap off for a whole job
or test suite -- for debugging and for A/B runs against the sequential pass.
"""

from __future__ import annotations

import os

__all__ = ["overlap_default"]


def overlap_default() -> bool:
    """Sources' default for ``overlap=None``: on, unless ``WEIGHTSYNC_OVERLAP`` is ``0``/``false``/
    ``off``/``no``."""
    return os.environ.get("WEIGHTSYNC_OVERLAP", "1").strip().lower() not in ("0", "false", "off", "no")
