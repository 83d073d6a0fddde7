"""``MegatronSource``'s construction checks: every way a model, its ``hf_config`` and the arguments can
disagree, raised at construction -- on every rank, naming the rank -- before any byte moves.

Why at construction and on every rank: vLLM reads ``metadata`` before any rank has entered a pass,
and a rank that raised mid-pass would leave its peers waiting on a transfer (bounded, but late and
named after the wrong thing). Each check reads configs and this rank's own modules only, never a
collective, so every rank that can raise does, with the same words. What is checked, and where:

* ``check_arguments``: the constructor's own arguments (``mode``, ``part``, ``senders``,
  ``overlap``, ``ahead_bytes``) and the vLLM that ``senders="owners"`` needs;
* ``check_chunks``: one model chunk per virtual-pipeline stage;
* ``family_of``: an architecture a family table covers (``sources/families/``);
* ``mtp_moe_layers``: ``part="mtp"``'s multi-token-prediction block against the family's MTP names;
* ``check_local_mode``: ``mode="local"`` with no MoE layer;
* ``hf_geometry``: the shapes ``hf_config`` implies against the ones Megatron built;
* ``attention_entries``: MLA's TP kinds read from this rank's modules, one per tensor;
* ``bind_units``: every plan unit of this rank's stage bound to one Megatron parameter of its
  shape, on its chunk, and no Megatron parameter left without a checkpoint tensor;
* ``unit_dtype``: ``keep_fp32=`` keeps all or none of the HF tensors one Megatron tensor becomes;
* ``moe_error``: a MoE-side mismatch, restated with this rank, the MoE layers and their parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.comm.senders import Senders, check_senders, require_many_senders
from ..core.ground.dtype_policy import WirePolicy
from ..core.ground.errors import UnmappedParameterError
from ..families import Family, family_for
from ..families.base import DENSE_MLP, Entry
from .mla import mla_geometry, resolve_kinds
from .moe import MegatronMoEExporter
from .moe_storage import expert_format, megatron_moe_suffixes
from .plan import Geometry, Unit, mlp_kind, mtp_layers
from .topology import Topology
from .walk import Bound

__all__ = [
    "attention_entries",
    "bind_units",
    "check_arguments",
    "check_chunks",
    "check_local_mode",
    "family_of",
    "hf_geometry",
    "moe_error",
    "mtp_moe_layers",
    "unit_dtype",
]


def check_arguments(*, mode: str, part: str, senders: object, overlap: object, ahead_bytes: object) -> Senders:
    """The constructor's arguments, checked in this order; returns ``senders`` checked.

    ``mode`` is ``"full"`` / ``"local"``; ``part`` ``"policy"`` / ``"mtp"``; ``senders="owners"``
    needs ``mode="full"`` and a vLLM whose NCCL engine has many senders; ``overlap`` a bool or None;
    ``ahead_bytes`` a positive int or None."""
    if mode not in ("full", "local"):
        raise ValueError(f"MegatronSource mode must be 'full' or 'local', got {mode!r}")
    if part not in ("policy", "mtp"):
        raise ValueError(f"MegatronSource part must be 'policy' or 'mtp', got {part!r}")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    checked = check_senders(senders, rank=rank, who="MegatronSource")
    if senders == "owners":
        if mode != "full":
            raise ValueError(
                f"rank {rank}: MegatronSource(senders='owners') needs mode='full' (vLLM's NCCL "
                f"broadcast engine); mode={mode!r} already sends each stage's TP pieces from their ranks"
            )
        require_many_senders(rank=rank, who="MegatronSource")
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"overlap= must be a bool or None, got {overlap!r}")
    if ahead_bytes is not None and (isinstance(ahead_bytes, bool) or not isinstance(ahead_bytes, int)
                                    or ahead_bytes <= 0):
        raise ValueError(f"ahead_bytes= must be a positive int or None, got {ahead_bytes!r}")
    return checked


def check_chunks(chunks: list[torch.nn.Module], topo: Topology) -> None:
    """One model chunk per virtual-pipeline stage of this rank."""
    if len(chunks) != topo.vpp:
        raise ValueError(
            f"rank {topo.rank}: got {len(chunks)} model chunk(s) but virtual pipeline size is "
            f"{topo.vpp}; pass every virtual-pipeline chunk of this rank, in order"
        )


def family_of(hf_config: Any, rank: int) -> Family:
    """The family table of ``hf_config``'s architecture (``UnmappedParameterError`` naming the rank)."""
    try:
        return family_for(hf_config)
    except UnmappedParameterError as e:
        raise UnmappedParameterError(f"rank {rank}: {e}") from e


