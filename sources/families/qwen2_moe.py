"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention (q/k/v biases unless ``qkv_bias=False``);
Qwen3-MoE's layer rule; a shared expert (``mlp.shared_expert``) scaled by a sigmoid gate
(``mlp.shared_expert_gate``, Megatron's ``moe_shared_expert_gate``) when
``shared_expert_intermediate_size`` is set."""

from typing import Any

from . import qwen3_moe
from .base import Family, Field, MoERoles, flag


def megatron(hf: Any) -> dict[str, Field]:
    shared = getattr(hf, "shared_expert_intermediate_size", 0) or None
    if not shared:
        return qwen3_moe.megatron(hf)
    return qwen3_moe.megatron(
        hf,
        moe_shared_expert_intermediate_size=("shared_expert_intermediate_size", shared),
        moe_shared_expert_gate=("(shared_expert_gate)", True),
    )


FAMILY = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    qkv_bias=flag("qkv_bias", True),
    moe=MoERoles(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate.weight"),
    megatron=megatron,
)
