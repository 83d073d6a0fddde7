"""weightsync.sources: vLLM ``WeightSource`` implementations for sharded trainers.

Each source turns a trainer-layout model into Hugging Face checkpoint tensors, collectively and in
lockstep on every rank, and checks its own stream against its metadata on every rank.

* ``FSDPSource``      -- plain / FSDP2 / HSDP / FSDP+TP ``torch.nn.Module`` (transformers models).
* ``MegatronSource``  -- megatron-core ``GPTModel`` under TP / PP / VPP / EP / ETP.
* ``SafetensorsSource`` -- a safetensors checkpoint folder (single file or indexed shards).
* ``checked``         -- wrap any ``WeightSource`` with the per-rank stream check.

Heavy imports (vLLM, megatron-core) happen only when a name that needs them is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CrossRankMismatchError,
    IntegrityError,
    MetadataMismatchError,
    PeerFailedError,
    PreflightError,
    SilentTransportError,
    SyncTimeoutError,
    UnmappedParameterError,
    UnsupportedAdapterError,
    AdapterStateError,
    CheckpointError,
    ExchangeError,
    WeightSyncError,
)

# Lazy (PEP 562): ``weightsync.sources.errors`` and friends stay importable without vLLM, whose import
# costs seconds; a loopback receiver process or a CLI usage error never pays it.
_LAZY = {
    "CheckedSource": ".check",
    "checked": ".check",
    "check_stream": ".check",
    "verify_metadata_agreement": ".check",
    "FSDPSource": ".fsdp",
    "MegatronSource": ".megatron",
    "SafetensorsSource": ".safetensors_source",
}

__all__ = [
    "FSDPSource",
    "MegatronSource",
    "SafetensorsSource",
    "CheckedSource",
    "checked",
    "check_stream",
    "verify_metadata_agreement",
    "WeightSyncError",
    "MetadataMismatchError",
    "CrossRankMismatchError",
    "SyncTimeoutError",
    "UnmappedParameterError",
    "SilentTransportError",
    "PeerFailedError",
    "IntegrityError",
    "PreflightError",
    "UnsupportedAdapterError",
    "AdapterStateError",
    "CheckpointError",
    "ExchangeError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
