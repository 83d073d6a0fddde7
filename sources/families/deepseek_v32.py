"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's multi-head latent attention and MoE
(``deepseek_v3.py``, shared, not copied) plus DeepSeek sparse attention's lightning indexer on
every layer: ``self_attn.indexer.{wq_b, wk, k_norm (weight, bias), weights_proj}``.

megatron-core builds it with ``experimental_attention_variant="dsa"`` (``DSAttention`` as MLA's core
attention, holding ``DSAIndexer``: ``linear_wq_b``, ``linear_wk``, ``k_norm`` (LayerNorm),
``linear_weights_proj``, all duplicated over TP) and ``dsa_indexer_n_heads / head_dim / topk``.
What the mapping rests on (megatron-core 0.16.1 ``transformer/experimental_attention_variant/dsa.py``,
transformers 5.20 ``DeepseekV32Indexer``), docs/families.md has the detail:

* Same scores, other channel placement: megatron-core 0.16-0.18 ropes the *last*
  ``qk_rope_head_dim`` channels of each indexer head in interleaved pairs, 0.19 the *first* ones in
  half-split pairs (interleaved with ``dsa_indexer_rope_interleaved=True``), transformers the
  *first* ones in half-split pairs; the rows of ``wq_b`` (per head), ``wk`` and the ``k_norm``
  weight and bias (the one key head; a LayerNorm is equivariant under a channel permutation applied
  to its weight and bias too) are permuted as the Megatron config says: layout kind
  ``indexer_rope_half`` (``sources/core/layouts/tp.py``; the identity on 0.19 without the flag).
  ``weights_proj`` is the same tensor. GLM-5 (``glm_moe_dsa.py``) is this with interleaved pairs.
