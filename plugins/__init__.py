"""weightsync.plugins: what drives a sync from a training loop, one sub-package per product.

* ``sync/``         -- ``WeightSync`` (the driver), ``VLLMHTTPClient``, the transport preflight,
  ``SyncReport``, the engine capabilities the driver reads (``sync/capabilities.py``);
* ``hooks/``        -- transformers / TRL, Lightning and Megatron loop hooks, accelerate's source
  (also at ``weightsync.plugins.transformers`` / ``.lightning`` / ``.accelerate`` / ``.trl``);
* ``lora_adapter/`` -- ``LoRAAdapterSync``: only a PEFT model's LoRA adapter, loaded by vLLM's LoRA serving;
* ``checkpoint/``   -- ``save_safetensors``: a Hugging Face checkpoint folder from any source;
  ``save_delta`` / ``apply_delta``: delta patch files;
* ``loopback/``     -- the CPU loopback transport, both ends: the trainer engines (``trainer/``), the
  receiver that stands in for vLLM (``receiver/``, never imports vLLM) and the worker engine a real
  vLLM server runs with weightsync's vLLM plugin entry point (``worker/``);
* ``planner/``      -- ``weightsync plan``: a refit's time and memory, predicted;
* ``cli/``          -- the ``weightsync`` command (demo, check, export, plan);
* ``testbed/``      -- scaffolding, not product: the tiny presets, the CPU Megatron builder, the demo's
  vLLM server, the FP8 demo model.

Layers (import-linter, ``pyproject.toml``): ``cli`` > ``hooks | checkpoint | loopback | planner`` >
``sync | lora_adapter`` > ``testbed``; a layer imports only those below it. Plugins use only what
``weightsync.sources`` and ``weightsync.sources.toolkit`` export. Names are exported lazily (``_LAZY``:
name -> submodule), so ``import weightsync.plugins`` stays cheap and a plugin's heavy dependencies load
only when it is used. To add a name, add one line to ``_LAZY``.
"""

from __future__ import annotations

from weightsync.sources.toolkit import lazy_exports

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
    "LoopbackTrainerInitInfo": ".loopback.trainer",
    "LoopbackTrainerWeightTransferEngine": ".loopback.trainer",
    "LoopbackSparseTrainerInitInfo": ".loopback.trainer",
    "LoopbackSparseTrainerWeightTransferEngine": ".loopback.trainer",
    "LoopbackReceiver": ".loopback.receiver",
    "ChecksumMismatchError": ".loopback.receiver",
    "ReceiverServer": ".loopback.receiver",
    "ReceiverClient": ".loopback.receiver",
    "ReceiverHandle": ".loopback.receiver",
    "start_receiver_process": ".loopback.receiver",
    "TensorsModel": ".loopback.receiver",
    # adapter-only LoRA syncs into vLLM's LoRA serving (plugins/lora_adapter/)
    "LoRAAdapterSync": ".lora_adapter",
    "AdapterRefusedError": ".lora_adapter",
    "AdapterSyncReport": ".lora_adapter",
    # delta patch files (one DeltaSource round as a sparse safetensors file; a chain applied to a folder)
    "save_delta": ".checkpoint",
    "apply_delta": ".checkpoint",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
