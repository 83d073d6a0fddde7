"""weightsync.sources: vLLM ``WeightSource`` implementations for sharded trainers.

Each source turns a trainer-layout model into Hugging Face checkpoint tensors, collectively and in
lockstep on every rank, and checks its own stream against its metadata on every rank.

* ``FSDPSource``      -- plain / FSDP2 / HSDP / FSDP+TP ``torch.nn.Module`` (transformers models).
* ``MegatronSource``  -- megatron-core ``GPTModel`` under TP / PP / VPP / EP / ETP.
* ``SafetensorsSource`` -- a safetensors checkpoint folder (single file or indexed shards).
* ``FP8Source``       -- wrap any source: block-FP8 weights + ``weight_scale_inv`` (FP8 rollouts).
* ``DeltaSource``     -- wrap any source: rounds of only the elements that changed (vLLM ``sparse_nccl``).
* ``checked``         -- wrap any ``WeightSource`` with the per-rank stream check.
* ``LoRAAdapterSource`` -- a sharded PEFT model's LoRA adapter only, in PEFT's saved names.

Heavy imports (vLLM, megatron-core) happen only when a name that needs them is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .core import errors as _errors
from .core.errors import (
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
    FP8ConfigError,
    WeightSyncError,
)
from .core.logs import configure_logging, get_logger
from .core.stats import PassStats

# Lazy (PEP 562): ``weightsync.sources.core.errors`` and friends stay importable without vLLM, whose import
# costs seconds; a loopback receiver process or a CLI usage error never pays it.
_LAZY = {
    "CheckedSource": ".core.check",
    "checked": ".core.check",
    "check_stream": ".core.check",
    "verify_metadata_agreement": ".core.check",
    "FSDPSource": ".fsdp.source",
    "MegatronSource": ".megatron",
    "SafetensorsSource": ".checkpoint.reader",
    # FP8 rollouts: any source's stream with block-FP8 weights + weight_scale_inv (sources/quant/)
    "FP8Source": ".quant.source",
    "quantized": ".quant.source",
    "FP8Config": ".quant.config",
    # delta sync: rounds of changed elements in checkpoint coordinates (sources/delta/)
    "DeltaSource": ".delta.source",
    "Delta": ".delta.source",
    "DeltaStats": ".delta.source",
    "DeltaError": ".delta.source",
    "quantize_blocks": ".quant.fp8",
    "dequantize_blocks": ".quant.fp8",
    # what weightsync.plugins builds on (the only sources names plugins import; see pyproject's
    # import-linter contracts): cross-rank agreement and bounded waits, integrity, HF naming, the
    # safetensors format
    "control_group": ".core.check",
    "DEFAULT_TIMEOUT_S": ".core.waits",
    "Board": ".core.waits",
    "active_board": ".core.waits",
    "group_ranks": ".core.waits",
    "next_tag": ".core.waits",
    "checksum": ".core.integrity",
    "checksum_tensor": ".core.integrity",
    "hf_root": ".core.naming",
    "INDEX_FILE": ".checkpoint.reader",
    "SINGLE_FILE": ".checkpoint.reader",
    "MAX_HEADER_BYTES": ".checkpoint.reader",
    "SAFETENSORS_DTYPES": ".checkpoint.reader",
    "read_checkpoint": ".checkpoint.reader",
    # the model families (sources/families/: plain data, no torch) the Megatron builder reads
    "family_for": ".families",
    "model_types": ".families",
    "tp_split_dim": ".megatron.walk",
    # many senders (vLLM 0.34's NCCL engine): who is in the transfer group
    "broadcast_ranks": ".core.senders",
    # LoRA adapter only (PEFT's saved names), gathered from a sharded PEFT model (sources/fsdp/adapter.py)
    "LoRAAdapterSource": ".fsdp.adapter",
}

__all__ = [
    "FSDPSource",
    "MegatronSource",
    "SafetensorsSource",
    "FP8Source",
    "quantized",
    "FP8Config",
    "DeltaSource",
    "Delta",
    "DeltaStats",
    "DeltaError",
    "quantize_blocks",
    "dequantize_blocks",
    "CheckedSource",
    "checked",
    "check_stream",
    "verify_metadata_agreement",
    *_errors.__all__,  # every weightsync error, as core/errors.py lists them
    # for weightsync.plugins (see _LAZY)
    "get_logger",
    "configure_logging",
    "PassStats",
    "control_group",
    "DEFAULT_TIMEOUT_S",
    "Board",
    "active_board",
    "group_ranks",
    "next_tag",
    "checksum",
    "checksum_tensor",
    "hf_root",
    "INDEX_FILE",
    "SINGLE_FILE",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "read_checkpoint",
    "family_for",
    "model_types",
    "tp_split_dim",
    "broadcast_ranks",
    "LoRAAdapterSource",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
