"""verl's layout, pinned: ``weightsync.plugins.verl`` is written against verl 0.9.1 and nothing else.

Invariant: importing the plugin with any other verl (or a verl whose actor no longer feeds
``send_weights`` from ``actor.engine.get_per_tensor_param()``) raises ``ImportError`` naming 0.9.1,
before anything is registered or wrapped. Why: the hook relies on three private facts of verl's code
(the registry's decorator, the engine classes' method name, the worker's call with no arguments); a
silent mismatch would send verl's own stream while the user believes weightsync's is in use.
"""

from __future__ import annotations

import inspect

__all__ = ["VERL_VERSION", "require_verl"]

#: the one verl release this plugin's hook is written against
VERL_VERSION = "0.9.1"


def require_verl() -> None:
    """Raise ``ImportError`` naming ``VERL_VERSION`` unless the installed verl has its layout."""
    try:
        import verl
    except ImportError as e:
        raise ImportError(
            f"weightsync.plugins.verl needs verl {VERL_VERSION} (pip install --no-deps verl=={VERL_VERSION}; "
            f"README 'verl'): {e}"
        ) from e
    found = getattr(verl, "__version__", "unknown")
    if found != VERL_VERSION:
        raise ImportError(
            f"weightsync.plugins.verl is written against verl {VERL_VERSION}'s checkpoint-engine layout; "
            f"verl {found} is installed"
        )
    try:
        from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: F401
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError as e:
        raise ImportError(f"weightsync.plugins.verl: verl {found} lacks verl {VERL_VERSION}'s layout: {e}") from e
    update = inspect.getsource(ActorRolloutRefWorker.update_weights)
    if "self.actor.engine.get_per_tensor_param()" not in update or not hasattr(FSDPEngine, "get_per_tensor_param"):
        raise ImportError(
            f"weightsync.plugins.verl: verl {found}'s actor no longer feeds send_weights from "
            f"actor.engine.get_per_tensor_param() as verl {VERL_VERSION} does"
        )
