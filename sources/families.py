"""Per-family name tables: Megatron-core ``GPTModel`` parameter names -> Hugging Face checkpoint names.

Invariant: a family is *data* -- which HF architectures it serves and which optional tensors its
checkpoint carries for a given ``hf_config`` -- over one shared table of Megatron names. Every
Megatron name maps to a layout ``kind`` (``sources/layout.py``) and the HF tensor(s) it fuses, in HF
order; Transformer-Engine spec names (fused norms) are aliases of the local-spec names, so both
specs export the same checkpoint. A Megatron parameter that no table names, or that the family's
checkpoint does not carry, is an error listing the names, never a silent skip.

Layer-relative names (after ``decoder.layers.{j}.`` / ``model.layers.{i}.``) live in ``ATTENTION``
(fused ``linear_qkv``) or ``MLA_ATTENTION`` (multi-head latent attention, DeepSeek-V3 / Kimi-K2) and
``DENSE_MLP``; model-level names in ``GLOBAL``. The MLP table is consumed by the dense MLP
handler (``sources/megatron_plan.py``) so MoE layers can bring their own table later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import UnmappedParameterError

__all__ = [
    "Entry",
    "Family",
    "ATTENTION",
    "MLA_ATTENTION",
    "MLA_FUSED_DOWN",
    "DENSE_MLP",
    "GLOBAL",
    "TE_ALIASES",
    "FAMILIES",
    "family_for",
    "canonical_suffix",
    "megatron_to_hf",
]


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter: its TP layout kind and the HF tensors it holds, in HF order."""

    kind: str
    hf: tuple[str, ...]


_QKV_W = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_QKV_B = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

