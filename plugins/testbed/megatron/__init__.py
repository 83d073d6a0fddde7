"""A megatron-core ``GPTModel`` for a transformers config, built on CPU ranks (the CLI's ``--layout
megatron``, the Megatron tests and benches) -- scaffolding, not a trainer.

Invariant: the model has exactly the parameters -- names, TP/PP/VPP/EP shards, shapes -- that a
megatron-core trainer of the same config would hold (local spec, ``use_cpu_initialization=True``),
so ``MegatronSource`` over it declares and streams what it would over a real trainer. Values are
megatron's random init until ``load_hf_weights`` lays a Hugging Face checkpoint's tensors into it
(the CLI does, so that a preset is the same model in every layout).

One job per module:

* ``config``      -- ``megatron_config``: the family's table + parallel sizes + the CPU choices;
  ``MegatronParallel``, ``SUPPORTED_MODEL_TYPES``;
* ``cpu_patches`` -- the construction-only patches a CPU host without Transformer Engine needs;
* ``substitutes`` -- modules standing in where only TE has one (``MLACoreAttention``,
  ``ZeroCenteredRMSNorm``, ``DuplicatedLinear``);
* ``specs``       -- the layer specs built from the local spec and those substitutes (MLA / DSA,
  gated-delta-net hybrids and their MTP block);
* ``build``       -- ``build_megatron_gpt`` / ``build_chunks``: parallel state and the chunks;
* ``hf_weights``  -- ``load_hf_weights``: checkpoint tensors laid out as Megatron holds them.

Supported: every ``model_type`` of ``weightsync.sources.families`` (``SUPPORTED_MODEL_TYPES``) --
dense (llama, mistral, qwen2, qwen3), MoE (shared experts and gates, partial rotary as
``rotary_percent``), MLA + MoE (first-k dense layers, sigmoid group-limited routing with
``e_score_correction_bias``; DSA's indexer), gated-delta-net hybrids (Qwen3-Next, Qwen3.5) and
gpt_oss (attention sinks as ``softmax_type="learnable"``, alternating sliding-window attention,
clamped SwiGLU as ``quick_gelu`` + ``glu_linear_offset`` + ``activation_func_clamp_value``, biases
everywhere: MoE at expert_tensor_parallel_size 1, the only size megatron-core supports MoE biases
at; YaRN rope as ``GPTModel``'s ``position_embedding_type="yarn"`` with its ``yarn_*`` config
attributes). Other families raise ``ValueError`` naming ``model_type``. megatron-core 0.17+ cannot
build MLA without ``q_lora_rank`` from the local spec (its ``QKNormConfigResolver`` then wants TE's
fused norm + ``linear_q_proj``, a norm DeepseekV3 does not have): that raises ``ValueError``;
megatron-core 0.16 builds it.

Imports: ``weightsync.sources`` (public names and ``toolkit``), torch, and megatron-core inside the
functions that need it (importing this package does not import megatron-core).
"""

from __future__ import annotations

from .build import build_chunks, build_megatron_gpt
from .config import SUPPORTED_MODEL_TYPES, VOCAB_DIVISIBLE_BY, MegatronParallel, megatron_config
from .hf_weights import load_hf_weights
from .substitutes import DuplicatedLinear, MLACoreAttention, ZeroCenteredRMSNorm

__all__ = [
    "MegatronParallel",
    "MLACoreAttention",
    "ZeroCenteredRMSNorm",
    "DuplicatedLinear",
    "SUPPORTED_MODEL_TYPES",
    "VOCAB_DIVISIBLE_BY",
    "build_chunks",
    "build_megatron_gpt",
    "load_hf_weights",
    "megatron_config",
]
