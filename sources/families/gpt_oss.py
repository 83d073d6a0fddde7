"""GPT-OSS (``GptOssForCausalLM``): grouped-query attention with q/k/v and o_proj biases (iff
``attention_bias``, always in released checkpoints) and one learnable attention sink per query head
(``self_attn.sinks``), sliding-window and full attention by ``layer_types`` (alternating), YaRN rope;
every layer MoE: a router with a bias (``mlp.router.weight`` / ``bias``; top-k of the logits, then a
softmax over those k) and experts with biases and a clamped SwiGLU, which transformers keeps fused --
in memory and in ``save_pretrained`` alike: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (input dim
first, gate and up columns interleaved), ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj``
``[E, I, H]``, ``down_proj_bias`` ``[E, H]``. The expert layout is read off transformers (its
reversal keeps those tensors; the experts module declares transposed / interleaved / biased), not
written here (``sources/core/hf/experts.py``); vLLM's gpt_oss loader reads those fused tensors, and
each one's slice per expert (``mlp.experts.{e}.gate_up_proj`` ..., its streamed names).

Megatron (local spec, megatron-core 0.16.1 and 0.19.2; ``SequentialMLP`` or TE's grouped experts):
sinks are core attention's ``softmax_offset`` (``softmax_type="learnable"``, split over TP by head);
sliding layers ``window_size=(sliding_window - 1, 0)`` chosen per layer by a
``window_attn_skip_freq`` list; the gate activation ``x * sigmoid(1.702 x)`` is ``quick_gelu``,
``(up + 1)`` is ``glu_linear_offset=1`` and ``swiglu_limit`` is ``activation_func_clamp_value``;
every bias comes from ``add_bias_linear`` (so MoE runs at expert_tensor_parallel_size 1, the only
size megatron-core allows biased experts at); Megatron's ``linear_fc1`` holds ``[gate; up]`` rows
where transformers interleaves them; YaRN is ``GPTModel(position_embedding_type="yarn")`` with the
``yarn_*`` config attributes megatron-core reads (not ``TransformerConfig`` fields).

Refused (``unsupported``): ``attention_bias=False`` -- megatron's ``add_bias_linear``, which the
router and expert biases need, gives q/k/v and o_proj biases too. Exported as they are although
megatron-core computes them differently from transformers (same weights): ``swiglu_alpha`` other
than 1.702 (``quick_gelu``'s constant) and rope types other than default / YaRN.
"""

from __future__ import annotations

from typing import Any

from .base import ALWAYS, Family, Field, MoERoles, flag, moe_fields

__all__ = ["FAMILY", "hf_rope"]


def hf_rope(hf: Any) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x), ``rope_type`` defaulted."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _windows(hf: Any) -> dict[str, Field]:
    kinds = list(getattr(hf, "layer_types", None) or [])
    sliding = [int(k == "sliding_attention") for k in kinds]
    if not any(sliding) or not getattr(hf, "sliding_window", None):
        return {}
    return {
        "window_size": Field("sliding_window", (hf.sliding_window - 1, 0)),  # the last W keys, self included
        "window_attn_skip_freq": Field("layer_types", sliding),
    }


def _yarn(hf: Any) -> dict[str, Field]:
    rope = hf_rope(hf)
    if rope["rope_type"] != "yarn":
        return {}
    return {
        "yarn_rotary_scaling_factor": Field("rope_parameters.factor", float(rope["factor"])),
        "yarn_original_max_position_embeddings": Field(
            "rope_parameters.original_max_position_embeddings", rope.get("original_max_position_embeddings")
        ),
        "yarn_beta_fast": Field("rope_parameters.beta_fast", float(rope.get("beta_fast", 32.0))),
        "yarn_beta_slow": Field("rope_parameters.beta_slow", float(rope.get("beta_slow", 1.0))),
        "yarn_mscale": Field("rope_parameters.mscale", rope.get("mscale")),
        "yarn_mscale_all_dim": Field("rope_parameters.mscale_all_dim", rope.get("mscale_all_dim")),
        "yarn_correction_range_round_to_int": Field("rope_parameters.truncate", bool(rope.get("truncate", True))),
    }


def megatron(hf: Any) -> dict[str, Field]:
    out = moe_fields(
        experts=("num_local_experts", hf.num_local_experts),
        ffn=("intermediate_size", hf.intermediate_size),
        topk=("num_experts_per_tok", hf.num_experts_per_tok),
        freq=("(every layer)", 1),
        moe_router_score_function=("(softmax router)", "softmax"),
        moe_router_pre_softmax=("(top-k, then a softmax over the k logits)", False),
        moe_router_load_balancing_type=("(no aux loss)", "none"),
        moe_aux_loss_coeff=("(no aux loss)", 0.0),
    )
    out.update(
        add_bias_linear=Field("attention_bias (and the router and expert biases)", True),
        softmax_type=Field("(self_attn.sinks)", "learnable"),
        activation_func=Field("swiglu_alpha", "quick_gelu"),
        glu_linear_offset=Field("(up + 1)", 1.0),
        activation_func_clamp_value=Field("swiglu_limit", float(getattr(hf, "swiglu_limit", 7.0))),  # <5.20: fixed
        **_windows(hf),
        **_yarn(hf),
    )
    return out


def gpt_model(hf: Any) -> dict[str, Field]:
    if hf_rope(hf)["rope_type"] == "yarn":
        return {"position_embedding_type": Field("rope_parameters.rope_type", "yarn")}
    return {}


def unsupported(hf: Any) -> str | None:
    if not getattr(hf, "attention_bias", True):
        return (
            "attention_bias=False: megatron-core's add_bias_linear, which GPT-OSS's router and expert "
            "biases need, also gives linear_qkv and linear_proj biases"
        )
    return None


FAMILY = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    qkv_bias=flag("attention_bias", True),
    o_bias=flag("attention_bias", True),
    sinks=ALWAYS,
    moe=MoERoles(router="mlp.router.weight", router_linear_bias="mlp.router.bias"),
    megatron=megatron,
    gpt_model=gpt_model,
    unsupported=unsupported,
)
