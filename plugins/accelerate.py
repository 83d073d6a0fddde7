"""``weightsync.plugins.accelerate``: the source for an accelerate-prepared model.
Kept at the path the README imports it from; the code lives in ``weightsync.plugins.hooks.accelerate``."""

from .hooks.accelerate import source_from_accelerator

__all__ = ["source_from_accelerator"]
