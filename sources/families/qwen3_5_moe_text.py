"""Qwen3.5 MoE text model (``Qwen3_5MoeForCausalLM``, ``model_type="qwen3_5_moe_text"``): Qwen3.5's
hybrid decoder and in-projection (``qwen3_5_text.py``) with a MoE MLP on every layer: routed experts
(softmax, top-k, always renormalised: ``Qwen3_5MoeTopKRouter``), ``shared_expert`` and
``shared_expert_gate`` (Qwen2-MoE's roles). The config has no dense ``intermediate_size``: Megatron's
``ffn_hidden_size`` (never built, every layer is MoE) is set to the expert size."""

from typing import Any

from .base import Field, moe_fields
from .qwen3_next import gdn_family, gdn_fields


def megatron(hf: Any) -> dict[str, Field]:
    out = gdn_fields(hf)
    out.update(moe_fields(
        experts=("num_experts", hf.num_experts),
        ffn=("moe_intermediate_size", hf.moe_intermediate_size),
        topk=("num_experts_per_tok", hf.num_experts_per_tok),
        freq=("(every layer)", 1),
        moe_router_pre_softmax=("(top-k renormalised)", False),
        moe_shared_expert_intermediate_size=("shared_expert_intermediate_size", hf.shared_expert_intermediate_size),
        moe_shared_expert_gate=("(shared_expert_gate)", True),
    ))
    out["ffn_hidden_size"] = Field("moe_intermediate_size (no dense layer)", hf.moe_intermediate_size)
    return out


FAMILY = gdn_family(
    "qwen3_5_moe_text",
    ("Qwen3_5MoeForCausalLM",),
    "gdn_qkv_z_b_a",
    ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
    lambda qk, v, nv: (2 * qk + v, v, nv, nv),
    megatron_fields=megatron,
    mtp_count="mtp_num_hidden_layers",
)
