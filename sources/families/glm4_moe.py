"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): grouped-query attention with partial rotary
embeddings, q/k/v biases iff ``attention_bias`` (never an o_proj bias), per-head q/k RMSNorm iff
``use_qk_norm``; the first ``first_k_dense_replace`` layers dense, then routed experts plus shared
experts (``mlp.shared_experts``, ``n_shared_experts * moe_intermediate_size`` wide, no gate) and a
sigmoid group-limited router with ``e_score_correction_bias`` (``n_group``, ``topk_group``,
``routed_scaling_factor``) -- DeepSeek-V3's MoE on a fused ``linear_qkv`` attention.

Megatron: ``rotary_percent`` (a ``GPTModel`` argument) is ``partial_rotary_factor``. Both sides
rotate the first ``int(head_dim * factor)`` channels of each head with rotate-half pairs (HF's
``apply_rotary_pos_emb``, megatron's ``rotary_interleaved=False``) and pass the rest through. The
router's expert bias (a buffer) is ``e_score_correction_bias``.
Checkpoint names come from the shared tables and transformers' reversal (experts per expert:
``mlp.experts.{e}.gate_proj.weight`` ...).

Nothing GLM-specific is refused: a checkpoint config the Megatron model disagrees with raises by
the shared checks (shapes, q/k/v bias, q/k norm, expert count, expert bias, shared experts). Two
router settings are exported as they are although megatron-core *computes* them differently from
transformers (the weights are the same): ``norm_topk_prob=False`` (megatron's sigmoid router always
renormalises the top-k weights) and group-limited routing where transformers' score of a group (its
top 2 experts) is not megatron's (its top ``num_experts_per_tok // topk_group``); real GLM-4.5 /
4.6 configs have neither (``norm_topk_prob=True``, ``n_group=1``). The multi-token-prediction layer
of real checkpoints (``num_nextn_predict_layers``) is not part of transformers' model: the policy
export leaves it out, ``MegatronSource(part="mtp")`` exports it under DeepSeek-V3's MTP names.
"""

from __future__ import annotations

from typing import Any

from .base import Family, Field, MoERoles, flag
from .deepseek_v3 import MTP, sigmoid_moe_fields

__all__ = ["FAMILY", "partial_rotary_factor"]


def partial_rotary_factor(hf: Any) -> float:
    """The rotated fraction of each head: ``rope_parameters["partial_rotary_factor"]``
    (transformers 5), else the config's own field (4.x), else GLM's default 0.5 (what
    transformers' ``Glm4MoeConfig`` and vLLM assume)."""
    rope = getattr(hf, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    return float(0.5 if factor is None else factor)


def megatron(hf: Any) -> dict[str, Field]:
    """DeepSeek-V3's MoE fields (same HF names, same routing); GQA attention comes from the flags."""
    return sigmoid_moe_fields(hf)


def gpt_model(hf: Any) -> dict[str, Field]:
    return {"rotary_percent": Field("rope_parameters.partial_rotary_factor", partial_rotary_factor(hf))}


FAMILY = Family(
    "glm4_moe",
    ("Glm4MoeForCausalLM",),
    qkv_bias=flag("attention_bias"),
    qk_norm=flag("use_qk_norm"),
    moe=MoERoles(router_bias="mlp.gate.e_score_correction_bias", shared="mlp.shared_experts"),
    megatron=megatron,
    gpt_model=gpt_model,
    mtp=MTP,  # vLLM's glm4_moe_mtp loads DeepSeek-V3's MTP names
)
