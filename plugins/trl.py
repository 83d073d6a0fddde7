"""``weightsync.plugins.trl``: ``WeightSyncGRPOTrainer``, TRL's vLLM-server GRPO synced by weightsync.
Kept at the path the README imports it from; the code lives in ``weightsync.plugins.hooks.trl``
(TRL is imported on first use of the class)."""

from typing import Any

__all__ = ["WeightSyncGRPOTrainer"]


def __getattr__(name: str) -> Any:
    from .hooks import trl as _trl

    return getattr(_trl, name)
