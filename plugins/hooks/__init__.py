"""Training-loop hooks: each drives ``weightsync.plugins.sync.WeightSync`` from one framework's loop.

* ``transformers.WeightSyncCallback`` -- ``transformers.Trainer`` and TRL trainers;
* ``trl.WeightSyncGRPOTrainer`` / ``trl_async.WeightSyncAsyncGRPOTrainer`` -- TRL's GRPO (and its
  asynchronous GRPO) generating from a vLLM server, with weightsync's sync instead of TRL's;
* ``lightning.WeightSyncCallback`` -- Lightning;
* ``megatron.MegatronWeightSync`` -- a Megatron-core loop (one call after the optimizer step);
* ``accelerate.source_from_accelerator`` -- the source for a model ``accelerate`` prepared;
* ``late`` -- what the callbacks share: the sync given now or built once the framework has prepared
  the model, full or adapter-only.

The HF / TRL and Lightning callbacks also drive ``weightsync.plugins.lora_adapter.LoRAAdapterSync``
(adapter-only LoRA), given as ``sync`` or switched to by their one option ``adapter_only=``;
``source_from_accelerator(..., adapter_only=True)`` builds its source (``late.py``).

May import: ``weightsync.sources`` and its ``toolkit``, the plugins' layers below (``sync``,
``lora_adapter``, ``testbed``), and each hook its own framework (transformers, Lightning, accelerate,
TRL, megatron-core), only when it is used -- nothing is imported here. Never ``cli`` (above it) nor its
siblings ``loopback``, ``checkpoint``, ``planner``. The README's paths ``weightsync.plugins.transformers``
/ ``.lightning`` / ``.accelerate`` re-export these modules.
"""
