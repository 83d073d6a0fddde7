"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid decoder -- ``layer_types`` picks, per layer, a gated
delta net (``linear_attn``: linear attention) or gated full attention (``self_attn``: GQA whose
``q_proj`` also produces a sigmoid output gate, q/k RMSNorm) -- with Qwen2-MoE's MLP (routed experts,
``shared_expert`` + ``shared_expert_gate``; dense ``mlp_only_layers``) and partial rotary embeddings.
The gated-delta-net table here is shared with Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``), which
differs only in how its in-projection is cut into HF tensors.

Megatron-core (0.16.1 and 0.19.2): ``experimental_attention_variant="gated_delta_net"``,
``linear_attention_freq`` = ``layer_types`` as a 1 (linear) / 0 (full) list, the ``linear_*`` head
fields, ``attention_output_gate=True``, ``qk_layernorm=True``, ``rotary_percent`` =
``partial_rotary_factor``. What was read in both codebases (docs/families.md has the detail):

* ``GatedDeltaNet.in_proj`` (column-parallel) per TP rank ``[q | k | v | z | beta | alpha]`` over that
  rank's key heads (q, k) and value heads (v, z, beta, alpha); ``conv1d`` ``[q | k | v]`` channels;
  ``A_log`` / ``dt_bias`` one per value head, split by head; ``out_norm`` replicated, ``out_proj``
  row-parallel (``ssm/gated_delta_net.py``: ``forward``'s ``torch.split`` and
  ``sharded_state_dict``'s ``_split_tensor_factory``). Layout kinds ``gdn_qkvz_ba`` / ``gdn_qkv_z_b_a``
  / ``gdn_conv`` (``core/layouts/tp.py``, class ``GatedDeltaNet``).
* Gated attention: ``linear_qkv`` rows per query group ``[q x hpg | gate x hpg | k | v]``
  (``Attention.get_query_key_value_tensors(output_gate=True)``); HF ``q_proj`` rows per head
  ``[q_h | gate_h]`` (``Qwen3NextAttention.forward``): layout kind ``qkv_gated``.
* Norms: HF's decoder, final and q/k norms compute ``x * (1 + w)`` (``Qwen3NextRMSNorm``, zero init),
  which is megatron's ``layernorm_zero_centered_gamma=True`` (what Megatron-Bridge / real Qwen3-Next
  Megatron models use): same bytes. HF's gated-delta-net output norm computes ``x * w``
  (``Qwen3NextRMSNormGated``, one init) while megatron's ``out_norm`` is zero-centered too:
  ``hf = megatron + 1`` (layout kind ``replicated_plus_one``, added in fp32 before the wire cast).

Refused: HF ``attention_bias=True`` (megatron's gated ``linear_qkv`` bias layout is not built here);
Megatron models with ``layernorm_zero_centered_gamma=False`` or other gated-delta-net settings than
``hf_config`` (``megatron_mismatch``). Not part of transformers' model, so not in the policy export:
the multi-token-prediction weights (``mtp.*``) of released checkpoints; ``MegatronSource(part="mtp")``
exports them (``qwen_mtp``).
"""

from __future__ import annotations

from typing import Any

from . import qwen2_moe
from .base import ATTENTION, Entry, Family, Field, MoERoles, MTPNames

__all__ = ["FAMILY", "gdn_family", "linear_pattern", "qwen_mtp"]

_LA = "linear_attn."


def linear_pattern(hf: Any) -> list[int]:
    """``linear_attention_freq`` as megatron reads a list: 1 where ``layer_types`` is linear attention."""
    return [int(t == "linear_attention") for t in hf.layer_types]


def _gdn_table(in_proj_kind: str, in_proj_names: tuple[str, ...]) -> dict[str, Entry]:
    """A gated-delta-net layer's attention half (local-spec megatron names), in HF order."""
    return {
        "input_layernorm.weight": Entry("replicated", ("input_layernorm.weight",)),
        "self_attention.A_log": Entry("column", (_LA + "A_log",)),
        "self_attention.conv1d.weight": Entry("gdn_conv", (_LA + "conv1d.weight",)),
        "self_attention.dt_bias": Entry("column", (_LA + "dt_bias",)),
        "self_attention.in_proj.weight": Entry(in_proj_kind, tuple(_LA + n for n in in_proj_names)),
        "self_attention.out_norm.weight": Entry("replicated_plus_one", (_LA + "norm.weight",)),
        "self_attention.out_proj.weight": Entry("row", (_LA + "out_proj.weight",)),
    }


_GATED_ATTENTION = {
    k: (Entry("qkv_gated", e.hf) if k == "self_attention.linear_qkv.weight" else e)
    for k, e in ATTENTION.items()
    if k in ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
             "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight")
}


def _heads(hf: Any) -> tuple[int, int, int, int]:
    return (hf.linear_num_key_heads, hf.linear_key_head_dim, hf.linear_num_value_heads, hf.linear_value_head_dim)


def _shapes(in_proj_rows: Any) -> Any:
    def shapes(suffix: str, hf: Any) -> tuple[tuple[int, ...], ...] | None:
        nk, dk, nv, dv = _heads(hf)
        h, qk, v = hf.hidden_size, nk * dk, nv * dv
        d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
        return {
            "self_attention.in_proj.weight": tuple((r, h) for r in in_proj_rows(qk, v, nv)),
            "self_attention.conv1d.weight": ((2 * qk + v, 1, hf.linear_conv_kernel_dim),),
            "self_attention.A_log": ((nv,),),
            "self_attention.dt_bias": ((nv,),),
            "self_attention.out_norm.weight": ((dv,),),
            "self_attention.out_proj.weight": ((h, v),),
            "self_attention.linear_qkv.weight": (
                (2 * hf.num_attention_heads * d, h), (hf.num_key_value_heads * d, h), (hf.num_key_value_heads * d, h)),
        }.get(suffix)

    return shapes


