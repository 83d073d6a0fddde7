"""weightsync.plugins: training-loop plugins, the CPU loopback backend, the demo and the CLI.

Names are exported lazily (``_LAZY``: name -> submodule), so ``import weightsync.plugins`` stays
cheap and a plugin's heavy dependencies load only when it is used. To add a name, add one line to
``_LAZY``. Importing ``weightsync.plugins.loopback`` registers the ``"loopback"`` backend in vLLM's
``WeightTransferTrainerFactory``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    # training-loop driver, HTTP control plane, reports, preflight checks
    "WeightSync": ".driver",
    "VLLMHTTPClient": ".http",
    "ControlPlaneError": ".http",
    "InsecureTransportError": ".http",
    # training-loop hooks (callbacks: weightsync.plugins.transformers / .lightning.WeightSyncCallback)
    "source_from_accelerator": ".accelerate",
    "MegatronWeightSync": ".megatron",
    "SyncReport": ".report",
    "PreflightError": ".preflight",
    "check_engine": ".preflight",
    "check_weights_changed": ".preflight",
    # CPU loopback backend (test/demo transport speaking vLLM's four-phase protocol over gloo)
    "LoopbackTrainerInitInfo": ".loopback",
    "LoopbackTrainerWeightTransferEngine": ".loopback",
    "LoopbackReceiver": ".loopback_receiver",
    "ChecksumMismatchError": ".loopback_receiver",
    "ReceiverServer": ".loopback_server",
    "ReceiverClient": ".loopback_server",
    "ReceiverHandle": ".loopback_server",
    "start_receiver_process": ".loopback_server",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
