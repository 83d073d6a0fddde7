"""The export plan of a Megatron ``GPTModel``: every HF tensor, which stage holds it, and its TP shapes.

Invariant: the plan is a pure function of ``hf_config``, Megatron's ``TransformerConfig``, the
padded vocabulary and the parallel sizes -- never of which rank computes it and never of a
collective -- so every rank (other pipeline stages and data-parallel replicas included) builds the
same plan, and ``metadata`` is the plan flattened. Global layer numbers come from Megatron's own
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` for every ``(pp_rank, vp_stage)``;
the source then checks them against each local layer's ``layer_number``.

A plan is a list of ``Unit``: one Megatron parameter, exported as one or more HF tensors (QKV -> q,
k, v; GLU fc1 -> gate, up). Units come in HF order: embedding, layers 0..L-1, final norm, lm_head.
A unit's TP-shard shape follows from its full HF shapes and its layout kind (``Layout.shard_shape``);
MLA attention shapes come from ``megatron.mla`` and its kinds from the modules (``resolve_kinds``).

The MLP half of each layer depends on ``mlp_kind``: a dense layer's plan holds its MLP; a MoE
layer's plan holds only its pre-MLP norm, and the MoE MLP itself is streamed by
``MegatronMoEExporter`` after the layer's units.

Multi-token prediction (``build_mtp_plan``, ``MegatronSource(part="mtp")``): the draft's own plan, in
the checkpoint names of the family's ``MTPNames``. Per MTP layer ``i`` (megatron-core puts every MTP
layer on the last pipeline stage's last virtual chunk): the embedding copy, ``enorm``, ``hnorm``,
``eh_proj`` (column-parallel, ``[h, 2h]``), the decoder block -- decoder layer ``num_layers + i`` with
the tables of the layer it is built like (``MTPNames.proxy_layer``), its MoE MLP streamed after it
like a decoder layer's --, the final norm and the output head copy. The embedding and head copies are
the model's own shared tensors (keys ``("mtp_embed", i)`` / ``("mtp_head", i)``), vocabulary padding
trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.ground.errors import UnmappedParameterError
from ..families.base import DENSE_MLP, GLOBAL, HF_LAYER_PREFIX, Entry, Family
from ..core.layouts.tp import VOCAB, Layout, layout
from .mla import MLAGeometry, mla_full_shapes

__all__ = [
    "Geometry",
    "Unit",
    "build_mtp_plan",
    "build_plan",
    "layer_placement",
    "mlp_kind",
]


@dataclass(frozen=True)
class Geometry:
    """The shapes that decide every HF and Megatron tensor shape, read from ``hf_config``."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    layers: int
    tied: bool
    tp: int
    mla: MLAGeometry | None = None  # multi-head latent attention sizes (None: fused linear_qkv)

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


@dataclass(frozen=True)
class Unit:
    """One Megatron parameter of the plan and the HF tensors it becomes."""

    key: tuple  # ("embed",) | ("norm",) | ("lm_head",) | ("layer", global_layer, megatron_suffix)
    stage: int  # pipeline rank holding it
    chunk: int  # virtual-pipeline chunk on that stage
    kind: Layout  # its TP layout kind (sources/core/layouts/tp.py)
    names: tuple[str, ...]  # HF names, in order
    shapes: tuple[tuple[int, ...], ...]  # full HF shapes
    shard_shape: tuple[int, ...]  # the Megatron parameter's shape on each TP rank


def _shapes(suffix: str, g: Geometry) -> tuple[tuple[int, ...], ...]:
    """Full HF shapes of one layer-relative Megatron parameter, in HF order."""
    if g.mla is not None:
        mla = mla_full_shapes(suffix, g.mla)
        if mla is not None:
            return mla
    h, d = g.hidden, g.head_dim
    q, kv = g.heads * d, g.groups * d
    if suffix == "self_attention.linear_qkv.weight":
        return ((q, h), (kv, h), (kv, h))
    if suffix == "self_attention.linear_qkv.bias":
        return ((q,), (kv,), (kv,))
    if suffix == "self_attention.linear_proj.weight":
        return ((h, q),)
    if suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return ((d,),)
    if suffix == "self_attention.core_attention.softmax_offset":  # attention sinks: one per query head
        return ((g.heads,),)
    if suffix == "mlp.linear_fc1.weight":
        return ((g.ffn, h), (g.ffn, h))
    if suffix == "mlp.linear_fc1.bias":
        return ((g.ffn,), (g.ffn,))
    if suffix == "mlp.linear_fc2.weight":
        return ((h, g.ffn),)
    # norms and row-parallel biases: replicated, hidden-sized
    return ((h,),)


# ---- MLP half of a layer ------------------------------------------------------------------------------