def partial_rotary_factor(hf: Any) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    return float(1.0 if factor is None else factor)


def gdn_fields(hf: Any) -> dict[str, Field]:
    """The ``TransformerConfig`` fields of the hybrid decoder (gated delta net + gated attention)."""
    nk, dk, nv, dv = _heads(hf)
    return {
        "experimental_attention_variant": Field("layer_types (linear_attention)", "gated_delta_net"),
        "linear_attention_freq": Field("layer_types", linear_pattern(hf)),
        "linear_conv_kernel_dim": Field("linear_conv_kernel_dim", hf.linear_conv_kernel_dim),
        "linear_key_head_dim": Field("linear_key_head_dim", dk),
        "linear_value_head_dim": Field("linear_value_head_dim", dv),
        "linear_num_key_heads": Field("linear_num_key_heads", nk),
        "linear_num_value_heads": Field("linear_num_value_heads", nv),
        "attention_output_gate": Field("(q_proj's output gate)", True),
        "layernorm_zero_centered_gamma": Field("(RMSNorm x * (1 + w))", True),
    }


def megatron(hf: Any) -> dict[str, Field]:
    out = gdn_fields(hf)
    if getattr(hf, "num_experts", 0):
        out.update(qwen2_moe.megatron(hf))
    return out


def gpt_model(hf: Any) -> dict[str, Field]:
    return {"rotary_percent": Field("rope_parameters.partial_rotary_factor", partial_rotary_factor(hf))}


def _pattern(value: Any, layers: int) -> list[int]:
    """megatron's ``get_linear_attention_pattern``: an int N is N-1 linear layers, then one full."""
    if isinstance(value, int):
        return [0 if (i + 1) % value == 0 else 1 for i in range(layers)]
    return list(value or [0] * layers)


def megatron_mismatch(hf: Any, mcfg: Any) -> list[str]:
    want = gdn_fields(hf)
    bad = []
    for f, field in want.items():
        have = getattr(mcfg, f, None)
        if f == "linear_attention_freq":
            have = _pattern(have, mcfg.num_layers)
        if f.startswith("linear_") and f != "linear_attention_freq" and not getattr(mcfg, "experimental_attention_variant", None):
            continue  # reported once, as experimental_attention_variant
        if have != field.value:
            bad.append(f"hf_config.{field.hf}={field.value!r} but Megatron {f}={have!r}")
    return bad


def unsupported(hf: Any) -> str | None:
    if getattr(hf, "attention_bias", False):
        return "attention_bias=True: megatron's gated linear_qkv bias is not mapped (no released checkpoint has it)"
    if not getattr(hf, "layer_types", None):
        return "no layer_types: which layers are gated delta nets is unknown"
    return None


def qwen_mtp(count: str) -> MTPNames:
    """Qwen3-Next / Qwen3.5 multi-token prediction as released (vLLM's ``qwen3_next_mtp`` /
    ``qwen3_5_mtp`` ``load_weights``): ``mtp.fc`` (``[h, 2h]`` over ``[embedding; hidden]``), the two
    pre-fc norms, ``mtp.norm`` and ``mtp.layers.{i}.*`` -- a gated full-attention decoder layer with
    the model's MLP; one fc and one set of norms for every step (one MTP layer exportable). The draft
    also loads the model's ``model.embed_tokens.weight`` / ``lm_head.weight``. Every MTP norm is
    zero-centered (``x * (1 + w)``) like Megatron's, so the same bytes."""
    return MTPNames(
        layer="mtp.layers.{i}.",
        enorm="mtp.pre_fc_norm_embedding.weight",
        hnorm="mtp.pre_fc_norm_hidden.weight",
        eh_proj="mtp.fc.weight",
        final_norm="mtp.norm.weight",
        embed="model.embed_tokens.weight",
        head="lm_head.weight",
        per_layer=False,
        count=count,
        block="full_attention",
    )


def gdn_family(name: str, architectures: tuple[str, ...], in_proj_kind: str, in_proj_names: tuple[str, ...],
               in_proj_rows: Any, megatron_fields: Any = None, mtp_count: str = "num_nextn_predict_layers") -> Family:
    """A hybrid gated-delta-net family: Qwen3-Next's tables with its own in-projection cut."""
    linear = _gdn_table(in_proj_kind, in_proj_names)

    def hybrid(family: Family, hf: Any, layer: int) -> dict[str, Entry]:
        return linear if hf.layer_types[layer] == "linear_attention" else _GATED_ATTENTION

    return Family(
        name,
        architectures,
        qk_norm=lambda cfg: True,
        moe=MoERoles(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate.weight"),
        megatron=megatron_fields or megatron,
        gpt_model=gpt_model,
        unsupported=unsupported,
        hybrid=hybrid,
        tensor_shapes=_shapes(in_proj_rows),
        layout_kw=lambda hf, mcfg=None: {"gdn_heads": _heads(hf)},
        megatron_mismatch=megatron_mismatch,
        mtp=qwen_mtp(mtp_count),
    )


FAMILY = gdn_family(
    "qwen3_next",
    ("Qwen3NextForCausalLM",),
    "gdn_qkvz_ba",
    ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    lambda qk, v, nv: (2 * qk + 2 * v, 2 * nv),
)
