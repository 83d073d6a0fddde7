"""Mixtral (``MixtralForCausalLM``): Mistral attention, every layer MoE; no shared expert, softmax
top-k router. ``intermediate_size`` is the *expert* size (there is no dense MLP). The checkpoint
names (``block_sparse_moe.gate``, ``experts.{e}.w1/w3/w2``) come from transformers' reversal."""

from typing import Any

from .base import Family, Field, MoERoles, moe_fields


def megatron(hf: Any) -> dict[str, Field]:
    return moe_fields(
        experts=("num_local_experts", hf.num_local_experts),
        ffn=("intermediate_size", hf.intermediate_size),
        topk=("num_experts_per_tok", hf.num_experts_per_tok),
        freq=("(every layer)", 1),
        moe_router_pre_softmax=("(top-k weights renormalised)", False),
    )


FAMILY = Family("mixtral", ("MixtralForCausalLM",), moe=MoERoles(), megatron=megatron)
