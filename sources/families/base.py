"""What every family module is made of: ``Family`` and the decoder tensor table families share.

A ``Family`` is data over one shared table of Megatron-core ``GPTModel`` names (``ATTENTION``,
``DENSE_MLP``, ``GLOBAL``): which optional tensors its checkpoint carries for a given ``hf_config``
(``qkv_bias``, ``qk_norm``, ``sinks``...), the ``TransformerConfig`` fields it maps ``hf_config`` to
(``megatron``), its MoE roles, and what it refuses. A family whose attention is not the fused
``linear_qkv`` (DeepSeek-V3's latent attention) brings its own ``layer_table``.

Every Megatron name maps to an ``Entry``: its TP layout kind (``sources/core/layouts/tp.py``) and the HF
tensor(s) it fuses, in HF order. Transformer-Engine spec names (fused norms) are aliases of the
local-spec names (``TE_ALIASES``), so both specs export the same checkpoint.

Nothing here imports torch: the CLI reads the registry before any heavy import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core.ground.errors import UnmappedParameterError

__all__ = [
    "ATTENTION",
    "DENSE_MLP",
    "Entry",
    "Family",
    "Field",
    "GLOBAL",
    "HF_LAYER_PREFIX",
    "MTPNames",
    "MoERoles",
    "TE_ALIASES",
    "canonical_suffix",
    "decoder_fields",
    "flag",
    "gqa_fields",
    "moe_fields",
    "rope_theta",
    "ALWAYS",
    "NEVER",
]


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter: its TP layout kind and the HF tensors it holds, in HF order."""

    kind: str
    hf: tuple[str, ...]


class Field(NamedTuple):
    """One ``TransformerConfig`` field of a family's mapping: the ``hf_config`` field it comes from
    (what an error names) and its value. The builder sets ``value``; ``MegatronSource`` compares a
    live model's config against it."""

    hf: str
    value: Any


@dataclass(frozen=True)
class MoERoles:
    """Layer-relative transformers in-memory names of each MoE role (``None``: the family has none).
    Experts themselves are found by shape (``mlp.experts.gate_up_proj``); every checkpoint name is
    then read off transformers' own save-time reversal (``sources/megatron/moe_names.py``)."""

    router: str = "mlp.gate.weight"
    #: the score-correction bias that only steers expert choice (DeepSeek ``e_score_correction_bias``;
    #: Megatron's ``router.expert_bias`` buffer)
    router_bias: str | None = None
    #: the router linear's own bias, added to its logits (GPT-OSS ``mlp.router.bias``; Megatron's
    #: ``router.bias`` under ``add_bias_linear``)
    router_linear_bias: str | None = None
    shared: str | None = None  # module holding gate_proj/up_proj/down_proj
    shared_gate: str | None = None


_QKV_W = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_QKV_B = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