#: Attention half of a decoder layer (local-spec names), in HF order.
ATTENTION: dict[str, Entry] = {
    "input_layernorm.weight": Entry("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Entry("qkv", _QKV_W),
    "self_attention.linear_qkv.bias": Entry("qkv", _QKV_B),
    "self_attention.q_layernorm.weight": Entry("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Entry("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": Entry("row", ("self_attn.o_proj.weight",)),
    # Row-parallel biases are added after the reduce: replicated, not split.
    "self_attention.linear_proj.bias": Entry("replicated", ("self_attn.o_proj.bias",)),
}

_Q_A, _KV_A = "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"

#: megatron-core ``MLASelfAttention`` (local-spec names) -> transformers ``DeepseekV3Attention``, in
#: HF order. The row layouts are the same on both sides, so every entry is one HF tensor and TP
#: shards are plain ``torch.chunk`` pieces (``sources/megatron_mla.py`` states what was verified):
#: ``q_proj`` / ``q_b_proj`` rows are ``[nope, rope]`` per head, ``kv_b_proj`` rows ``[k_nope, v]``
#: per head (column-parallel: a TP rank holds whole heads), ``kv_a_proj_with_mqa`` rows
#: ``[kv_lora_rank, rope]``. The down projections are column-parallel in the local spec and
#: duplicated (TE ``TELinear``) in the TE spec: their kinds here are the local spec's, and
#: ``megatron_mla.resolve_kinds`` replaces them with what the module itself declares.
MLA_ATTENTION: dict[str, Entry] = {
    "input_layernorm.weight": Entry("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_q_proj.weight": Entry("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": Entry("column", (_Q_A,)),
    "self_attention.q_layernorm.weight": Entry("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.weight": Entry("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": Entry("column", (_KV_A,)),
    "self_attention.kv_layernorm.weight": Entry("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": Entry("column", ("self_attn.kv_b_proj.weight",)),
    "self_attention.linear_proj.weight": Entry("row", ("self_attn.o_proj.weight",)),
}

#: megatron-core >= 0.17 ``FusedMLASelfAttention`` (``mla_down_proj_fusion``): one
#: ``linear_qkv_down_proj`` = ``[q_a_proj; kv_a_proj_with_mqa]`` replaces the two down projections
#: (column-parallel: each TP rank holds ``[q_r; kv_r]``, as its ``sharded_state_dict`` splits it).
MLA_FUSED_DOWN: dict[str, Entry] = {
    "self_attention.linear_qkv_down_proj.weight": Entry("stack_column", (_Q_A, _KV_A)),
}
_MLA_SPLIT_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")
_MLA_Q_LORA = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.weight",
)

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
}

#: Model-level parameters.
GLOBAL: dict[str, tuple[str, Entry]] = {
    "embedding.word_embeddings.weight": ("embed", Entry("vocab", ("model.embed_tokens.weight",))),
    "decoder.final_layernorm.weight": ("norm", Entry("replicated", ("model.norm.weight",))),
    "output_layer.weight": ("lm_head", Entry("vocab", ("lm_head.weight",))),
}

HF_LAYER_PREFIX = "model.layers.{}."


def _flag(name: str, default: bool = False) -> Callable[[Any], bool]:
    return lambda cfg: bool(getattr(cfg, name, default) or False)


_ALWAYS = lambda cfg: True  # noqa: E731
_NEVER = lambda cfg: False  # noqa: E731


def _mla_unsupported(cfg: Any) -> str | None:
    """HF-side DeepseekV3 attention variants no megatron-core ``MLASelfAttention`` computes."""
    why = []
    if getattr(cfg, "attention_bias", False):
        why.append(
            "attention_bias=True (q_a_proj / kv_a_proj_with_mqa / o_proj biases): megatron-core's MLA "
            "builds its q/kv projections without bias"
        )
    if not getattr(cfg, "rope_interleave", True):
        why.append(
            "rope_interleave=False: megatron-core's MLA rope rotates the interleaved pairs (x0, x1), "
            "(x2, x3), ... of the rope dims, which is HF's rope_interleave=True"
        )
    return "; ".join(why) or None


@dataclass(frozen=True)
class Family:
    """Which optional tensors a family's checkpoint carries, as predicates of its ``hf_config``."""

    name: str
    architectures: tuple[str, ...]
    qkv_bias: Callable[[Any], bool] = _NEVER
    o_bias: Callable[[Any], bool] = _NEVER
    qk_norm: Callable[[Any], bool] = _NEVER
    mlp_bias: Callable[[Any], bool] = _NEVER
    #: ``hf_config -> reason`` when the family cannot export this config, else None.
    unsupported: Callable[[Any], str | None] = lambda cfg: None
    #: ``"dense"`` (fused ``linear_qkv``, ``ATTENTION``) or ``"mla"`` (``MLA_ATTENTION``).
    attention: str = "dense"

    def layer_keys(self, hf_config: Any, *, fused_down: bool = False) -> dict[str, Entry]:
        """Megatron layer-relative names (local spec) this checkpoint has, in HF order.

        ``fused_down``: MLA only -- the Megatron model has ``linear_qkv_down_proj`` instead of
        the two down projections."""
        if self.attention == "mla":
            return {**self._mla_keys(hf_config, fused_down), **self._mlp_keys(hf_config)}
        skip = set()
        if not self.qkv_bias(hf_config):
            skip.add("self_attention.linear_qkv.bias")
        if not self.o_bias(hf_config):
            skip.add("self_attention.linear_proj.bias")
        if not self.qk_norm(hf_config):
            skip |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
        attention = {k: e for k, e in ATTENTION.items() if k not in skip}
        return {**attention, **self._mlp_keys(hf_config)}

    def _mlp_keys(self, hf_config: Any) -> dict[str, Entry]:
        skip = set() if self.mlp_bias(hf_config) else {"mlp.linear_fc1.bias", "mlp.linear_fc2.bias"}
        return {k: e for k, e in DENSE_MLP.items() if k not in skip}

    @staticmethod
    def _mla_keys(hf_config: Any, fused_down: bool) -> dict[str, Entry]:
        if getattr(hf_config, "q_lora_rank", None):
            skip = {"self_attention.linear_q_proj.weight"}
        else:
            skip = set(_MLA_Q_LORA)
            if fused_down:
                raise UnmappedParameterError(
                    "Megatron's fused linear_qkv_down_proj needs q_lora_rank, but hf_config.q_lora_rank "
                    "is not set"
                )
        out: dict[str, Entry] = {}
        for k, e in MLA_ATTENTION.items():
            if k in skip or (fused_down and k in _MLA_SPLIT_DOWN):
                continue
            out[k] = e
            if fused_down and k == "input_layernorm.weight":
                out.update(MLA_FUSED_DOWN)
        return out


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("LlamaForCausalLM",),
        qkv_bias=_flag("attention_bias"),
        o_bias=_flag("attention_bias"),
        mlp_bias=_flag("mlp_bias"),
    ),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=_ALWAYS),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        qkv_bias=_flag("attention_bias"),
        o_bias=_flag("attention_bias"),
        qk_norm=_ALWAYS,
    ),
    Family("mistral", ("MistralForCausalLM",)),
    # MoE families: attention and norms share the dense layout above; the MoE MLP half is named by
    # ``sources/moe_families.py`` (transformers' own reversal) through ``MegatronMoEExporter``.
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        qkv_bias=_flag("attention_bias"),
        o_bias=_flag("attention_bias"),
        qk_norm=_ALWAYS,
    ),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), qkv_bias=_flag("qkv_bias", True)),
    Family("mixtral", ("MixtralForCausalLM",)),
    # DeepSeek-V3 / R1, Kimi-K2, Moonlight: multi-head latent attention (``MLA_ATTENTION``) + MoE.
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), unsupported=_mla_unsupported, attention="mla"),
)


