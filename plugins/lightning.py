"""``weightsync.plugins.lightning``: the Lightning callback.
Kept at the path the README imports it from; the code lives in ``weightsync.plugins.hooks.lightning``."""

from .hooks.lightning import WeightSyncCallback

__all__ = ["WeightSyncCallback"]
