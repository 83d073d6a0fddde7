"""``weightsync.plugins.trl``: TRL's vLLM-server trainers synced by weightsync.

* ``WeightSyncGRPOTrainer`` -- ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="server"``
  (code in ``weightsync.plugins.hooks.trl``);
* ``WeightSyncAsyncGRPOTrainer`` -- ``trl.experimental.async_grpo.AsyncGRPOTrainer``
  (code in ``weightsync.plugins.hooks.trl_async``).

Kept at the path the README imports them from; TRL is imported on first use of a class.
"""

from typing import Any

__all__ = ["WeightSyncGRPOTrainer", "WeightSyncAsyncGRPOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "WeightSyncAsyncGRPOTrainer":
        from .hooks import trl_async

        return getattr(trl_async, name)
    from .hooks import trl as _trl

    return getattr(_trl, name)