def family_for(hf_config: Any) -> Family:
    """The family serving ``hf_config.architectures`` (or ``model_type``); raises if none does, or if
    the family cannot export this config (``UnmappedParameterError`` naming the fields)."""
    archs = tuple(getattr(hf_config, "architectures", None) or ())
    model_type = getattr(hf_config, "model_type", None)
    found = next((f for f in FAMILIES if any(a in f.architectures for a in archs)), None)
    found = found or next((f for f in FAMILIES if model_type == f.name), None)
    if found is not None:
        why = found.unsupported(hf_config)
        if why:
            raise UnmappedParameterError(
                f"MegatronSource cannot export {found.name} (architectures={list(archs)}): {why}"
            )
        return found
    known = sorted(a for f in FAMILIES for a in f.architectures)
    raise UnmappedParameterError(
        f"MegatronSource has no name table for architectures={list(archs)} "
        f"(model_type={model_type!r}); known: {known}"
    )


def canonical_suffix(suffix: str) -> str:
    """The local-spec name of a layer-relative Megatron name (TE fused-norm names are aliases)."""
    return TE_ALIASES.get(suffix, suffix)


def megatron_to_hf(
    name: str, *, hf_config: Any, layer_of: Callable[[int], int] = lambda j: j
) -> tuple[str, ...]:
    """HF checkpoint name(s) of one Megatron ``GPTModel`` parameter name (names only, no tensors).

    ``layer_of`` maps the module's local layer index to the global (0-based) layer number.
    Raises ``UnmappedParameterError`` for a name the family's checkpoint does not carry.
    """
    fam = family_for(hf_config)
    if name in GLOBAL:
        return GLOBAL[name][1].hf
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "decoder" and parts[1] == "layers" and parts[2].isdigit():
        suffix = canonical_suffix(".".join(parts[3:]))
        entry = fam.layer_keys(hf_config).get(suffix)
        if entry is None and suffix in MLA_FUSED_DOWN and fam.attention == "mla":
            entry = fam.layer_keys(hf_config, fused_down=True).get(suffix)
        if entry is not None:
            prefix = HF_LAYER_PREFIX.format(layer_of(int(parts[2])))
            return tuple(prefix + h for h in entry.hf)
    raise UnmappedParameterError(
        f"Megatron parameter {name!r} has no Hugging Face name in the {fam.name} table for this "
        "hf_config"
    )
