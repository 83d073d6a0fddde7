"""weightsync.plugins: what drives a sync from a training loop, one sub-package per product.

* ``sync/``            -- ``WeightSync`` (the driver), ``VLLMHTTPClient``, the transport preflight,
  ``SyncReport``;
* ``hooks/``           -- transformers / TRL, Lightning and Megatron loop hooks, accelerate's source
  (also at ``weightsync.plugins.transformers`` / ``.lightning`` / ``.accelerate``);
* ``loopback/``        -- the CPU ``"loopback"`` and ``"loopback_sparse"`` (delta rounds) engines,
  trainer end (importing it registers them in vLLM's ``WeightTransferTrainerFactory``);
* ``loopback_server/`` -- the loopback receiving end: receiver, HTTP server, process (no vLLM import),
  and the worker engine a real vLLM server runs (``vllm_engine``);
* ``vllm_plugin``      -- weightsync's ``vllm.general_plugins`` entry point: registers that engine as
  ``"loopback"`` in the vLLM it is installed next to;
* ``lora_adapter/``    -- ``LoRAAdapterSync``: only a PEFT model's LoRA adapter, loaded by vLLM's LoRA serving;
* ``checkpoint/``      -- ``save_safetensors``: a Hugging Face checkpoint folder from any source;
  ``save_delta`` / ``apply_delta``: delta patch files;
* ``cli/``             -- the ``weightsync`` command (demo, check, export);
* ``presets``, ``megatron_build`` -- the tiny models the CLI, demo and tests build.

Plugins use only what ``weightsync.sources`` exports (enforced by import-linter: ``lint-imports``,
contracts in ``pyproject.toml``). Names are exported lazily (``_LAZY``: name -> submodule), so
``import weightsync.plugins`` stays cheap and a plugin's heavy dependencies load only when it is
used. To add a name, add one line to ``_LAZY``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    # the sync driver, HTTP control plane, reports, preflight checks
    "WeightSync": ".sync",
    "VLLMHTTPClient": ".sync",
    "RayDraftWeightSyncClient": ".sync",
    "ControlPlaneError": ".sync",
    "InsecureTransportError": ".sync",
    "ServerVersionError": ".sync",
    "SyncReport": ".sync",
    "PreflightError": ".sync",
    "check_engine": ".sync",
    "check_weights_changed": ".sync",
    # training-loop hooks (callbacks: weightsync.plugins.transformers / .lightning.WeightSyncCallback)
    "source_from_accelerator": ".hooks.accelerate",
    "MegatronWeightSync": ".hooks.megatron",
    # CPU loopback backend (test/demo transport speaking vLLM's four-phase protocol over gloo)
    "LoopbackTrainerInitInfo": ".loopback",
    "LoopbackTrainerWeightTransferEngine": ".loopback",
    "LoopbackSparseTrainerInitInfo": ".loopback",
    "LoopbackSparseTrainerWeightTransferEngine": ".loopback",
    "LoopbackReceiver": ".loopback_server",
    "ChecksumMismatchError": ".loopback_server",
    "ReceiverServer": ".loopback_server",
    "ReceiverClient": ".loopback_server",
    "ReceiverHandle": ".loopback_server",
    "start_receiver_process": ".loopback_server",
    "TensorsModel": ".loopback_server",
    # adapter-only LoRA syncs into vLLM's LoRA serving (plugins/lora_adapter/)
    "LoRAAdapterSync": ".lora_adapter",
    "AdapterRefusedError": ".lora_adapter",
    "AdapterSyncReport": ".lora_adapter",
    # delta patch files (one DeltaSource round as a sparse safetensors file; a chain applied to a folder)
    "save_delta": ".checkpoint",
    "apply_delta": ".checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
