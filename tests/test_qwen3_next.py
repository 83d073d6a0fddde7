"""Qwen3-Next and Qwen3.5 text models (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``:
hybrid gated delta net + gated attention, ``sources/families/qwen3_next.py``) through
``MegatronSource`` on CPU gloo ranks, against oracles nobody here wrote:

* megatron-core's own ``dist_checkpointing``: ``GatedDeltaNet.sharded_state_dict`` saves its
  in-projection as six global tensors (``in_proj.weight.{query,key,value,z,beta,alpha}``) and its
  conv1d as three, whatever the TP size; torch's DCP reader assembles them. Every exported tensor is
  cut from those full tensors by the HF layout written out here, loop by loop, from transformers'
  modeling code (``fix_query_key_value_ordering`` for Qwen3-Next's per-key-head ``in_proj_qkvz`` /
  ``in_proj_ba``; Qwen3.5's flat ``in_proj_qkv`` / ``z`` / ``b`` / ``a``; ``[q_h; gate_h]`` per head
  for the gated ``q_proj``; the output norm ``+ 1`` of a zero-centered model) -- at TP2, PP2, EP2,
  TP2 x EP2, fp32 and bf16 wires;
* transformers' ``save_pretrained``: names, shapes and dtypes equal (routers and shared-expert gates
  kept fp32 on a bf16 wire, as ``FSDPSource`` declares them);
* negative controls: the same export with the layouts a naive mapping would use (plain
  concatenation of the conv1d shards, each in-projection tensor and q / k / v chunked per shard
  without regrouping or de-interleaving the gate) differs from megatron's checkpoint exactly in those tensors;
  Megatron models that are not zero-centered, or not gated, are refused on every rank naming the field.
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib

import pytest
import torch
from family_worlds import check_layout, check_cli, ck_any, expected_dense_mlp, expected_ends, preset_config
from fsdp_worlds import unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
#: Kept fp32 on a bf16 wire (routers, shared-expert gates: the shared wire policy).
KEPT_FP32 = re.compile(r"\.mlp\.(gate|shared_expert_gate)\.weight$")
ARCH = {"tiny-qwen3-next": "Qwen3NextForCausalLM", "tiny-qwen3.5": "Qwen3_5ForCausalLM",
        "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM"}


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def hf_config(preset: str, **over):
    return preset_config(preset, ARCH[preset], **over)


def _hf_of(lay: dict):
    return hf_config(lay["preset"], **lay.get("hf", {}))


def _build(hf, par, lay):
    """The one builder's chunks (``mla_models.build_megatron``: norms and biases random per global
    name), plus conv1d and A_log random per global layer *and TP rank*: megatron draws both from
    the same generator state on every TP rank, so their shards would otherwise be equal and a
    swapped shard invisible."""
    import mla_models as mm
    from megatron.core import parallel_state as ps

    chunks = mm.build_megatron(hf, par, overrides=lay.get("refuse"), spec_hook=_te_like if lay.get("te") else None)
    tp = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if name.endswith(("conv1d.weight", "A_log")):
                    layer = chunk.decoder.layers[int(name.split(".")[2])].layer_number
                    g = torch.Generator().manual_seed(zlib.crc32(f"{name.split('.', 3)[3]}{layer}@{tp}".encode()))
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return chunks


def _te_like(spec):
    """The block with the Transformer-Engine spec's module layout: each pre-norm fused into the
    following column-parallel linear (``layer_norm_weight``): GDN ``in_proj``, ``linear_qkv``, dense
    ``linear_fc1`` (megatron's ``get_gated_delta_net_module_spec`` with TE:
    ``column_parallel_layer_norm_linear`` and ``fuse_input_layernorm``)."""
    import mla_models as mm
    from megatron.core.transformer.identity_op import IdentityOp

    norm_linear = mm._norm_linear_class()
    for layer in spec.layer_specs:
        sub = layer.submodules
        att = sub.self_attention.submodules
        if hasattr(att, "in_proj"):
            att.in_proj = norm_linear
        else:
            att.linear_qkv = norm_linear
        sub.input_layernorm = IdentityOp
        mlp = getattr(sub.mlp, "submodules", None) or getattr(sub.mlp, "keywords", {}).get("submodules")
        if hasattr(mlp, "linear_fc1"):  # (megatron-core 0.19 may hold the MLP spec as a partial)
            mlp.linear_fc1 = norm_linear
            sub.pre_mlp_layernorm = IdentityOp
    return spec


# ---- the expected export, from megatron's own checkpoint -----------------------------------------


def _gated_q(qkv, hf):
    """HF (q_proj, k_proj, v_proj) from megatron's full gated ``linear_qkv``, row block by row block:
    per query group ``[q x hpg, gate x hpg, k, v]``; HF ``q_proj`` = per head ``[q_h; gate_h]``."""
    H, G = hf.num_attention_heads, hf.num_key_value_heads
    d, hpg = hf.head_dim, H // G
    q, k, v = [], [], []
    for g in range(G):
        grp = qkv[g * (2 * hpg + 2) * d : (g + 1) * (2 * hpg + 2) * d]
        for h in range(hpg):
            q += [grp[h * d : (h + 1) * d], grp[(hpg + h) * d : (hpg + h + 1) * d]]
        k.append(grp[2 * hpg * d : (2 * hpg + 1) * d])
        v.append(grp[(2 * hpg + 1) * d :])
    return torch.cat(q), torch.cat(k), torch.cat(v)


def _gdn(ck, hf, i, fmt) -> dict[str, torch.Tensor]:
    """One gated-delta-net layer's HF tensors from megatron's per-block checkpoint tensors."""
    pre = f"model.layers.{i}.linear_attn."
    blk = {b: ck_any(ck, i, f"self_attention.in_proj.weight.{b}") for b in ("query", "key", "value", "z", "beta", "alpha")}
    conv = [ck_any(ck, i, f"self_attention.conv1d.weight.{b}") for b in ("query", "key", "value")]
    nk, dk, nv, dv = hf.linear_num_key_heads, hf.linear_key_head_dim, hf.linear_num_value_heads, hf.linear_value_head_dim
    r = nv // nk
    out = {
        pre + "conv1d.weight": torch.cat(conv),
        pre + "A_log": ck_any(ck, i, "self_attention.A_log"),
        pre + "dt_bias": ck_any(ck, i, "self_attention.dt_bias"),
        # zero-centered megatron norm x * (1 + w) vs HF's x * w
        pre + "norm.weight": ck_any(ck, i, "self_attention.out_norm.weight").float() + 1.0,
        pre + "out_proj.weight": ck_any(ck, i, "self_attention.out_proj.weight"),
    }
    if fmt == "qkvz_ba":  # transformers' fix_query_key_value_ordering, inverted: rows per key head
        qkvz, ba = [], []
        for g in range(nk):
            qkvz += [blk["query"][g * dk : (g + 1) * dk], blk["key"][g * dk : (g + 1) * dk],
                     blk["value"][g * r * dv : (g + 1) * r * dv], blk["z"][g * r * dv : (g + 1) * r * dv]]
            ba += [blk["beta"][g * r : (g + 1) * r], blk["alpha"][g * r : (g + 1) * r]]
        out[pre + "in_proj_qkvz.weight"], out[pre + "in_proj_ba.weight"] = torch.cat(qkvz), torch.cat(ba)
    else:
        out[pre + "in_proj_qkv.weight"] = torch.cat([blk["query"], blk["key"], blk["value"]])
        out[pre + "in_proj_z.weight"] = blk["z"]
        out[pre + "in_proj_b.weight"] = blk["beta"]
        out[pre + "in_proj_a.weight"] = blk["alpha"]
    return out


def _moe_layers(hf) -> list[int]:
    from weightsync.sources.families import family_for

    freq = family_for(hf).megatron_fields(hf).get("moe_layer_freq")
    if freq is None:
        return []
    f = freq.value
    return [i for i in range(hf.num_hidden_layers) if (f[i] if isinstance(f, list) else i % f == 0)]


def _expected(ck, hf) -> dict[str, torch.Tensor]:
    from test_moe_megatron import _expected_moe

    from weightsync.sources.megatron.moe_names import HFMoENames

    moe = _moe_layers(hf)
    want = _expected_moe(ck, HFMoENames(hf), moe) if moe else {}
    fmt = "qkvz_ba" if hf.model_type == "qwen3_next" else "qkv_z_b_a"
    for i, kind in enumerate(hf.layer_types):
        pre = f"model.layers.{i}."
        # local-spec norms are saved under TE-compatible keys (megatron's TransformerLayer mapping)
        want[pre + "input_layernorm.weight"] = ck_any(
            ck, i, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.in_proj.layer_norm_weight")
        want[pre + "post_attention_layernorm.weight"] = ck_any(
            ck, i, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        if kind == "linear_attention":
            want.update(_gdn(ck, hf, i, fmt))
        else:
            q, k, v = _gated_q(ck_any(ck, i, "self_attention.linear_qkv.weight"), hf)
            want.update({pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                         pre + "self_attn.v_proj.weight": v})
            want[pre + "self_attn.o_proj.weight"] = ck_any(ck, i, "self_attention.linear_proj.weight")
            want[pre + "self_attn.q_norm.weight"] = ck_any(ck, i, "self_attention.q_layernorm.weight")
            want[pre + "self_attn.k_norm.weight"] = ck_any(ck, i, "self_attention.k_layernorm.weight")
        if i not in moe:
            want.update(expected_dense_mlp(ck, i, pre))
    want.update(expected_ends(ck, hf))
    return want


# ---- the worlds ---------------------------------------------------------------------------------


def _naive(family):
    """``family`` with the layouts a naive mapping uses: the conv1d shards concatenated as they are
    (megatron tags them partition_dim=0), each in-projection HF tensor and the gated ``linear_qkv``'s
    q / k / v cut from every shard in proportion (``stack_column``: no regrouping, no gate interleave)."""
    from dataclasses import replace

    from weightsync.sources.families import Entry

    wrong = {"self_attention.conv1d.weight": "column", "self_attention.in_proj.weight": "stack_column",
             "self_attention.linear_qkv.weight": "stack_column"}

    def hybrid(fam, hf, layer):
        return {k: (Entry(wrong[k], e.hf) if k in wrong else e) for k, e in family.hybrid(family, hf, layer).items()}

    return replace(family, hybrid=hybrid)


def _facts(rank, lay, hf, chunks, src) -> dict:
    """Per layout: the naive-layout export (``control``) and, where asked, the refusals."""
    from worlds import errors_of

    from weightsync.sources import MegatronSource
    from weightsync.sources.families import family_for, register

    f: dict = {}
    model = chunks if len(chunks) > 1 else chunks[0]
    if lay.get("control"):
        real = family_for(hf)
        register(_naive(real))
        try:
            got = {n: t.clone() for n, t in MegatronSource(model, hf_config=hf).iter_full()}
        finally:
            register(real)
        if rank == 0:
            f["control"] = got
    if lay.get("refusals"):
        bad = {"linear_num_value_heads": _hf_of({**lay, "hf": {"linear_num_value_heads": 16}}),
               "layer_types": _hf_of({**lay, "hf": {"layer_types": ["linear_attention"] * 4}})}
        f["refusals"] = {k: errors_of(lambda c=c: MegatronSource(model, hf_config=c)) for k, c in bad.items()}
    return f


def _world(rank, world_size, *, root, layouts):
    from family_worlds import megatron_layouts

    return megatron_layouts(rank, world_size, root=root, layouts=layouts, hf_of=_hf_of, extra=_facts, build=_build)


TWO_RANKS = [
    dict(name="next_tp2", preset="tiny-qwen3-next", tp=2, control=True, refusals=True),
    dict(name="next_pp2", preset="tiny-qwen3-next", pp=2),
    dict(name="next_ep2_bf16", preset="tiny-qwen3-next", ep=2, dtype=torch.bfloat16),
    dict(name="q35_tp2", preset="tiny-qwen3.5", tp=2, control=True, local=True),
    dict(name="q35_pp2", preset="tiny-qwen3.5", pp=2, local=True),
    dict(name="q35_tp2_bf16", preset="tiny-qwen3.5", tp=2, dtype=torch.bfloat16),
    dict(name="q35_tp2_te", preset="tiny-qwen3.5", tp=2, te=True, local=True),
    dict(name="q35moe_tp2_bf16", preset="tiny-qwen3.5-moe", tp=2, dtype=torch.bfloat16),
    dict(name="q35moe_ep2", preset="tiny-qwen3.5-moe", ep=2),
    dict(name="q35moe_pp2", preset="tiny-qwen3.5-moe", pp=2),
    dict(name="not_zero_centered", preset="tiny-qwen3.5", tp=2, refuse={"layernorm_zero_centered_gamma": False}),
    dict(name="not_gated", preset="tiny-qwen3-next", tp=2, refuse={"attention_output_gate": False}),
]


@pytest.fixture(scope="module")
def two_ranks():
    root = tempfile.mkdtemp()
    return root, run_world(_world, 2, root=root, layouts=TWO_RANKS, timeout=900)


def _check(res, root, lay) -> dict:
    hf = _hf_of(lay)
    # check_layout asserts mode="local" is refused unless the layout reads it; dense models support it
    # (the fp32 layouts with local=True compare its pieces), so a dense bf16 layout skips that assert
    dense = not _moe_layers(hf)
    r0 = check_layout(res, root, {**lay, "local": lay.get("local") or dense}, hf, expected=_expected,
                      kept_fp32=KEPT_FP32, fused_qkv=False)
    if dense and not lay.get("local"):
        assert all(res[r][lay["name"]]["local_error"] is None for r in res)
    if lay.get("dtype") == torch.bfloat16:
        kept = {n for n, t in r0["got"].items() if t.dtype == torch.float32}
        assert bool(kept) == bool(_moe_layers(hf)) and all(KEPT_FP32.search(n) for n in kept), sorted(kept)
    return r0


@pytest.mark.parametrize("lay", [lay for lay in TWO_RANKS if "refuse" not in lay], ids=lambda lay: lay["name"])
def test_two_ranks_equal_dist_checkpointing_and_save_pretrained(two_ranks, lay):
    root, res = two_ranks
    r0 = _check(res, root, lay)
    if lay.get("tp", 1) > 1 or lay.get("ep", 1) > 1 or lay.get("pp", 1) > 1:
        assert r0["stats"]["bytes_received"] > 0  # the other rank's shards really arrive
    if lay.get("local"):  # dense Qwen3.5: mode="local" pieces (gathered where not chunks) == full export
        assert r0["local_equal"] is True


@pytest.mark.parametrize("name", ["next_tp2", "q35_tp2"])
def test_naive_layouts_differ_exactly_where_the_gated_delta_net_needs_regrouping(two_ranks, name):
    """Negative control: plain shard concatenation (conv1d), per-shard proportional cuts (in-projection,
    gated qkv) each give tensors of the right shapes that are *not* megatron's: the
    comparison above would catch any of them. Qwen3.5's z / b / a really are chunks per shard, so
    the proportional cut gets them right (and only them)."""
    from moe_megatron import load_full_checkpoint

    root, res = two_ranks
    lay = next(lay for lay in TWO_RANKS if lay["name"] == name)
    hf = _hf_of(lay)
    want = _expected(load_full_checkpoint(f"{root}/{name}"), hf)
    got = res[0][name]["control"]
    assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in want.items()}
    differ = {re.sub(r"layers\.\d+\.", "layers.*.", n) for n, t in want.items() if not torch.equal(got[n], t.to(got[n].dtype))}
    inproj = ({"in_proj_qkvz", "in_proj_ba"} if hf.model_type == "qwen3_next" else {"in_proj_qkv"})
    # (one query group per TP rank: its k and v rows are a proportional cut; q_proj's gate interleave is not)
    assert differ == {f"model.layers.*.linear_attn.{x}.weight" for x in (*inproj, "conv1d")} | {
        "model.layers.*.self_attn.q_proj.weight"}, sorted(differ)


def test_refusals_raise_on_every_rank_naming_the_field(two_ranks):
    _, res = two_ranks
    for r in res:
        got = res[r]["next_tp2"]["refusals"]
        err = got["linear_num_value_heads"]
        assert err and f"rank {r}" in err and "linear_num_value_heads" in err, err
        err = got["layer_types"]
        assert err and f"rank {r}" in err and "linear_attention_freq" in err, err
        err = res[r]["not_zero_centered"]["error"]
        assert err.startswith("UnmappedParameterError") and "layernorm_zero_centered_gamma=False" in err and f"rank {r}" in err, err
        err = res[r]["not_gated"]["error"]
        assert err.startswith("UnmappedParameterError") and "attention_output_gate=False" in err and f"rank {r}" in err, err


#: The one 4-rank world of the frontier families (starting a world costs many seconds): Qwen3-Next,
#: Qwen3.5-MoE (bf16) and the DSA families (``test_dsa``: DeepSeek-V3.2 fp32, GLM-5 bf16) at TP2 x EP2, each DSA layout with
#: its negative control (``test_dsa.other_pairing``).
FOUR_RANKS = [
    dict(name="next_tp2_ep2", preset="tiny-qwen3-next", tp=2, ep=2),
    dict(name="q35moe_tp2_ep2_bf16", preset="tiny-qwen3.5-moe", tp=2, ep=2, dtype=torch.bfloat16),
    dict(name="v32_tp2_ep2", family="deepseek_v32", tp=2, ep=2),
    dict(name="glm5_tp2_ep2_bf16", family="glm_moe_dsa", tp=2, ep=2, dtype=torch.bfloat16),
]


def _is_dsa(lay) -> bool:
    return "family" in lay


def _world4(rank, world_size, *, root, layouts):
    """``megatron_layouts`` over layouts of two test modules: each layout built, named and checked by
    its own module (``test_dsa`` for the ones with a ``family``)."""
    import test_dsa as dsa
    from family_worlds import megatron_layouts

    def pick(lay, mine, theirs):
        return theirs if _is_dsa(lay) else mine

    return megatron_layouts(
        rank, world_size, root=root, layouts=layouts,
        hf_of=lambda lay: pick(lay, _hf_of, dsa._hf_of)(lay),
        extra=lambda r, lay, *a: pick(lay, _facts, dsa.control_facts)(r, lay, *a),
        build=lambda hf, par, lay: pick(lay, _build, dsa._build)(hf, par, lay),
    )


@pytest.fixture(scope="module")
def four_ranks():
    root = tempfile.mkdtemp()
    return root, run_world(_world4, 4, root=root, layouts=FOUR_RANKS, timeout=1200)


@pytest.mark.parametrize("lay", FOUR_RANKS, ids=lambda lay: lay["name"])
def test_four_ranks_tp2_ep2(four_ranks, lay):
    """TP2 x EP2 on 4 gloo ranks: names, shapes, dtypes == ``save_pretrained``, every tensor ==
    megatron's ``dist_checkpointing`` cut by the family's documented layout; the other ranks' shards
    really arrive. DSA: the export with the other transformers pairing (negative control) differs
    from that checkpoint exactly in the four permuted indexer tensors of every layer."""
    import test_dsa as dsa
    from moe_megatron import load_full_checkpoint

    root, res = four_ranks
    r0 = dsa._check(res, root, lay) if _is_dsa(lay) else _check(res, root, lay)
    assert r0["stats"]["bytes_received"] > 0
    if _is_dsa(lay):
        hf = dsa._hf_of(lay)
        want = dsa._expected(load_full_checkpoint(f"{root}/{lay['name']}"), hf)
        got = r0["control"]
        assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in want.items()}
        differ = sorted(n for n, t in want.items() if not torch.equal(got[n], t.to(got[n].dtype)))
        assert differ == sorted(f"model.layers.{i}.self_attn.indexer.{x}" for i in range(hf.num_hidden_layers)
                                for x in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias")), differ


@pytest.mark.parametrize("preset,extra,nproc", [
    ("tiny-qwen3-next", ("--tp", "2", "--ep", "2"), 4),
    ("tiny-qwen3.5", ("--tp", "2"), 2),
    ("tiny-qwen3.5-moe", ("--tp", "2"), 2),
    ("tiny-qwen3.5-moe", ("--ep", "2"), 2),
])
def test_check_cli_megatron(preset, extra, nproc):
    """``weightsync check --model PRESET --layout megatron --tp 2 [--ep 2]``: exit 0, PASS, every name
    and shape of transformers' ``save_pretrained``."""
    tp = extra[extra.index("--tp") + 1] if "--tp" in extra else "1"
    ep = extra[extra.index("--ep") + 1] if "--ep" in extra else "1"
    check_cli(preset, "--layout", "megatron", *extra, nproc=nproc,
              layout_line=f"layout megatron tp{tp} pp1 vpp1 ep{ep} x{nproc}")


