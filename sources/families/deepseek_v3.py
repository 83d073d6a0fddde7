"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (``DeepseekV3ForCausalLM``): multi-head latent attention
(megatron-core ``MLASelfAttention`` / ``MLATransformerConfig``) and MoE with first-k dense layers,
shared experts and sigmoid group-limited routing with ``e_score_correction_bias``.

``MLA`` is the attention table: per Megatron tensor (local-spec names) the HF tensor(s) it is, in HF
order, the TP splits its module may declare (a kind per split dim; ``sources/megatron/mla.py``
states what was verified: row orders are the same on both sides, so TP shards are plain chunks) and
its full HF shape from the MLA sizes. The down projections are column-parallel in the local spec
and duplicated (TE ``TELinear``) in the TE spec; megatron-core 0.17+ may fuse both into
``linear_qkv_down_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]``.

Refused (``UnmappedParameterError`` naming the field): HF ``attention_bias=True`` and
``rope_interleave=False`` (no megatron-core MLA computes them); Megatron MLA without latent norms,
with ``rotary_interleaved=True`` or an ``experimental_attention_variant`` (``MEGATRON_REFUSALS``).
The builder also refuses ``q_lora_rank=None`` on megatron-core 0.17+ (``unbuildable``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, NamedTuple

from ..core.ground.errors import UnmappedParameterError
from .base import Entry, Family, Field, MoERoles, MTPNames, moe_fields, rope_theta

__all__ = [
    "FAMILY", "MLA", "MLATensor", "MEGATRON_REFUSALS", "MTP", "hf_rope", "sigmoid_moe_fields",
    "refuse_attention_variant", "refuse_no_latent_norms", "refuse_rotary_interleaved",
]


class MLATensor(NamedTuple):
    """One MLA Megatron tensor: its entry (local-spec kind, HF names), the kind for each TP split
    dim its module may declare, and its full HF shape(s) from the MLA sizes ``g``."""

    entry: Entry
    splits: dict[int | None, str]
    shapes: Callable[[Any], tuple[tuple[int, ...], ...]]


_Q_A, _KV_A = "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"
_COL, _ROW, _REP = {0: "column"}, {1: "row"}, {None: "replicated"}
_DOWN = {0: "column", None: "replicated"}


def _kv_a(g: Any) -> int:
    return g.kv_lora_rank + g.qk_rope_head_dim


#: Megatron MLA tensor (local-spec name) -> ``MLATensor``, in HF order.
MLA: dict[str, MLATensor] = {
    "input_layernorm.weight": MLATensor(Entry("replicated", ("input_layernorm.weight",)), _REP, lambda g: ((g.hidden,),)),
    "self_attention.linear_q_proj.weight": MLATensor(
        Entry("column", ("self_attn.q_proj.weight",)), _COL, lambda g: ((g.heads * g.q_head_dim, g.hidden),)
    ),
    "self_attention.linear_q_down_proj.weight": MLATensor(
        Entry("column", (_Q_A,)), _DOWN, lambda g: ((g.q_lora_rank or 0, g.hidden),)
    ),
    "self_attention.linear_qkv_down_proj.weight": MLATensor(
        Entry("stack_column", (_Q_A, _KV_A)), {0: "stack_column", None: "stack"},
        lambda g: ((g.q_lora_rank or 0, g.hidden), (_kv_a(g), g.hidden)),
    ),
    "self_attention.q_layernorm.weight": MLATensor(
        Entry("replicated", ("self_attn.q_a_layernorm.weight",)), _REP, lambda g: ((g.q_lora_rank or 0,),)
    ),
    "self_attention.linear_q_up_proj.weight": MLATensor(
        Entry("column", ("self_attn.q_b_proj.weight",)), _COL,
        lambda g: ((g.heads * g.q_head_dim, g.q_lora_rank or g.hidden),),
    ),
    "self_attention.linear_kv_down_proj.weight": MLATensor(
        Entry("column", (_KV_A,)), _DOWN, lambda g: ((_kv_a(g), g.hidden),)
    ),
    "self_attention.kv_layernorm.weight": MLATensor(
        Entry("replicated", ("self_attn.kv_a_layernorm.weight",)), _REP, lambda g: ((g.kv_lora_rank,),)
    ),
    "self_attention.linear_kv_up_proj.weight": MLATensor(
        Entry("column", ("self_attn.kv_b_proj.weight",)), _COL,
        lambda g: ((g.heads * (g.qk_nope_head_dim + g.v_head_dim), g.kv_lora_rank),),
    ),
    "self_attention.linear_proj.weight": MLATensor(
        Entry("row", ("self_attn.o_proj.weight",)), _ROW, lambda g: ((g.hidden, g.heads * g.v_head_dim),)
    ),
}
_FUSED_DOWN = "self_attention.linear_qkv_down_proj.weight"
_SPLIT_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")
_Q_LORA = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.weight",
)