def mlp_kind(mcfg: Any, layer: int) -> str:
    """``"dense"`` or ``"moe"`` for global layer ``layer`` (0-based), from Megatron's config only."""
    if not getattr(mcfg, "num_moe_experts", None):
        return "dense"
    freq = getattr(mcfg, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return "moe" if layer % freq == 0 else "dense"
    return "moe" if freq[layer] else "dense"


def _mlp_entries(family: Family, hf_config: Any, kind: str) -> dict[str, Entry]:
    """The MLP half of a layer's plan units. A MoE layer's: only its pre-MLP norm; the router, routed
    and shared experts are exported by ``MegatronMoEExporter`` (``sources/megatron/moe.py``),
    which ``MegatronSource`` runs right after this layer's units (``_bind`` lets it claim the layer's
    ``mlp.*`` parameters)."""
    if kind == "moe":
        return {"pre_mlp_layernorm.weight": DENSE_MLP["pre_mlp_layernorm.weight"]}
    return {k: e for k, e in family.layer_keys(hf_config).items() if k in DENSE_MLP}


# ---- layer placement ----------------------------------------------------------------------------


def layer_placement(mcfg: Any, pp: int, vpp: int) -> list[tuple[int, int, int]]:
    """``[(stage, chunk, local_index)]`` indexed by global layer, from Megatron's own functions."""
    if getattr(mcfg, "pipeline_model_parallel_layout", None) is not None:
        raise NotImplementedError(
            "MegatronSource does not support pipeline_model_parallel_layout yet (its offsets depend "
            "on this rank's parallel_state, so other stages' layers cannot be derived)"
        )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    where: dict[int, tuple[int, int, int]] = {}
    for stage in range(pp):
        for chunk in range(vpp):
            vp = chunk if vpp > 1 else None
            offset = get_transformer_layer_offset(mcfg, vp_stage=vp, pp_rank=stage)
            n = get_num_layers_to_build(mcfg, vp_stage=vp, pp_rank=stage)
            for j in range(n):
                where[offset + j] = (stage, chunk, j)
    if sorted(where) != list(range(mcfg.num_layers)):
        raise RuntimeError(
            f"Megatron's layer offsets do not cover layers 0..{mcfg.num_layers - 1} exactly "
            f"(got {sorted(where)})"
        )
    return [where[i] for i in range(mcfg.num_layers)]


# ---- the plan -----------------------------------------------------------------------------------


def _check_fields(family: Family, hf_config: Any, mcfg: Any) -> None:
    """``UnmappedParameterError`` listing what ``family.megatron_mismatch`` finds in ``mcfg``."""
    bad = family.megatron_mismatch(hf_config, mcfg)
    if bad:
        raise UnmappedParameterError(f"MegatronSource cannot export this Megatron model as {family.name}: " + "; ".join(bad))


def _block_units(family: Family, hf_config: Any, g: Geometry, layer: int, prefix: str, entries: dict[str, Entry],
                 stage: int, chunk: int) -> list[Unit]:
    """The units of one decoder block (a policy layer, or an MTP layer's block) whose checkpoint
    names start with ``prefix``; keyed ``("layer", layer, suffix)`` by Megatron's layer number."""
    out = []
    for suffix, entry in entries.items():
        full = family.tensor_shapes(suffix, hf_config) or _shapes(suffix, g)
        kind = layout(entry.kind)
        out.append(Unit(("layer", layer, suffix), stage, chunk, kind, tuple(prefix + h for h in entry.hf), full,
                        kind.shard_shape(full, g.tp)))
    return out


def build_plan(
    *,
    family: Family,
    hf_config: Any,
    mcfg: Any,
    geometry: Geometry,
    pp: int,
    vpp: int,
    local_layer_names: dict[int, list[str]] | None = None,
    attention: dict[str, Entry] | None = None,
) -> list[Unit]:
    """Every unit of the export, in HF order. Pure: no tensors, no communication.

    ``attention``: the layer-relative attention entries (default: the family's table for
    ``hf_config``); ``MegatronSource`` passes MLA entries with kinds resolved from the modules."""
    g = geometry
    local_layer_names = local_layer_names or {}
    placement = layer_placement(mcfg, pp, vpp)
    last = (pp - 1, vpp - 1)
    units: list[Unit] = []

    def global_unit(megatron_name: str, stage: int, chunk: int) -> Unit:
        role, entry = GLOBAL[megatron_name]
        kind = layout(entry.kind)
        full = (g.vocab, g.hidden) if kind is VOCAB else (g.hidden,)
        shard = (g.padded_vocab // g.tp, g.hidden) if kind is VOCAB else (g.hidden,)
        return Unit((role,), stage, chunk, kind, entry.hf, (full,), shard)

    _check_fields(family, hf_config, mcfg)
    units.append(global_unit("embedding.word_embeddings.weight", 0, 0))
    if attention is None and family.hybrid is None:
        attention = {k: e for k, e in family.layer_keys(hf_config).items() if k not in DENSE_MLP}
    for layer, (stage, chunk, _) in enumerate(placement):
        mlp = _mlp_entries(family, hf_config, mlp_kind(mcfg, layer))
        prefix = HF_LAYER_PREFIX.format(layer)
        if family.hybrid is not None:  # the attention kind is the layer's (gated delta net or not)
            attention = {k: e for k, e in family.layer_keys(hf_config, layer=layer).items() if k not in DENSE_MLP}
        units += _block_units(family, hf_config, g, layer, prefix, {**attention, **mlp}, stage, chunk)
    units.append(global_unit("decoder.final_layernorm.weight", *last))
    if not g.tied:
        units.append(global_unit("output_layer.weight", *last))
    return units


def mtp_layers(family: Family, hf_config: Any, mcfg: Any) -> int:
    """The number of MTP layers to export; raises naming what stands in the way (no MTP naming
    for the family, a model without ``mtp_num_layers``, a disagreeing ``hf_config`` count)."""
    names = family.mtp
    if names is None:
        raise UnmappedParameterError(
            f"MegatronSource(part='mtp'): the {family.name} family has no multi-token-prediction names "
            "(families with MTP: deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, qwen3_next, qwen3_5_text, "
            "qwen3_5_moe_text)"
        )
    d = getattr(mcfg, "mtp_num_layers", None) or 0
    if d < 1:
        raise ValueError(
            "MegatronSource(part='mtp'): the Megatron model has no MTP layers (TransformerConfig.mtp_num_layers="
            f"{getattr(mcfg, 'mtp_num_layers', None)!r}); build GPTModel with mtp_block_spec and mtp_num_layers"
        )
    want = getattr(hf_config, names.count, None)
    if want is not None and int(want) != d:
        raise ValueError(
            f"MegatronSource(part='mtp'): hf_config.{names.count}={want} but Megatron mtp_num_layers={d}"
        )
    if not names.per_layer and d != 1:
        raise UnmappedParameterError(
            f"MegatronSource(part='mtp'): the {family.name} checkpoint has one set of MTP projection and norms "
            f"({names.eh_proj}) for every step, Megatron mtp_num_layers={d} has one per layer; export one MTP layer"
        )
    return d


def build_mtp_plan(
    *,
    family: Family,
    hf_config: Any,
    mcfg: Any,
    geometry: Geometry,
    pp: int,
    vpp: int,
    attention: dict[str, Entry] | None = None,
) -> list[Unit]:
    """Every unit of the MTP export, in checkpoint order (module docstring). Pure, like ``build_plan``."""
    g = geometry
    names = family.mtp
    d = mtp_layers(family, hf_config, mcfg)
    assert names is not None
    _check_fields(family, hf_config, mcfg)
    if getattr(mcfg, "pipeline_model_parallel_layout", None) is not None:
        raise NotImplementedError(
            "MegatronSource(part='mtp') does not support pipeline_model_parallel_layout (MTP placement)"
        )
    stage, chunk = pp - 1, vpp - 1
    proxy = names.proxy_layer(hf_config)
    kind_of_mlp = mlp_kind(mcfg, proxy)
    if attention is None or family.hybrid is not None:
        attention = {k: e for k, e in family.layer_keys(
            hf_config, layer=proxy if family.hybrid is not None else None).items() if k not in DENSE_MLP}
    mlp = _mlp_entries(family, hf_config, kind_of_mlp)
    vocab_full, vocab_shard = (g.vocab, g.hidden), (g.padded_vocab // g.tp, g.hidden)
    units: list[Unit] = []

    def own(i: int, suffix: str, kind_name: str, hf_name: str, full: tuple[int, ...]) -> Unit:
        kind = layout(kind_name)
        return Unit(("mtp", i, suffix), stage, chunk, kind, (names.fill(hf_name, hf_config, i),), (full,),
                    kind.shard_shape((full,), g.tp))

    for i in range(d):
        L = mcfg.num_layers + i
        copies = names.per_layer or i == 0
        if names.embed and copies:
            units.append(Unit(("mtp_embed", i), stage, chunk, VOCAB, (names.fill(names.embed, hf_config, i),),
                              (vocab_full,), vocab_shard))
        units.append(own(i, "enorm.weight", "replicated", names.enorm, (g.hidden,)))
        units.append(own(i, "hnorm.weight", "replicated", names.hnorm, (g.hidden,)))
        units.append(own(i, "eh_proj.weight", "column", names.eh_proj, (g.hidden, 2 * g.hidden)))
        units += _block_units(family, hf_config, g, L, names.fill(names.layer, hf_config, i), {**attention, **mlp},
                              stage, chunk)
        units.append(own(i, "final_layernorm.weight", "replicated", names.final_norm, (g.hidden,)))
        if names.head and copies:
            units.append(Unit(("mtp_head", i), stage, chunk, VOCAB, (names.fill(names.head, hf_config, i),),
                              (vocab_full,), vocab_shard))
    return units
