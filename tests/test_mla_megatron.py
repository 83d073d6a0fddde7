"""MegatronSource over megatron-core multi-head latent attention (DeepSeek-V3 class: MLA + MoE with a
first dense layer, shared experts and ``e_score_correction_bias``) on CPU gloo ranks, against oracles
nobody here wrote:

* names, shapes and dtypes == transformers' ``save_pretrained`` of the same DeepseekV3 config (an fp32
  and a bf16 wire), and the MLA tensors per layer (7 with ``q_lora_rank``, 5 without) == its count;
* every tensor == megatron-core's own ``dist_checkpointing`` of the same model (full tensors that
  torch's DCP reader assembles from megatron's shard metadata), cut under HF names by the layout
  ``sources/megatron/mla.py`` documents (no row permutation);
* logits: Megatron's own forward vs transformers' DeepseekV3 loaded with ``from_pretrained`` from the
  export (fp32, one rank), with negative controls (HF's other rope convention; kv_b_proj's per-head
  order swapped) that move the logits far beyond the tolerance;
* MLA variants that cannot be mapped raise at construction on every rank, naming the field.

Layouts: TP2, TP2 without q_lora_rank, EP2 (bf16 wire), PP2 x VPP2, a dense MLA in ``mode="local"``,
the TE spec's names and duplicated down projections at TP2 (TE is not installed: construction-only
doubles of its two classes, megatron-core 0.16 only) and, where megatron-core has it (0.17+), the
fused ``linear_qkv_down_proj`` at TP2 (2 ranks); TP2 x EP2 and PP2 x EP2 (4 ranks).
"""

from __future__ import annotations

import contextlib
import re
import tempfile

import pytest
import torch
from family_worlds import check_layout, check_refusals, expected_ends
from fsdp_worlds import unpack
from test_moe_megatron import _ck, _expected_moe
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

TOL = 2e-4

#: The documented layout: Megatron local-spec name -> HF name, tensors identical (full shapes).
_ATTN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",  # TE spec
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",  # TE spec
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


# ---- in the ranks --------------------------------------------------------------------------------


def _refusals(model, variant: str) -> dict[str, str | None]:
    """What MegatronSource raises for hf_configs this Megatron MLA model cannot be exported as."""
    import mla_models as mm
    import transformers as tf
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    hf = mm.hf_config(variant)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    llama = tf.LlamaConfig(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                           num_attention_heads=hf.num_attention_heads, num_hidden_layers=hf.num_hidden_layers,
                           vocab_size=hf.vocab_size, architectures=["LlamaForCausalLM"])
    bad = {
        "kv_lora_rank": mm.hf_config(variant, kv_lora_rank=hf.kv_lora_rank + 8),
        "q_lora_rank": mm.hf_config(variant, q_lora_rank=None if hf.q_lora_rank else 16),
        "v_head_dim": mm.hf_config(variant, v_head_dim=hf.v_head_dim + 4),
        "rope_type": mm.hf_config(variant, rope_parameters=yarn),
        "rope_interleave": mm.hf_config(variant, rope_interleave=False),
        "attention_bias": mm.hf_config(variant, attention_bias=True),
        "multi_latent_attention": llama,
    }
    return {k: errors_of(lambda c=c: MegatronSource(model, hf_config=c)) for k, c in bad.items()}


def _skip(lay) -> str | None:
    """Why this megatron-core cannot build the layout (None: it can)."""
    import mla_models as mm

    no_fused = lay.get("fused") and not mm.has_fused_down()
    return mm.unsupported(lay["variant"]) or (
        "megatron-core has no FusedMLASelfAttention (0.17+)" if no_fused else None
    ) or (mm.te_like_unsupported() if lay.get("te") else None)


def _hf_of(lay) -> object:
    import mla_models as mm

    return mm.hf_config(lay["variant"], **lay.get("hf", {}))


def _build(hf, par, lay) -> list:
    """The one builder, with the fused down projection's or the TE spec's attention if asked."""
    import mla_models as mm

    hook = mm.fused_down_spec if lay.get("fused") else mm.te_like_spec if lay.get("te") else None
    with mm.te_like_build() if lay.get("te") else contextlib.nullcontext():
        return mm.build_megatron(hf, par, spec_hook=hook)