def mtp_moe_layers(family: Family, hf_config: Any, mcfg: Any, rank: int) -> tuple[list[int], dict[int, tuple[int, str]]]:
    """``part="mtp"``: the MTP layers' decoder blocks that are MoE (global layers, numbered after the
    decoder's), and each MTP layer's alias (the decoder layer it is built like, the HF prefix its
    tensors carry). Raises, naming the rank, a family without MTP names, a model without
    ``mtp_num_layers`` or an ``hf_config`` count that disagrees (``plan.mtp_layers``)."""
    try:
        depth = mtp_layers(family, hf_config, mcfg)
        names = family.mtp
        assert names is not None
        proxy = names.proxy_layer(hf_config)
    except (UnmappedParameterError, ValueError) as e:
        raise type(e)(f"rank {rank}: {e}") from e
    moe = mlp_kind(mcfg, proxy) == "moe"
    layers = [mcfg.num_layers + i for i in range(depth)] if moe else []
    alias = {mcfg.num_layers + i: (proxy, names.fill(names.layer, hf_config, i)) for i in range(depth)}
    return layers, alias


def check_local_mode(mode: str, moe_layers: list[int], mcfg: Any, rank: int) -> None:
    """``mode="local"`` (vLLM's ``nccl_m2n``) exports dense models only."""
    if moe_layers and mode == "local":
        raise NotImplementedError(
            f"rank {rank}: MegatronSource(mode='local') does not support MoE layers "
            f"{moe_layers} (num_moe_experts={mcfg.num_moe_experts}); use mode='full'"
        )


def hf_geometry(
    hf_config: Any,
    mcfg: Any,
    chunk: torch.nn.Module,
    tp: int,
    rank: int,
    has_dense: bool,
    family: Family,
) -> Geometry:
    """Read the shapes from ``hf_config``; raise naming every field Megatron disagrees with.

    ``intermediate_size`` is compared only when some layer has a dense MLP: an all-MoE model never
    builds ``ffn_hidden_size`` (Mixtral's ``intermediate_size`` is the expert size, which the MoE
    exporter checks against ``moe_ffn_hidden_size``). MLA attention is checked by
    ``mla.mla_geometry`` instead of query groups / ``kv_channels``. The expected values are
    the family's own ``TransformerConfig`` table (``Family.megatron_fields``), the one the builder
    builds from."""
    mla = mla_geometry(hf_config, mcfg, family_is_mla=family.attention == "mla", rank=rank)
    want = family.megatron_fields(hf_config)
    heads = want["num_attention_heads"].value
    groups = heads if mla else want["num_query_groups"].value
    head_dim = want["kv_channels"].value if "kv_channels" in want else hf_config.hidden_size // heads
    g = Geometry(
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=want["ffn_hidden_size"].value,
        vocab=hf_config.vocab_size,
        padded_vocab=int(chunk.vocab_size),
        layers=hf_config.num_hidden_layers,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tp=tp,
        mla=mla,
    )
    fields = [
        "hidden_size", "num_attention_heads", *([] if mla else ["num_query_groups", "kv_channels"]),
        *(["ffn_hidden_size"] if has_dense else []), "num_layers",
    ]
    have = {f: getattr(mcfg, f) for f in fields}
    if not mla:
        have["num_query_groups"] = have["num_query_groups"] or mcfg.num_attention_heads
    checks = [(want[f].hf, want[f].value, f, have[f]) for f in fields]
    tie = family.gpt_model_fields(hf_config)["share_embeddings_and_output_weights"]
    checks += [
        (tie.hf, tie.value, "share_embeddings_and_output_weights",
         bool(getattr(chunk, "share_embeddings_and_output_weights", False))),
        (want["gated_linear_unit"].hf, want["gated_linear_unit"].value, "gated_linear_unit", bool(mcfg.gated_linear_unit)),
    ]
    bad = [f"hf_config.{h}={hv!r} but Megatron {m}={mv!r}" for h, hv, m, mv in checks if hv != mv]
    if g.vocab > g.padded_vocab:
        bad.append(f"hf_config.vocab_size={g.vocab} exceeds Megatron's padded vocabulary {g.padded_vocab}")
    if g.groups % tp:
        what = "num_attention_heads" if mla else "num_key_value_heads"
        bad.append(f"{what}={g.groups} is not divisible by tp={tp}")
    if bad:
        raise ValueError(f"rank {rank}: MegatronSource: the model does not match hf_config: " + "; ".join(bad))
    return g


