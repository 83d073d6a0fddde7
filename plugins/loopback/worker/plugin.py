"""weightsync's vLLM plugin (``vllm.general_plugins`` entry point ``weightsync``, in ``pyproject.toml``).

vLLM calls ``register()`` in each of its processes (API server, engine core, workers). It registers
the worker side of the ``"loopback"`` weight-transfer backend (``loopback.worker.engine``) in
vLLM's ``WeightTransferEngineFactory`` by module path, so nothing of weightsync is imported until a
worker actually builds the engine (``--weight-transfer-config '{"backend": "loopback"}'``).
Idempotent, and a no-op on a vLLM without the weight-transfer factory.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "loopback"


def register() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register into
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "weightsync.plugins.loopback.worker.engine", "LoopbackWorkerEngine"
        )
