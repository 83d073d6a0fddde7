"""weightsync.sources: vLLM ``WeightSource`` implementations for sharded trainers.

Each source turns a trainer-layout model into Hugging Face checkpoint tensors, collectively and in
lockstep on every rank, and checks its own stream against its metadata on every rank.

* ``FSDPSource``      -- plain / FSDP2 / HSDP / FSDP+TP ``torch.nn.Module`` (transformers models).
* ``MegatronSource``  -- megatron-core ``GPTModel`` under TP / PP / VPP / EP / ETP.
* ``SafetensorsSource`` -- a safetensors checkpoint folder (single file or indexed shards).
* ``LoRAAdapterSource`` -- a sharded PEFT model's LoRA adapter only, in PEFT's saved names.
* ``FP8Source``       -- wrap any source: block-FP8 weights + ``weight_scale_inv`` (FP8 rollouts).
* ``DeltaSource``     -- wrap any source: rounds of only the elements that changed (vLLM ``sparse_nccl``).
* ``checked``         -- wrap any ``WeightSource`` with the per-rank stream check.

What lives where (each package's ``__init__`` says what it may import):

* ``fsdp/``, ``megatron/``, ``checkpoint/`` -- one package per kind of trainer model (a source);
* ``quant/``, ``delta/``    -- stream transforms: wrap any source, ask the layout classes what they need;
* ``families/``             -- one declarative file per model family (data, no torch);
* ``core/``                 -- what every source shares, in wings: ``ground`` (errors, logs, stats, the
  dtype policy), ``comm`` (bounded collectives), ``hf`` (Hugging Face naming and conversions),
  ``layouts`` (TP layout kinds, the pieces protocol), ``check`` (the stream check, integrity);
* ``toolkit``               -- what ``weightsync.plugins`` builds on besides the names below.

The sub-packages are private to ``weightsync.sources`` (import contracts in ``pyproject.toml``).
Heavy imports (vLLM, megatron-core) happen only when a name that needs them is first used.
"""

from __future__ import annotations

from .core.ground.lazy import lazy_exports

from .core.ground import errors as _errors
from .core.ground.errors import (
    AdapterStateError,
    CheckpointError,
    CrossRankMismatchError,
    ExchangeError,
    FP8ConfigError,
    IntegrityError,
    MetadataMismatchError,
    PeerFailedError,
    PreflightError,
    SilentTransportError,
    SyncTimeoutError,
    UnmappedParameterError,
    UnsupportedAdapterError,
    WeightSyncError,
)
from .core.ground.logs import configure_logging
from .core.ground.stats import PassStats

# Lazy (PEP 562): ``weightsync.sources.core.ground.errors`` and friends stay importable without vLLM,
# whose import costs seconds; a loopback receiver process or a CLI usage error never pays it.
_LAZY = {
    # the sources
    "FSDPSource": ".fsdp.source",
    "MegatronSource": ".megatron",
    "SafetensorsSource": ".checkpoint.reader",
    "LoRAAdapterSource": ".fsdp.adapter",
    # stream transforms over any source: FP8 rollouts (quant/), delta rounds (delta/)
    "FP8Source": ".quant.source",
    "quantized": ".quant.source",
    "FP8Config": ".quant.config",
    "quantize_blocks": ".quant.fp8",
    "dequantize_blocks": ".quant.fp8",
    "DeltaSource": ".delta.source",
    "Delta": ".delta.source",
    "DeltaStats": ".delta.source",
    "DeltaError": ".delta.source",
    # the per-rank stream check, over any WeightSource (core/check/)
    "CheckedSource": ".core.check.stream",
    "checked": ".core.check.stream",
    "check_stream": ".core.check.stream",
    "verify_metadata_agreement": ".core.check.stream",
    # many senders (vLLM 0.34's NCCL engine): which trainer ranks join the transfer group
    "broadcast_ranks": ".core.comm.senders",
}

__all__ = [
    "FSDPSource",
    "MegatronSource",
    "SafetensorsSource",
    "LoRAAdapterSource",
    "FP8Source",
    "quantized",
    "FP8Config",
    "quantize_blocks",
    "dequantize_blocks",
    "DeltaSource",
    "Delta",
    "DeltaStats",
    "DeltaError",
    "CheckedSource",
    "checked",
    "check_stream",
    "verify_metadata_agreement",
    "broadcast_ranks",
    *_errors.__all__,  # every weightsync error, as core/ground/errors.py lists them
    "configure_logging",
    "PassStats",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
