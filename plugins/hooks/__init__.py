"""Training-loop hooks: each drives ``weightsync.plugins.sync.WeightSync`` from one framework's loop.

* ``transformers.WeightSyncCallback`` -- ``transformers.Trainer`` and TRL trainers;
* ``lightning.WeightSyncCallback`` -- Lightning;
* ``megatron.MegatronWeightSync`` -- a Megatron-core loop (one call after the optimizer step);
* ``accelerate.source_from_accelerator`` -- the source for a model ``accelerate`` prepared.

The HF / TRL and Lightning callbacks also drive ``weightsync.plugins.lora_adapter.LoRAAdapterSync``
(adapter-only LoRA), given as ``sync`` or switched to by their one option ``adapter_only=``;
``source_from_accelerator(..., adapter_only=True)`` builds its source (``late.py``).

Nothing is imported here: each hook imports its own framework, only when it is used. The README's
paths ``weightsync.plugins.transformers`` / ``.lightning`` / ``.accelerate`` re-export these modules.
"""
