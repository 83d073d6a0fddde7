"""``FSDPSource``: plain / FSDP2 / HSDP / FSDP+TP transformers models (and PEFT LoRA, merged) as
Hugging Face checkpoint tensors, one gather per FSDP unit and mesh; ``LoRAAdapterSource``: a PEFT
adapter's own tensors.

* ``source``     -- ``FSDPSource`` itself: metadata, the full / local / pieces passes, the checks.
* ``plan``       -- which tensors gather together, in metadata order; HSDP replicas for many senders.
* ``shards``     -- one DTensor shard: its local tensor, its gather device, the ``full_tensor()`` fallback.
* ``gather``     -- one batched all-gather of many shards (``GatherShard``, ``BatchedGather``).
* ``prefetch``   -- overlap: gathers posted ahead of the consumer, in the same order on every rank.
* ``buffers``    -- host scratch buffers recycled within a pass (CPU gathers).
* ``pieces``     -- the pieces protocol (``core/layouts/pieces.py``) fed by ``FSDPPiecesView``.
* ``lora``       -- what a PEFT LoRA model exports and the merge itself (``LoraPlan``, ``merge_lora``).
* ``lora_items`` -- a PEFT pass's gathered items (a merged base and its A/B) and their merge on emit.
* ``adapter``    -- ``LoRAAdapterSource``: only the adapter, in PEFT's saved names.

May import ``weightsync.sources.core`` (checkpoint names, conversions and experts from ``core.hf``;
checks, collectives, ground) and, by the layers contract, ``weightsync.sources.families``; never a
sibling source (``megatron``, ``checkpoint``), a stream transform (``delta``, ``quant``) or
``weightsync.plugins``.
"""
