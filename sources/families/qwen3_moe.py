"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms; its flags are Qwen3's); MoE on
layers that are not in ``mlp_only_layers`` and fall on ``decoder_sparse_step``; no shared expert."""

from dataclasses import replace
from typing import Any

from .base import Field, MoERoles, moe_fields
from .qwen3 import FAMILY as QWEN3


def sparse_layers(hf: Any) -> list[int]:
    """``moe_layer_freq`` of a Qwen MoE config: 1 where a layer is MoE (transformers' own rule)."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return [
        int(i not in dense and hf.num_experts > 0 and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)
    ]


def megatron(hf: Any, **more: tuple[str, Any]) -> dict[str, Field]:
    """Routed-expert fields of a Qwen MoE config (``more``: e.g. Qwen2-MoE's shared expert)."""
    return moe_fields(
        experts=("num_experts", hf.num_experts),
        ffn=("moe_intermediate_size", hf.moe_intermediate_size),
        topk=("num_experts_per_tok", hf.num_experts_per_tok),
        freq=("mlp_only_layers / decoder_sparse_step", sparse_layers(hf)),
        # transformers: softmax over every expert, top-k, renormalised only with norm_topk_prob;
        # megatron: top-k of the logits then softmax (= renormalised) unless pre_softmax
        moe_router_pre_softmax=("norm_topk_prob", not getattr(hf, "norm_topk_prob", False)),
        **more,
    )


FAMILY = replace(QWEN3, name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), moe=MoERoles(), megatron=megatron)