def _layout_facts(rank, lay, hf, chunks, src) -> dict:
    """MLA's facts of one layout (``family_worlds.megatron_layouts``): each layer unit's TP kind, the
    Megatron model's layer parameter names and, on the layout that asks, its refusals."""
    f = {
        "kinds": {u.key[2]: u.kind for u in src.plan if u.key[0] == "layer"},
        "layer_names": sorted({n.split(".", 3)[3] for c in chunks for n, _ in c.named_parameters()
                               if n.startswith("decoder.layers.")}),
    }
    if lay.get("refusals"):
        f["refusals"] = _refusals(chunks if lay.get("vpp") else chunks[0], lay["variant"])
    return f


def _world(rank, world_size, *, root, layouts):
    """Each layout: build, save with megatron's dist_checkpointing, export; rank 0 keeps the tensors."""
    from family_worlds import megatron_layouts

    return megatron_layouts(rank, world_size, root=root, layouts=layouts, hf_of=_hf_of, extra=_layout_facts,
                            build=_build, skip=_skip)


def _forward_world(rank, world_size):
    """One rank, TP1: Megatron's forward vs transformers' DeepseekV3 loaded from the export."""
    import mla_models as mm

    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.sources import MegatronSource

    out = {}
    for variant in ("q_lora", "no_q_lora"):
        if mm.unsupported(variant):
            out[variant] = {"skip": mm.unsupported(variant)}
            continue
        hf = mm.hf_config(variant)
        # init std 0.1 (megatron's default is 0.02): sharper attention, so the rope rows matter
        chunks = mm.build_megatron(hf, MegatronParallel(), seed=5, overrides={"init_method_std": 0.1})
        exported = {n: t.clone() for n, t in MegatronSource(chunks[0], hf_config=hf).iter_full()}
        ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        ref = mm.megatron_logits(chunks, ids, hf.vocab_size)
        f = {"shape": tuple(ref.shape), "scale": ref.abs().max().item()}
        f["diff"] = (mm.hf_logits(hf, exported, ids) - ref).abs().max().item()
        # Negative controls: HF's other rope convention; kv_b_proj rows [v, k_nope] per head.
        other_rope = mm.hf_config(variant, rope_interleave=False)
        f["rope_ctrl"] = (mm.hf_logits(other_rope, exported, ids) - ref).abs().max().item()
        kvb = {n: t for n, t in exported.items()}
        for n in [n for n in kvb if n.endswith("kv_b_proj.weight")]:
            per = hf.qk_nope_head_dim + hf.v_head_dim
            w = kvb[n].view(hf.num_attention_heads, per, -1)
            kvb[n] = torch.cat([w[:, hf.qk_nope_head_dim:], w[:, : hf.qk_nope_head_dim]], 1).reshape(-1, w.shape[-1])
        f["kvb_ctrl"] = (mm.hf_logits(hf, kvb, ids) - ref).abs().max().item()
        out[variant] = f
    from fsdp_worlds import pack

    return pack(out)


# ---- oracles (parent process) ----------------------------------------------------------------------


def _has(ck, suffix, layer) -> bool:
    return f"decoder.layers.{layer}.{suffix}" in ck or f"decoder.layers.{suffix}" in ck


def _expected(ck, hf) -> dict[str, torch.Tensor]:
    """Every HF tensor cut from megatron's own full checkpoint ``ck`` by the documented layout."""
    from weightsync.sources.megatron.moe_names import HFMoENames

    want: dict[str, torch.Tensor] = {}
    first = hf.first_k_dense_replace
    for i in range(hf.num_hidden_layers):
        pre = f"model.layers.{i}."
        for msuf, hsuf in _ATTN.items():
            if _has(ck, msuf, i):
                want[pre + hsuf] = _ck(ck, msuf, i)
        if _has(ck, "self_attention.linear_qkv_down_proj.weight", i):
            raise AssertionError("megatron's checkpoint keeps the fused down projection: expected it split")
        if i < first:
            fc1 = _ck(ck, "mlp.linear_fc1.weight", i)
            want[pre + "mlp.gate_proj.weight"], want[pre + "mlp.up_proj.weight"] = fc1.chunk(2, 0)
    want.update(_expected_moe(ck, HFMoENames(hf), list(range(first, hf.num_hidden_layers))))
    want.update(expected_ends(ck, hf))
    return want


def _mla_per_layer(names) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.self_attn\.", n)
        if m:
            counts[int(m.group(1))] = counts.get(int(m.group(1)), 0) + 1
    return counts