def attention_entries(
    family: Family, hf_config: Any, bound: dict[tuple, Bound], layer_names: dict[int, list[str]], rank: int
) -> dict[str, Entry]:
    """MLA attention entries with each kind read from this rank's modules (``resolve_kinds``).

    Every local layer must declare the same split for a tensor; a fused ``linear_qkv_down_proj``
    (megatron-core 0.17+) replaces the two down projections."""
    dims: dict[str, set] = {}
    for key, b in bound.items():
        if key[0] == "layer":
            dims.setdefault(key[2], set()).add(b.tp_dim)
    mixed = {k: sorted(v, key=str) for k, v in dims.items() if len(v) > 1}
    if mixed:
        raise UnmappedParameterError(
            f"rank {rank}: Megatron layers on this rank split the same tensor differently over TP: {mixed}"
        )
    fused = any("self_attention.linear_qkv_down_proj.weight" in names for names in layer_names.values())
    try:
        keys = family.layer_keys(hf_config, fused_down=fused)
    except UnmappedParameterError as e:
        raise UnmappedParameterError(f"rank {rank}: {e}") from e
    entries = {k: e for k, e in keys.items() if k not in DENSE_MLP}
    return resolve_kinds(entries, {k: next(iter(v)) for k, v in dims.items()}, rank=rank)


def bind_units(
    plan: list[Unit],
    bound: dict[tuple, Bound],
    unmapped: list[str],
    *,
    topo: Topology,
    tied: bool,
    family: Family,
    moe: MegatronMoEExporter | None,
) -> dict[tuple, Bound]:
    """Every plan unit of this stage gets its local parameter (``bound``, consumed); anything left
    over -- a parameter with no checkpoint tensor, on top of ``unmapped`` -- is an error, and so is a
    parameter of another shape or chunk than the plan's."""
    rank = topo.rank
    mine: dict[tuple, Bound] = {}
    problems: list[str] = []
    for unit in plan:
        if unit.stage != topo.pp_rank:
            continue
        b = bound.pop(unit.key, None)
        if b is None:
            problems.append(f"missing Megatron parameter for {list(unit.names)} (pp stage {unit.stage}, chunk {unit.chunk})")
            continue
        if b.chunk != unit.chunk:
            problems.append(f"{b.name} is on chunk {b.chunk}, Megatron's layer offsets put it on chunk {unit.chunk}")
        if tuple(b.param.shape) != unit.shard_shape:
            problems.append(
                f"{b.name} has shape {tuple(b.param.shape)}, hf_config and tp={topo.tp} imply {unit.shard_shape}"
            )
        mine[unit.key] = b
    if tied:
        bound.pop(("lm_head",), None)  # the last stage's copy of the tied embedding
    _claim_moe(bound, moe)
    for key, b in bound.items():
        where = "this pipeline stage" if key[0] != "layer" else f"layer {key[1]} (not placed on this stage)"
        unmapped.append(f"chunk{b.chunk}:{b.name} ({where})")
    if unmapped:
        raise UnmappedParameterError(
            f"rank {rank}: Megatron parameters with no tensor in the {family.name} checkpoint "
            f"for this hf_config: {unmapped}"
        )
    if problems:
        raise ValueError(f"rank {rank}: MegatronSource cannot export this model: " + "; ".join(problems))
    return mine


def _claim_moe(bound: dict[tuple, Bound], moe: MegatronMoEExporter | None) -> None:
    """Remove from ``bound`` exactly the ``mlp.*`` parameters the MoE exporter reads on this rank
    (router, this rank's routed experts in their storage format, shared experts and gate as the
    config declares them); any other ``mlp.*`` parameter of a MoE layer stays and is unmapped."""
    if moe is None:
        return
    c = moe.mcfg
    for layer, mlp in moe.local.items():
        want = {"mlp.router.weight"}
        want |= set(megatron_moe_suffixes(moe.E_local, expert_format(mlp.experts)))
        if getattr(c, "moe_shared_expert_intermediate_size", None):
            want |= {"mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"}
            if getattr(c, "moe_shared_expert_gate", False):
                want.add("mlp.shared_experts.gate_weight")
        for suffix in want:
            bound.pop(("layer", layer, suffix), None)


def unit_dtype(unit: Unit, own: torch.dtype, wire: WirePolicy, rank: int) -> torch.dtype:
    """The wire dtype of ``unit``'s HF tensors (one Megatron tensor: one dtype for all of them)."""
    got = {wire.dtype_for(n, own) for n in unit.names}
    if len(got) > 1:
        raise ValueError(
            f"rank {rank}: keep_fp32= keeps some but not all of {list(unit.names)}, which "
            f"Megatron holds as one tensor ({unit.key[-1]}); match all of them or none"
        )
    return got.pop()


def moe_error(
    e: Exception, layer_names: dict[int, list[str]], *, moe_layers: list[int], family: Family, rank: int
) -> UnmappedParameterError:
    """``e`` from the MoE side, naming this rank, the MoE layers and their Megatron parameters."""
    local = sorted(L for L in layer_names if L in moe_layers)
    shown = [
        f"decoder.layers.<{L}>.{n}" for L in local[:1] for n in layer_names[L] if n.startswith("mlp.")
    ][:6] or ["mlp.router.weight", "mlp.experts.*"]
    return UnmappedParameterError(
        f"rank {rank}: Megatron layers {moe_layers} are MoE but the {family.name} "
        f"checkpoint for this hf_config has no tensors for them (e.g. {shown}): {e}"
    )