def layer_table(family: Family, hf: Any, fused_down: bool) -> dict[str, Entry]:
    """The attention half of a layer for ``hf`` (q low-rank or not; fused down projection or not)."""
    if getattr(hf, "q_lora_rank", None):
        skip = {"self_attention.linear_q_proj.weight"}
    else:
        skip = set(_Q_LORA)
        if fused_down:
            raise UnmappedParameterError(
                "Megatron's fused linear_qkv_down_proj needs q_lora_rank, but hf_config.q_lora_rank is not set"
            )
    skip |= set(_SPLIT_DOWN) if fused_down else {_FUSED_DOWN}
    return {k: t.entry for k, t in MLA.items() if k not in skip}


def hf_rope(hf: Any) -> dict[str, Any]:
    """HF rope parameters (transformers 5 ``rope_parameters``, or 4.x ``rope_scaling`` + ``rope_theta``):
    ``rope_parameters`` wins; ``rope_type`` defaults to ``"default"``."""
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope["rope_theta"] = rope_theta(hf)
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _attention_fields(hf: Any) -> dict[str, Field]:
    """``MLATransformerConfig`` attention fields: megatron's ``"rope"`` for HF's default rope, its
    ``"yarn"`` with HF's factors for HF's yarn."""
    rope = hf_rope(hf)
    out = {
        "q_lora_rank": Field("q_lora_rank", getattr(hf, "q_lora_rank", None) or None),
        "kv_lora_rank": Field("kv_lora_rank", hf.kv_lora_rank),
        "qk_head_dim": Field("qk_nope_head_dim", hf.qk_nope_head_dim),
        "qk_pos_emb_head_dim": Field("qk_rope_head_dim", hf.qk_rope_head_dim),
        "v_head_dim": Field("v_head_dim", hf.v_head_dim),
        "qk_layernorm": Field("(q_a_layernorm / kv_a_layernorm)", True),
        "rotary_interleaved": Field("rope_interleave", False),
        "rope_type": Field("rope_parameters.rope_type", "yarn" if rope["rope_type"] == "yarn" else "rope"),
        "rotary_base": Field("rope_parameters.rope_theta", rope["rope_theta"]),
    }
    if rope["rope_type"] == "yarn":
        out.update(
            rotary_scaling_factor=Field("rope_parameters.factor", float(rope["factor"])),
            original_max_position_embeddings=Field(
                "rope_parameters.original_max_position_embeddings", rope.get("original_max_position_embeddings", 4096)
            ),
            beta_fast=Field("rope_parameters.beta_fast", rope.get("beta_fast", 32)),
            beta_slow=Field("rope_parameters.beta_slow", rope.get("beta_slow", 1)),
            mscale=Field("rope_parameters.mscale", rope.get("mscale", 1.0)),
            mscale_all_dim=Field("rope_parameters.mscale_all_dim", rope.get("mscale_all_dim", 0.0)),
        )
    return out


def megatron(hf: Any) -> dict[str, Field]:
    return {**_attention_fields(hf), **sigmoid_moe_fields(hf)}


def sigmoid_moe_fields(hf: Any) -> dict[str, Field]:
    """DeepSeek-style MoE (``first_k_dense_replace`` dense layers, ``n_shared_experts``, sigmoid
    group-limited routing with ``e_score_correction_bias``): the fields GLM-4.5 shares."""
    first = getattr(hf, "first_k_dense_replace", 0) or 0
    shared = (getattr(hf, "n_shared_experts", 0) or 0) * hf.moe_intermediate_size
    moe = moe_fields(
        experts=("n_routed_experts", hf.n_routed_experts),
        ffn=("moe_intermediate_size", hf.moe_intermediate_size),
        topk=("num_experts_per_tok", hf.num_experts_per_tok),
        freq=("first_k_dense_replace", [int(i >= first) for i in range(hf.num_hidden_layers)]),
        moe_shared_expert_intermediate_size=("n_shared_experts * moe_intermediate_size", shared or None),
        moe_router_enable_expert_bias=("(e_score_correction_bias)", True),
        moe_router_score_function=("scoring_func", "sigmoid"),
        moe_router_num_groups=("n_group", hf.n_group),
        moe_router_group_topk=("topk_group", hf.topk_group),
        moe_router_topk_scaling_factor=("routed_scaling_factor", hf.routed_scaling_factor),
        moe_router_load_balancing_type=("(no aux loss)", "none"),
        moe_aux_loss_coeff=("(no aux loss)", 0.0),
    )
    return moe