# ---- the forward oracle: Megatron's logits vs transformers' on the export (CPU, TP1) ---------------

TOL = 2e-4  # fp32 logits, relative to the largest logit (the other families' tolerance)


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (its torch fallback for flash-linear-attention's), for megatron's
    gated delta net on a host without fla: ``x / sqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _swap_rows(t: torch.Tensor, a: slice, b: slice) -> torch.Tensor:
    t = t.clone()
    t[a], t[b] = t[b].clone(), t[a].clone()
    return t


def _controls(hf, exported: dict) -> dict[str, dict]:
    """Shape-preserving mistakes, each of which the oracle must see."""
    nk, dk, nv, dv = hf.linear_num_key_heads, hf.linear_key_head_dim, hf.linear_num_value_heads, hf.linear_value_head_dim
    d = hf.head_dim
    lin = [i for i, k in enumerate(hf.layer_types) if k == "linear_attention"][0]
    full = [i for i, k in enumerate(hf.layer_types) if k == "full_attention"][0]
    la, sa = f"model.layers.{lin}.linear_attn.", f"model.layers.{full}.self_attn."
    out = {}
    if hf.model_type == "qwen3_next":  # two key-head groups of in_proj_qkvz swapped
        g = 2 * dk + 2 * (nv // nk) * dv
        out["key_groups"] = {la + "in_proj_qkvz.weight": _swap_rows(exported[la + "in_proj_qkvz.weight"], slice(0, g), slice(g, 2 * g))}
    else:  # z and the v part of qkv swapped (both value-width)
        qkv, z = exported[la + "in_proj_qkv.weight"], exported[la + "in_proj_z.weight"]
        out["z_qkv"] = {la + "in_proj_qkv.weight": torch.cat([qkv[: 2 * nk * dk], z]), la + "in_proj_z.weight": qkv[2 * nk * dk :]}
    out["out_norm_offset"] = {la + "norm.weight": exported[la + "norm.weight"] - 1.0}  # no +1
    q = exported[sa + "q_proj.weight"].view(hf.num_attention_heads, 2, d, -1)
    out["gate_interleave"] = {sa + "q_proj.weight": q.flip(1).reshape(exported[sa + "q_proj.weight"].shape)}
    return out


def _forward_world(rank, world_size, *, presets, device="cpu"):
    import sys

    sys.path.insert(0, os.path.join(HERE, "gpu"))
    import mla_models as mm
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron_side import allow_cpu_forward, megatron_logits

    from fsdp_worlds import pack
    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.sources import MegatronSource

    allow_cpu_forward()
    if device != "cpu":  # fp32 on both sides (no TF32); megatron's attention forks the CUDA RNG tracker
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    gdn = sys.modules[GatedDeltaNet.reset_parameters.__module__]  # 0.16: the layer's module; 0.19: common.py
    if not getattr(gdn, "HAVE_FLA", False):
        gdn.l2norm = _l2norm
    facts = {}
    for preset in presets:
        hf = hf_config(preset)
        # deterministic_mode: megatron's torch chunked delta rule instead of fla's Triton kernel;
        # init std 0.1 (megatron's default is 0.02): sharper attention and routing, so mistakes show
        (model,) = mm.build_megatron(hf, MegatronParallel(), seed=5,
                                     overrides={"init_method_std": 0.1, "deterministic_mode": True})
        model.eval()
        if device != "cpu":
            model_parallel_cuda_manual_seed(0)
            model.to(device)
        ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3)).to(device)
        exported = {n: t.detach().cpu().clone() for n, t in MegatronSource(model, hf_config=hf).iter_full()}
        with torch.no_grad():
            ref = megatron_logits(model, ids, hf.vocab_size)
        f = {"shape": tuple(ref.shape), "scale": ref.abs().max().item(), "device": str(ref.device)}
        f["diff"] = (mm.hf_logits(hf, exported, ids, device=device) - ref).abs().max().item()
        for name, change in _controls(hf, exported).items():
            f[name] = (mm.hf_logits(hf, {**exported, **change}, ids, device=device) - ref).abs().max().item()
        facts[preset] = f
    return pack(facts)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_forward_logits_megatron_vs_transformers_from_export(device):
    """megatron-core's own forward (TP1; its torch delta rule, ``deterministic_mode``: no
    flash-linear-attention needed) and transformers' Qwen3-Next / Qwen3.5 loaded from the export
    compute the same fp32 logits, on the CPU and (where there is one) on a CUDA GPU with TF32 off;
    swapping two key-head groups (Qwen3-Next) or z with v (Qwen3.5), dropping the output norm's +1,
    or un-interleaving q and gate moves them far beyond the tolerance."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    presets = ["tiny-qwen3-next", "tiny-qwen3.5"]
    if device == "cpu":
        res = run_world(_forward_world, 1, presets=presets, timeout=600)[0]
    else:  # a fresh interpreter: a forked rank cannot use CUDA once the parent touched it
        import json
        import subprocess
        import sys

        code = (
            "import os, json, torch.distributed as dist; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29577'); "
            "dist.init_process_group('gloo', rank=0, world_size=1); import test_qwen3_next as t; "
            "from fsdp_worlds import unpack; "
            f"print('RESULT ' + json.dumps(unpack({{0: t._forward_world(0, 1, presets={presets!r}, device='cuda')}})[0]))"
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=600)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        assert out.returncode == 0 and line, out.stderr[-3000:]
        res = json.loads(line[-1][len("RESULT "):])
    for preset in presets:
        f = res[preset]
        assert f["device"].startswith(device), f
        assert f["diff"] <= TOL * f["scale"], (preset, f)
        ctrls = [k for k in f if k not in ("shape", "scale", "diff", "device")]
        assert len(ctrls) == 3, f
        for c in ctrls:
            assert f[c] > 100 * TOL * f["scale"], (preset, c, f)
