"""megatron-core multi-head latent attention (MLA) as transformers DeepseekV3 attention: the shapes,
the TP layout of each tensor, and the variants that cannot be mapped.

What the mapping rests on, read in megatron-core 0.16.1 and 0.19.2
(``transformer/multi_latent_attention.py``, ``models/common/embeddings/rope_utils.py``,
``models/gpt/gpt_layer_specs.py``) and transformers 5 (``models/deepseek_v3/modeling_deepseek_v3.py``):

* **Row orders are identical on both sides**, so no tensor is permuted:
  q (``linear_q_proj`` / ``linear_q_up_proj`` -> ``q_proj`` / ``q_b_proj``): Megatron views the output
  as ``[n_heads, qk_head_dim + qk_pos_emb_head_dim]`` and splits ``[qk_head_dim, qk_pos_emb_head_dim]``;
  HF views ``[-1, qk_nope_head_dim + qk_rope_head_dim]`` and splits ``[nope, rope]``: rows are
  ``[nope, rope]`` per head. kv up (``linear_kv_up_proj`` -> ``kv_b_proj``): ``[k_nope, v]`` per head
  on both sides. kv down (``linear_kv_down_proj`` -> ``kv_a_proj_with_mqa``): both split the output
  ``[kv_lora_rank, rope]``. The latent norms (``q_layernorm`` / ``kv_layernorm``, or TE's
  ``layer_norm_weight`` fused into the up projections) are HF's ``q_a_layernorm`` /
  ``kv_a_layernorm`` and act on the same latents. The table itself (names, shapes, allowed TP splits)
  is the DeepSeek-V3 family's ``MLA`` (``sources/families/deepseek_v3.py``).
* **Rope.** Megatron's unfused MLA rope (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``)
  gathers ``t[..., 0::2]`` and ``t[..., 1::2]`` and applies ``rotate_half``: it rotates the
  interleaved pairs ``(x0, x1), (x2, x3), ...``. HF's ``rope_interleave=True`` (the default, and
  every DeepSeek-V3 / Kimi-K2 checkpoint) rotates exactly those pairs
  (``apply_rotary_pos_emb_interleave``), so the rope rows need no permutation. HF
  ``rope_interleave=False`` (plain ``rotate_half``) and Megatron ``rotary_interleaved=True`` compute
  other functions and raise. Megatron refuses fused rope for ``rope_type="rope"``; ``"yarn"`` must
  meet HF's ``rope_type "yarn"`` with the same factor, and ``"rope"`` HF's ``"default"``.
  (HF builds its latent norms with eps 1e-6 whatever ``rms_norm_eps`` says; Megatron uses
  ``layernorm_epsilon``: equal for DeepSeek's 1e-6, a forward-only difference otherwise.)
* **TP layout, from the module, not from a table.** ``linear_q_proj``, ``linear_q_up_proj`` and
  ``linear_kv_up_proj`` are column-parallel (a TP rank holds whole heads, a ``torch.chunk`` piece of
  the HF tensor); ``linear_proj`` is row-parallel. The down projections differ by spec: the local
  spec builds them as ``ColumnParallelLinear`` (each TP rank holds a chunk of rows and the forward
  gathers them), the TE spec as ``TELinear(parallel_mode="duplicated")`` (every rank holds all of
  it). megatron-core 0.17+ may fuse both into ``linear_qkv_down_proj`` (``mla_down_proj_fusion``):
  ``[q_a_proj; kv_a_proj_with_mqa]``, per TP shard ``[q_r; kv_r]`` when column-parallel (its own
  ``sharded_state_dict`` cuts it so). ``resolve_kinds`` reads each module's declared split
  (``walk.tp_split_dim``) and turns it into a layout kind; a split the table does not
  allow for that tensor raises naming it.

Variants that cannot be mapped raise ``UnmappedParameterError`` at construction naming the field:
Megatron MLA without latent norms (``qk_layernorm=False``: DeepseekV3 always normalizes the
latents), ``rotary_interleaved=True``, an ``experimental_attention_variant`` (e.g. DeepSeek-V3.2's
sparse attention, whose indexer DeepseekV3 lacks), a dense-attention Megatron model for an MLA
``hf_config`` and the reverse. Disagreeing sizes (``q_lora_rank``, ``kv_lora_rank``, head dims,
rope) raise ``ValueError`` listing every field, like the dense geometry check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.ground.errors import UnmappedParameterError
from ..families import Entry, family_for
from ..families.deepseek_v3 import FAMILY as DEEPSEEK_V3
from ..families.deepseek_v3 import MEGATRON_REFUSALS, MLA

__all__ = ["MLAGeometry", "is_mla", "mla_geometry", "mla_full_shapes", "resolve_kinds"]


@dataclass(frozen=True)
class MLAGeometry:
    """MLA sizes, named as in HF's DeepseekV3Config (Megatron's names in comments)."""

    hidden: int
    heads: int
    q_lora_rank: int | None  # q_lora_rank (None: one linear_q_proj)
    kv_lora_rank: int  # kv_lora_rank
    qk_nope_head_dim: int  # qk_head_dim
    qk_rope_head_dim: int  # qk_pos_emb_head_dim
    v_head_dim: int  # v_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def is_mla(mcfg: Any) -> bool:
    return bool(getattr(mcfg, "multi_latent_attention", False))


def mla_geometry(hf_config: Any, mcfg: Any, *, family_is_mla: bool, rank: int) -> MLAGeometry | None:
    """The MLA sizes of ``hf_config`` checked against Megatron's config; None for dense attention.

    Raises ``UnmappedParameterError`` (naming the field) when one side is MLA and the other is not,
    or Megatron's MLA is a variant DeepseekV3 cannot express; ``ValueError`` listing every size or
    rope setting the two configs disagree on."""
    mla = is_mla(mcfg)
    if mla != family_is_mla:
        side = (
            "hf_config is multi-head latent attention (q_lora_rank / kv_lora_rank) but Megatron's "
            "multi_latent_attention=False (fused linear_qkv)"
            if family_is_mla
            else f"Megatron's multi_latent_attention=True but hf_config ({getattr(hf_config, 'model_type', '?')}) "
            "has dense q/k/v attention"
        )
        raise UnmappedParameterError(f"rank {rank}: MegatronSource cannot map the attention: {side}")
    if not mla:
        return None
    family = family_for(hf_config, check=False)
    refusals = family.mla_refusals if family.mla_refusals is not None else MEGATRON_REFUSALS
    why = [w for refuse in refusals if (w := refuse(mcfg))]
    if why:
        as_what = "DeepseekV3" if family.mla_refusals is None else family.name
        raise UnmappedParameterError(
            f"rank {rank}: MegatronSource cannot export this Megatron MLA as {as_what}: " + "; ".join(why)
        )
    hf = hf_config
    g = MLAGeometry(
        hidden=hf.hidden_size,
        heads=hf.num_attention_heads,
        q_lora_rank=getattr(hf, "q_lora_rank", None) or None,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
    )
    # The family's own TransformerConfig table (what the builder builds from), field by field.
    want = DEEPSEEK_V3.megatron_fields(hf)
    fields = ["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base"]
    if want["rope_type"].value == "yarn" and getattr(mcfg, "rope_type", "rope") == "yarn":
        fields += ["rotary_scaling_factor", "original_max_position_embeddings"]
    have = {f: getattr(mcfg, f, None) for f in fields}
    have["q_lora_rank"] = have["q_lora_rank"] or None
    have["rope_type"] = have["rope_type"] or "rope"
    checks = [(want[f].hf, want[f].value, f, have[f]) for f in fields]
    bad = [f"hf_config.{h}={hv!r} but Megatron {m}={mv!r}" for h, hv, m, mv in checks if hv != mv]
    if bad:
        raise ValueError(
            f"rank {rank}: MegatronSource: the Megatron MLA does not match hf_config: " + "; ".join(bad)
        )
    return g


def mla_full_shapes(suffix: str, g: MLAGeometry) -> tuple[tuple[int, ...], ...] | None:
    """Full HF shapes of one layer-relative MLA Megatron parameter (None: not an MLA tensor)."""
    t = MLA.get(suffix)
    return None if t is None else t.shapes(g)


def resolve_kinds(entries: dict[str, Entry], tp_dims: dict[str, int | None], *, rank: int) -> dict[str, Entry]:
    """``entries`` with each MLA tensor's kind taken from the TP split its Megatron module declares.

    ``tp_dims``: layer-relative (local-spec) name -> split dim, read from this rank's layers. A name
    this rank holds no layer of keeps the table's (local-spec) kind; ``MegatronSource`` then has
    every rank agree on the plan's layout before the first transfer. A declared split the tensor
    cannot have raises ``UnmappedParameterError`` naming it."""
    out, bad = {}, []
    for suffix, entry in entries.items():
        allowed = MLA[suffix].splits if suffix in MLA else None
        if allowed is None or suffix not in tp_dims:
            out[suffix] = entry
            continue
        dim = tp_dims[suffix]
        if dim not in allowed:
            want = sorted(allowed, key=str)
            bad.append(f"{suffix} is split over TP along dim {dim}; DeepseekV3 export expects one of {want}")
            continue
        out[suffix] = Entry(allowed[dim], entry.hf)
    if bad:
        raise UnmappedParameterError(f"rank {rank}: MegatronSource cannot map this MLA's TP layout: " + "; ".join(bad))
    return out