* Refused on every rank (``megatron_mismatch`` / ``mla_refusals``): a Megatron MLA without the DSA
  variant (it has no indexer), other indexer sizes or top-k, and DeepSeek-V3's MLA refusals
  (no latent norms, ``rotary_interleaved=True``); megatron-core 0.19's cross-layer top-k sharing
  (``dsa_indexer_topk_freq`` > 1: transformers' DeepSeek-V3.2 runs an indexer per layer) and
  ``dsa_indexer_scoring_relu=False`` (transformers' scores take the ReLU). HF-side: ``q_lora_rank=None`` (the indexer reads
  the q latent) and ``attention_bias=True``.
* Exported as they are: the indexer-loss settings (``dsa_indexer_loss_coeff``,
  ``dsa_indexer_use_sparse_loss``) only add a training loss (the forward and the weights' meaning
  do not change).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import deepseek_v3 as v3
from .base import Entry, Family, Field

__all__ = ["FAMILY", "INDEXER", "dsa_family"]

_P = "self_attention.core_attention.indexer."
_H = "self_attn.indexer."


def indexer_table(kind: str) -> dict[str, Entry]:
    """The indexer's Megatron tensors (local and TE specs name them alike), HF order."""
    return {
        _P + "linear_wq_b.weight": Entry(kind, (_H + "wq_b.weight",)),
        _P + "linear_wk.weight": Entry(kind, (_H + "wk.weight",)),
        _P + "k_norm.weight": Entry(kind, (_H + "k_norm.weight",)),
        _P + "k_norm.bias": Entry(kind, (_H + "k_norm.bias",)),
        _P + "linear_weights_proj.weight": Entry("replicated", (_H + "weights_proj.weight",)),
    }


INDEXER = indexer_table("indexer_rope_half")


def indexer_megatron_rope(mcfg: Any) -> str:
    """Where ``mcfg``'s megatron-core ``DSAIndexer`` ropes (one of ``core/layouts/rows.py``'s
    ``INDEXER_MEGATRON_ROPE``): read from the config class, since the ``dsa_indexer_rope_interleaved``
    field came with the move to the first channels (megatron-core 0.19; 0.16-0.18 ``_apply_rope``
    splits ``[nope, pe]`` and ropes MLA-style). Plain data about the config: no torch here."""
    if not hasattr(mcfg, "dsa_indexer_rope_interleaved"):
        return "last_interleaved"
    return "first_interleaved" if mcfg.dsa_indexer_rope_interleaved else "first_half"


def _shapes(suffix: str, hf: Any) -> tuple[tuple[int, ...], ...] | None:
    h, d, n = hf.hidden_size, hf.index_head_dim, hf.index_n_heads
    return {
        _P + "linear_wq_b.weight": ((n * d, hf.q_lora_rank or h),),
        _P + "linear_wk.weight": ((d, h),),
        _P + "k_norm.weight": ((d,),),
        _P + "k_norm.bias": ((d,),),
        _P + "linear_weights_proj.weight": ((n, h),),
    }.get(suffix)


def _dsa_fields(hf: Any) -> dict[str, Field]:
    return {
        "experimental_attention_variant": Field("(self_attn.indexer)", "dsa"),
        "dsa_indexer_n_heads": Field("index_n_heads", hf.index_n_heads),
        "dsa_indexer_head_dim": Field("index_head_dim", hf.index_head_dim),
        "dsa_indexer_topk": Field("index_topk", hf.index_topk),
    }


#: megatron-core 0.19 DSA settings with a value transformers cannot compute otherwise: field ->
#: (the one value that can be exported, why).
_FIXED_019 = {
    "dsa_indexer_topk_freq": (1, "cross-layer top-k sharing: transformers runs the indexer on every layer"),
    "dsa_indexer_scoring_relu": (True, "transformers' indexer scores take the ReLU of q.k"),
}


def _mismatch(hf: Any, mcfg: Any) -> list[str]:
    bad = [f"Megatron {f}={getattr(mcfg, f)!r} ({why})" for f, (ok, why) in _FIXED_019.items()
           if hasattr(mcfg, f) and getattr(mcfg, f) != ok]
    for field, (hf_name, want) in _dsa_fields(hf).items():
        have = getattr(mcfg, field, None)
        if have != want:
            what = (
                "the Megatron model has no DSA indexer, the checkpoint has self_attn.indexer.* on every layer"
                if field == "experimental_attention_variant"
                else "the indexer would compute other scores / keep other tokens"
            )
            bad.append(f"hf_config.{hf_name}={want!r} but Megatron {field}={have!r} ({what})")
    return bad


def _no_variant_check(mcfg: Any) -> str | None:
    variant = getattr(mcfg, "experimental_attention_variant", None)
    if variant in (None, "dsa"):
        return None  # None is refused by megatron_mismatch, naming the indexer
    return f"experimental_attention_variant={variant!r}: not DSA"


def dsa_family(name: str, architectures: tuple[str, ...], *, pairing: str,
               also_unsupported: Callable[[Any], str | None] = lambda hf: None) -> Family:
    """A DSA family: DeepSeek-V3's MLA + MoE tables with the indexer rows permuted for ``pairing``
    (``also_unsupported``: the family's own HF-side refusals)."""
    table = indexer_table(f"indexer_rope_{pairing}")

    def layer_table(family: Family, hf: Any, fused_down: bool) -> dict[str, Entry]:
        mla = v3.layer_table(family, hf, fused_down)
        out = {k: e for k, e in mla.items() if k != "self_attention.linear_proj.weight"}
        out.update(table)
        out["self_attention.linear_proj.weight"] = mla["self_attention.linear_proj.weight"]
        return out

    def unsupported(hf: Any) -> str | None:
        why = [w for w in (v3.unsupported(hf, always_interleaved=True), also_unsupported(hf)) if w]
        if not getattr(hf, "q_lora_rank", None):
            why.append(f"q_lora_rank=None: the {name} indexer's wq_b reads the q latent")
        return "; ".join(why) or None

    return Family(
        name,
        architectures,
        moe=v3.FAMILY.moe,
        megatron=lambda hf: {**v3.megatron(hf), **_dsa_fields(hf)},
        attention="mla",
        layer_table=layer_table,
        unsupported=unsupported,
        unbuildable=v3.unbuildable,
        tensor_shapes=_shapes,
        layout_kw=lambda hf, mcfg=None: {"indexer_rope": (
            hf.index_head_dim, hf.qk_rope_head_dim, indexer_megatron_rope(mcfg))},
        megatron_mismatch=_mismatch,
        mla_refusals=(v3.refuse_no_latent_norms, v3.refuse_rotary_interleaved, _no_variant_check),
        mtp=v3.MTP,  # vLLM's DeepseekV32MTP loads DeepSeek-V3's MTP names
    )


FAMILY = dsa_family("deepseek_v32", ("DeepseekV32ForCausalLM",), pairing="half")