#: Attention half of a decoder layer (local-spec names, fused ``linear_qkv``), in HF order.
ATTENTION: dict[str, Entry] = {
    "input_layernorm.weight": Entry("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Entry("qkv", _QKV_W),
    "self_attention.linear_qkv.bias": Entry("qkv", _QKV_B),
    "self_attention.q_layernorm.weight": Entry("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Entry("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": Entry("row", ("self_attn.o_proj.weight",)),
    # Row-parallel biases are added after the reduce: replicated, not split.
    "self_attention.linear_proj.bias": Entry("replicated", ("self_attn.o_proj.bias",)),
    # Attention sinks (GPT-OSS): one learnable softmax offset per query head, split over TP by head.
    "self_attention.core_attention.softmax_offset": Entry("column", ("self_attn.sinks",)),
}

#: Dense (gated) MLP half of a decoder layer (local-spec names), in HF order.
DENSE_MLP: dict[str, Entry] = {
    "pre_mlp_layernorm.weight": Entry("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": Entry("glu", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc1.bias": Entry("glu", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.linear_fc2.weight": Entry("row", ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": Entry("replicated", ("mlp.down_proj.bias",)),
}

#: Transformer-Engine spec fuses the pre-norms into the following linear.
TE_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # MLA (TE spec, megatron-core's TELayerNormColumnParallelLinear): the latent norms live in the
    # up projections, the input norm in the fused down projection (0.17+ ``mla_down_proj_fusion``).
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_qkv_down_proj.layer_norm_weight": "input_layernorm.weight",
    # gated delta net (TE spec): the input norm lives in the fused in-projection
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
}

#: Model-level parameters: Megatron name -> (role, entry).
GLOBAL: dict[str, tuple[str, Entry]] = {
    "embedding.word_embeddings.weight": ("embed", Entry("vocab", ("model.embed_tokens.weight",))),
    "decoder.final_layernorm.weight": ("norm", Entry("replicated", ("model.norm.weight",))),
    "output_layer.weight": ("lm_head", Entry("vocab", ("lm_head.weight",))),
}

HF_LAYER_PREFIX = "model.layers.{}."


def canonical_suffix(suffix: str) -> str:
    """The local-spec name of a layer-relative Megatron name (TE fused-norm names are aliases)."""
    return TE_ALIASES.get(suffix, suffix)


def flag(name: str, default: bool = False) -> Callable[[Any], bool]:
    """``hf_config -> bool(hf_config.<name>)`` (missing: ``default``)."""
    return lambda cfg: bool(getattr(cfg, name, default) or False)


def _always(cfg: Any) -> bool:
    return True


def _never(cfg: Any) -> bool:
    return False


def _no_reason(cfg: Any) -> str | None:
    return None


ALWAYS, NEVER = _always, _never


def rope_theta(hf: Any) -> int | float:
    """HF's rope base: ``rope_parameters["rope_theta"]`` (transformers 5), else ``rope_theta`` (4.x),
    else 10000 -- an int when integral, as Megatron's ``rotary_base`` is typed."""
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
    theta = float(theta if theta is not None else getattr(hf, "rope_theta", None) or 10000.0)
    return int(theta) if theta.is_integer() else theta


def decoder_fields(hf: Any) -> dict[str, Field]:
    """``TransformerConfig`` fields every family here shares: a pre-norm RMSNorm decoder with a
    SwiGLU MLP and no linear biases (``ffn_hidden_size`` is the dense MLP's)."""
    return {
        "num_layers": Field("num_hidden_layers", hf.num_hidden_layers),
        "hidden_size": Field("hidden_size", hf.hidden_size),
        "num_attention_heads": Field("num_attention_heads", hf.num_attention_heads),
        "ffn_hidden_size": Field("intermediate_size", getattr(hf, "intermediate_size", None)),
        "gated_linear_unit": Field("(gated MLP)", True),
        "normalization": Field("(RMSNorm)", "RMSNorm"),
        "layernorm_epsilon": Field("rms_norm_eps", hf.rms_norm_eps),
        "add_bias_linear": Field("(no linear biases)", False),
    }


def gqa_fields(hf: Any, *, qkv_bias: bool, qk_norm: bool) -> dict[str, Field]:
    """``TransformerConfig`` fields of grouped-query attention with a fused ``linear_qkv``."""
    heads = hf.num_attention_heads
    return {
        "num_query_groups": Field("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or heads),
        "kv_channels": Field("head_dim", getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        "add_qkv_bias": Field("(q/k/v bias)", qkv_bias),
        "qk_layernorm": Field("(q/k norm)", qk_norm),
    }


def moe_fields(
    experts: tuple[str, int], ffn: tuple[str, int], topk: tuple[str, int], freq: tuple[str, Any],
    **more: tuple[str, Any],
) -> dict[str, Field]:
    """``TransformerConfig`` MoE fields from ``(hf field, value)`` pairs: routed experts, their FFN
    size, top-k, which layers are MoE (``moe_layer_freq``) and any ``more``."""
    out = {
        "num_moe_experts": Field(*experts),
        "moe_ffn_hidden_size": Field(*ffn),
        "moe_router_topk": Field(*topk),
        "moe_layer_freq": Field(*freq),
    }
    out.update({k: Field(*v) for k, v in more.items()})
    return out


@dataclass(frozen=True)
class MTPNames:
    """How a family's released checkpoint names its multi-token-prediction (MTP) layers -- data only;
    every family with MTP layers uses this one class (``MegatronSource(part="mtp")`` reads it).

    megatron-core's ``MultiTokenPredictionLayer`` ``i`` holds ``enorm`` (the next token's embedding
    norm), ``hnorm`` (the hidden-state norm), ``eh_proj`` (``[h, 2h]``: input ``[enorm(emb);
    hnorm(hidden)]``, column-parallel), a whole decoder layer (``transformer_layer``) and
    ``final_layernorm``; it shares the model's embedding and output layer. Names are templates:
    ``{n}`` is ``num_hidden_layers + i`` (the layer number DeepSeek-V3 and GLM-4.5 give MTP layer
    ``i``), ``{i}`` is ``i``.

    * ``layer``: prefix of MTP layer ``i``'s decoder block (its tensors are the decoder table's, under
      this prefix: DeepSeek / GLM ``model.layers.{n}.``, Qwen3-Next / Qwen3.5 ``mtp.layers.{i}.``).
    * ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_norm``: the MTP layer's own tensors.
    * ``embed`` / ``head``: the copies of the shared embedding and output head the checkpoint
      carries for the draft (None: none); vocabulary padding is trimmed as for the main embedding.
    * ``per_layer``: the own tensors and the copies exist once per MTP layer; False (Qwen3-Next:
      one ``mtp.fc`` for all steps) admits one MTP layer only.
    * ``count``: the ``hf_config`` field holding the number of MTP layers (checked against Megatron's
      ``mtp_num_layers`` where the config has it).
    * ``block``: which decoder layer's tables the MTP decoder block shares -- ``"last"`` (megatron's
      ``get_gpt_mtp_block_spec`` builds it from the decoder's last layer spec: DeepSeek / GLM, a MoE
      layer) or ``"full_attention"`` (a hybrid family's MTP block is a full-attention layer).
    """

    layer: str
    enorm: str
    hnorm: str
    eh_proj: str
    final_norm: str
    embed: str | None = None
    head: str | None = None
    per_layer: bool = True
    count: str = "num_nextn_predict_layers"
    block: str = "last"

    def fill(self, template: str, hf_config: Any, i: int) -> str:
        """``template`` for MTP layer ``i`` of ``hf_config``."""
        return template.format(n=hf_config.num_hidden_layers + i, i=i)

    def proxy_layer(self, hf_config: Any) -> int:
        """The decoder layer (0-based) whose attention / MLP tables MTP decoder blocks share."""
        if self.block == "last":
            return hf_config.num_hidden_layers - 1
        types = list(getattr(hf_config, "layer_types", None) or [])
        full = [j for j, t in enumerate(types) if t == self.block]
        if not full:
            raise UnmappedParameterError(f"hf_config.layer_types has no {self.block!r} layer for the MTP block to share")
        return full[-1]


LayerTable = Callable[["Family", Any, bool], dict[str, Entry]]


@dataclass(frozen=True)
class Family:
    """One model family: its checkpoint's tensors, its Megatron config mapping, its MoE roles and
    what it refuses -- each as a function of ``hf_config``.

    ``name`` is transformers' ``model_type`` (and the family module's name)."""

    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[Any], bool] = _never
    o_bias: Callable[[Any], bool] = _never
    qk_norm: Callable[[Any], bool] = _never
    #: per-head attention sinks (``self_attn.sinks``; Megatron ``softmax_type="learnable"``)
    sinks: Callable[[Any], bool] = _never
    mlp_bias: Callable[[Any], bool] = _never
    moe: MoERoles | None = None
    #: ``hf_config -> {TransformerConfig field: Field}`` beyond the shared decoder and GQA fields
    #: (MoE, latent attention); ``megatron_fields`` is the whole mapping.
    megatron: Callable[[Any], dict[str, Field]] = lambda cfg: {}
    #: ``hf_config -> {GPTModel argument: Field}`` beyond the shared ones (e.g. ``rotary_percent``
    #: from a partial rotary factor); ``gpt_model_fields`` is the whole set.
    gpt_model: Callable[[Any], dict[str, Field]] = lambda cfg: {}
    #: ``"dense"`` (fused ``linear_qkv``, ``ATTENTION``) or ``"mla"`` (``layer_table``'s attention).
    attention: str = "dense"
    #: ``(family, hf_config, fused_down) -> {suffix: Entry}``: the attention half of a layer, for a
    #: family whose attention is not ``ATTENTION`` (None: ``ATTENTION`` with the flags above).
    layer_table: LayerTable | None = None
    #: ``hf_config -> reason`` when the family cannot export this config, else None.
    unsupported: Callable[[Any], str | None] = _no_reason
    #: ``hf_config -> reason`` when the one Megatron builder cannot build it, else None.
    unbuildable: Callable[[Any], str | None] = _no_reason
    #: hybrid models (Qwen3-Next / Qwen3.5: gated delta net and gated attention by layer):
    #: ``(family, hf_config, layer) -> {suffix: Entry}``, the attention half of global layer ``layer``.
    hybrid: Callable[["Family", Any, int], dict[str, Entry]] | None = None
    #: ``(layer-relative suffix, hf_config) -> full HF shapes`` of the family's own tensors (None:
    #: the shared shapes of ``megatron/plan.py``).
    tensor_shapes: Callable[[str, Any], tuple[tuple[int, ...], ...] | None] = lambda suffix, cfg: None
    #: ``(hf_config, Megatron TransformerConfig or None) -> {keyword: value}`` the family's layout
    #: kinds need besides the shared geometry (e.g. the gated delta net's head counts; where a DSA
    #: indexer's megatron-core ropes, which depends on its version and config).
    layout_kw: Callable[..., dict[str, Any]] = lambda cfg, mcfg=None: {}
    #: ``(hf_config, Megatron TransformerConfig) -> [problem, ...]``: what a live Megatron model has
    #: that this checkpoint cannot express beyond the shared checks (``MegatronSource`` raises
    #: ``UnmappedParameterError`` listing them at construction, on every rank).
    megatron_mismatch: Callable[[Any, Any], list[str]] = lambda cfg, mcfg: []
    #: MLA families: ``mcfg -> reason or None`` checks of the Megatron MLA variants this checkpoint
    #: cannot express (None: DeepSeek-V3's ``MEGATRON_REFUSALS``; DSA families allow their variant).
    mla_refusals: tuple[Callable[[Any], str | None], ...] | None = None
    #: the checkpoint's multi-token-prediction layer names (None: the family has no MTP layers
    #: weightsync exports; ``MegatronSource(part="mtp")`` refuses it, naming the family)
    mtp: MTPNames | None = None

    def layer_keys(self, hf_config: Any, *, fused_down: bool = False, layer: int | None = None) -> dict[str, Entry]:
        """Megatron layer-relative names (local spec) this checkpoint has, in HF order.

        ``fused_down``: MLA only -- the Megatron model has ``linear_qkv_down_proj`` instead of
        the two down projections. ``layer``: hybrid families only -- that global layer's names
        (None: every layer kind's, for name lookups)."""
        if self.hybrid is not None:
            layers = range(hf_config.num_hidden_layers) if layer is None else [layer]
            attention = {k: e for i in layers for k, e in self.hybrid(self, hf_config, i).items()}
        elif self.layer_table is not None:
            attention = self.layer_table(self, hf_config, fused_down)
        else:
            skip = set()
            if not self.qkv_bias(hf_config):
                skip.add("self_attention.linear_qkv.bias")
            if not self.o_bias(hf_config):
                skip.add("self_attention.linear_proj.bias")
            if not self.qk_norm(hf_config):
                skip |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
            if not self.sinks(hf_config):
                skip.add("self_attention.core_attention.softmax_offset")
            attention = {k: e for k, e in ATTENTION.items() if k not in skip}
        skip = set() if self.mlp_bias(hf_config) else {"mlp.linear_fc1.bias", "mlp.linear_fc2.bias"}
        return {**attention, **{k: e for k, e in DENSE_MLP.items() if k not in skip}}

    def megatron_fields(self, hf_config: Any) -> dict[str, Field]:
        """Every ``TransformerConfig`` field a Megatron model of ``hf_config`` has (the builder builds
        from it, ``MegatronSource`` checks a live model against it); parallel sizes and dtypes are
        the caller's."""
        out = decoder_fields(hf_config)
        if self.layer_table is None:
            out.update(gqa_fields(hf_config, qkv_bias=self.qkv_bias(hf_config), qk_norm=self.qk_norm(hf_config)))
        out.update(self.megatron(hf_config))
        return out

    def gpt_model_fields(self, hf_config: Any) -> dict[str, Field]:
        """``GPTModel`` constructor arguments a model of ``hf_config`` has (besides its config, spec,
        padded vocabulary and pipeline stage)."""
        out = {
            "share_embeddings_and_output_weights": Field(
                "tie_word_embeddings", bool(getattr(hf_config, "tie_word_embeddings", False))
            ),
            "position_embedding_type": Field("(rope)", "rope"),
            "rotary_base": Field("rope_parameters.rope_theta", rope_theta(hf_config)),
            "max_sequence_length": Field("max_position_embeddings", getattr(hf_config, "max_position_embeddings", 128)),
        }
        out.update(self.gpt_model(hf_config))
        return out

    def check_supported(self, hf_config: Any) -> None:
        why = self.unsupported(hf_config)
        if why:
            archs = list(getattr(hf_config, "architectures", None) or ())
            raise UnmappedParameterError(f"MegatronSource cannot export {self.name} (architectures={archs}): {why}")