def unsupported(hf: Any, *, always_interleaved: bool = False) -> str | None:
    """HF-side DeepseekV3 attention variants no megatron-core ``MLASelfAttention`` computes
    (``always_interleaved``: the model has no ``rope_interleave`` switch, e.g. DeepSeek-V3.2)."""
    why = []
    if getattr(hf, "attention_bias", False):
        why.append(
            "attention_bias=True (q_a_proj / kv_a_proj_with_mqa / o_proj biases): megatron-core's MLA "
            "builds its q/kv projections without bias"
        )
    if not always_interleaved and not getattr(hf, "rope_interleave", True):
        why.append(
            "rope_interleave=False: megatron-core's MLA rope rotates the interleaved pairs (x0, x1), "
            "(x2, x3), ... of the rope dims, which is HF's rope_interleave=True"
        )
    return "; ".join(why) or None


def unbuildable(hf: Any) -> str | None:
    """What the local-spec builder cannot build for ``hf``."""
    if getattr(hf, "q_lora_rank", None) is None and importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config"):
        return (
            "model_type='deepseek_v3' with q_lora_rank=None: this megatron-core's MLA "
            "(QKNormConfigResolver) builds linear_q_proj only as TE's fused norm+linear, a q norm "
            "DeepseekV3 does not have, so no local-spec model matches it; set q_lora_rank"
        )
    return None


def refuse_no_latent_norms(mcfg: Any) -> str | None:
    """An MLA without q/kv latent norms (``qk_layernorm=False``): DeepseekV3 always has them."""
    if getattr(mcfg, "qk_layernorm", False):
        return None
    return "qk_layernorm=False: this MLA has no q/kv latent norms, DeepseekV3 always applies q_a_layernorm / kv_a_layernorm"


def refuse_rotary_interleaved(mcfg: Any) -> str | None:
    """Megatron's ``rotary_interleaved=True``: other rope pairs than DeepseekV3 rotates."""
    if not getattr(mcfg, "rotary_interleaved", False):
        return None
    return "rotary_interleaved=True: rotates other rope pairs than DeepseekV3 (rope_interleave=True)"


def refuse_attention_variant(mcfg: Any) -> str | None:
    """Any ``experimental_attention_variant``: its extra parameters have no DeepseekV3 tensors."""
    variant = getattr(mcfg, "experimental_attention_variant", None)
    if not variant:
        return None
    return (
        f"experimental_attention_variant={variant!r}: its extra attention parameters (e.g. DSA's "
        "indexer) have no DeepseekV3 tensors"
    )


#: DeepSeek-V3's multi-token-prediction layers as the released checkpoint names them (vLLM's
#: ``deepseek_mtp.DeepSeekMTP.load_weights`` reads them: MTP layer ``i`` is ``model.layers.{n}``,
#: ``n = num_hidden_layers + i``, a full decoder layer plus its own norms, projection and copies of
#: the embedding and output head). GLM-4.5, DeepSeek-V3.2 and GLM-5 name theirs the same way.
MTP = MTPNames(
    layer="model.layers.{n}.",
    enorm="model.layers.{n}.enorm.weight",
    hnorm="model.layers.{n}.hnorm.weight",
    eh_proj="model.layers.{n}.eh_proj.weight",
    final_norm="model.layers.{n}.shared_head.norm.weight",
    embed="model.layers.{n}.embed_tokens.weight",
    head="model.layers.{n}.shared_head.head.weight",
)

#: Megatron-side MLA variants with no DeepseekV3 counterpart: ``mcfg -> reason or None``.
MEGATRON_REFUSALS: tuple[Callable[[Any], str | None], ...] = (
    refuse_no_latent_norms, refuse_rotary_interleaved, refuse_attention_variant,
)

FAMILY = Family(
    "deepseek_v3",
    ("DeepseekV3ForCausalLM",),
    moe=MoERoles(router_bias="mlp.gate.e_score_correction_bias", shared="mlp.shared_experts"),
    megatron=megatron,
    attention="mla",
    layer_table=layer_table,
    unsupported=unsupported,
    unbuildable=unbuildable,
    mtp=MTP,
)