def _check(res, root, lay) -> dict:
    """``family_worlds.check_layout`` with MLA's documented layout (no row permutation), plus: on a
    bf16 wire the router keeps its fp32 (the policy every source shares); the MLA tensors of each
    layer are as many as the checkpoint has (7 with q_lora_rank, 5 without). Returns rank 0's facts."""
    r0 = res[0][lay["name"]]
    if "skip" in r0:
        return r0
    hf = _hf_of(lay)
    # (e_score_correction_bias is fp32 in save_pretrained's bf16 checkpoint already)
    r0 = check_layout(res, root, lay, hf, expected=_expected, kept_fp32=re.compile(r"mlp\.gate\.weight$"),
                      fused_qkv=False)
    if lay.get("dtype") not in (None, torch.float32):
        from test_moe_megatron import _check_same_wire_dtypes_as_fsdp

        _check_same_wire_dtypes_as_fsdp({r: {"bf16_meta": [(n, d) for n, _, d, _ in res[r][lay["name"]]["meta"]]}
                                         for r in res}, hf)
    # check_layout: rank 0's names are save_pretrained's, so these counts are the checkpoint's too
    assert set(_mla_per_layer(r0["got"]).values()) == {7 if hf.q_lora_rank else 5}, _mla_per_layer(r0["got"])
    return r0


TWO_RANKS = [
    dict(name="tp2", variant="q_lora", tp=2, refusals=True),
    dict(name="tp2_no_q_lora", variant="no_q_lora", tp=2),
    dict(name="ep2_bf16", variant="q_lora", ep=2, dtype=torch.bfloat16),
    dict(name="pp2_vpp2", variant="q_lora", pp=2, vpp=2, hf=dict(num_hidden_layers=4)),
    dict(name="dense_tp2_local", variant="q_lora", tp=2, local=True, hf=dict(first_k_dense_replace=2)),
    dict(name="fused_down_tp2", variant="q_lora", tp=2, fused=True),
    dict(name="fused_down_pp2", variant="q_lora", pp=2, fused=True),  # TP1: rank 0's local-step split
    dict(name="te_names_tp2", variant="q_lora", tp=2, te=True),
    dict(name="no_latent_norms", variant="q_lora", tp=2, refuse={"qk_layernorm": False}),
]

FOUR_RANKS = [
    dict(name="tp2_ep2", variant="q_lora", tp=2, ep=2),
    dict(name="pp2_ep2", variant="no_q_lora", pp=2, ep=2),
    dict(name="pp2_ep2_q_lora", variant="q_lora", pp=2, ep=2),
]


@pytest.fixture(scope="module")
def two_ranks():
    root = tempfile.mkdtemp()
    return root, run_world(_world, 2, root=root, layouts=TWO_RANKS, timeout=900)


