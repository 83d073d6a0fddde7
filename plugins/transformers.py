"""``weightsync.plugins.transformers``: the HF Trainer / TRL callback.
Kept at the path the README imports it from; the code lives in ``weightsync.plugins.hooks.transformers``."""

from .hooks.transformers import WeightSyncCallback

__all__ = ["WeightSyncCallback"]