@pytest.mark.parametrize("lay", [lay for lay in TWO_RANKS if "refuse" not in lay], ids=lambda lay: lay["name"])
def test_two_ranks_export_equals_save_pretrained_and_megatron_checkpoint(two_ranks, lay):
    root, res = two_ranks
    r0 = _check(res, root, lay)
    if "skip" in r0:
        pytest.skip(r0["skip"])
    if lay.get("local"):  # (else check_layout: mode="local" refused on every rank, naming it)
        assert r0["local_equal"]
    if lay["name"] == "ep2_bf16":
        bias = r0["got"]["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and r0["got"]["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    if lay["name"] == "tp2":  # at TP2 the head-split projections really arrive from rank 1
        assert r0["stats"]["bytes_received"] > 0
    # the Megatron model really had the attention this layout names
    down = "self_attention." + ("linear_qkv_down_proj.weight" if lay.get("fused") else "linear_kv_down_proj.weight")
    assert down in r0["layer_names"]
    q = "self_attention." + ("linear_q_up_proj.weight" if lay["variant"] == "q_lora" else "linear_q_proj.weight")
    assert q in r0["layer_names"]
    # the down projections' TP layout as their modules declare it: column (local spec), duplicated (TE)
    want_kind = {"fused": "stack_column", "te": "replicated"}
    down_kind = next((k for flag, k in want_kind.items() if lay.get(flag)), "column")
    assert r0["kinds"][down] == down_kind
    assert r0["kinds"]["self_attention.linear_kv_up_proj.weight"] == "column"
    assert r0["kinds"]["self_attention.linear_proj.weight"] == "row"
    if lay.get("te"):  # TE names: latent norms fused into the up projections, no separate norm modules
        assert "self_attention.linear_kv_up_proj.layer_norm_weight" in r0["layer_names"]
        assert "self_attention.linear_q_up_proj.layer_norm_weight" in r0["layer_names"]
        assert not any(n.endswith("q_layernorm.weight") or n.endswith("kv_layernorm.weight") for n in r0["layer_names"])


def test_two_ranks_unmappable_variants_raise_on_every_rank(two_ranks):
    _, res = two_ranks
    check_refusals(res, {
        "kv_lora_rank": ("ValueError", "kv_lora_rank=32"),
        "q_lora_rank": ("ValueError", "q_lora_rank=None"),
        "v_head_dim": ("ValueError", "v_head_dim=16"),
        "rope_type": ("ValueError", "rope_type='yarn'"),
        "rope_interleave": ("UnmappedParameterError", "rope_interleave=False"),
        "attention_bias": ("UnmappedParameterError", "attention_bias=True"),
        "multi_latent_attention": ("UnmappedParameterError", "multi_latent_attention=True"),
    })
    for r in res:
        err = res[r]["no_latent_norms"]["error"]
        assert err and err.startswith("UnmappedParameterError") and "qk_layernorm=False" in err and f"rank {r}" in err


def test_four_ranks_tp2_ep2_and_pp2_ep2():
    root = tempfile.mkdtemp()
    res = run_world(_world, 4, root=root, layouts=FOUR_RANKS, timeout=900)
    ran = 0
    for lay in FOUR_RANKS:
        r0 = _check(res, root, lay)
        ran += "skip" not in r0
    assert ran >= 2
    # EP2: experts of the other EP rank arrive point to point; PP2: stage 1 sends its layers
    assert res[0]["tp2_ep2"]["stats"]["bytes_received"] > 0
    assert all(res[r]["pp2_ep2_q_lora"]["stats"]["collectives"] > 0 for r in (1, 2, 3))


def test_forward_logits_megatron_vs_transformers_from_export():
    res = run_world(_forward_world, 1, timeout=600)[0]
    for variant, f in res.items():
        if "skip" in f:
            continue
        assert f["diff"] <= TOL, (variant, f)
        # the controls show the check can fail: rope pairs and per-head kv order matter
        assert f["rope_ctrl"] > 100 * TOL and f["kvb_ctrl"] > 100 * TOL, (variant, f)
    assert "diff" in res["q_lora"]


def test_te_and_local_mla_names_map_to_the_same_checkpoint_names():
    """Names alone (no world): the TE spec's fused-norm names and megatron-core 0.17+'s fused down
    projection map to the checkpoint names their local-spec counterparts map to."""
    import mla_models as mm

    from weightsync.sources.families import megatron_to_hf

    cfg = mm.hf_config("q_lora")
    pre = "decoder.layers.0.self_attention."
    for te, local in (("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"),
                      ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight")):
        assert megatron_to_hf(pre + te, hf_config=cfg) == megatron_to_hf(pre + local, hf_config=cfg)
    kv_norm = megatron_to_hf(pre + "kv_layernorm.weight", hf_config=cfg)
    assert kv_norm == ("model.layers.0.self_attn.kv_a_layernorm.weight",)
    assert megatron_to_hf(pre + "linear_qkv_down_proj.weight", hf_config=cfg) == (
        "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    )
    assert megatron_to_hf(pre + "linear_qkv_down_proj.layer_norm_weight", hf_config=cfg) == (
        "model.layers.0.input_layernorm.weight",
    )


def test_sparse_attention_variant_is_refused_by_name():
    """DeepSeek-V3.2's sparse attention (megatron ``experimental_attention_variant="dsa"``) adds an
    indexer DeepseekV3 has no tensors for: refused before any size is read."""
    from types import SimpleNamespace

    import mla_models as mm

    from weightsync.sources.core.ground.errors import UnmappedParameterError
    from weightsync.sources.megatron.mla import mla_geometry

    mcfg = SimpleNamespace(multi_latent_attention=True, qk_layernorm=True, rotary_interleaved=False,
                           experimental_attention_variant="dsa")
    with pytest.raises(UnmappedParameterError, match="rank 3: .*experimental_attention_variant='dsa'"):
        mla_geometry(mm.hf_config("q_lora"), mcfg, family_is_mla=True, rank=3)
