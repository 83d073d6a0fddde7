"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``, ``sources/families/glm4_moe.py``) on CPU gloo ranks,
against oracles nobody here wrote:

* transformers' ``save_pretrained`` of the same weights: ``FSDPSource`` (FSDP2, 2 ranks) sends its
  names, shapes and bytes -- fp32 wire, and bf16 wire where the router weight and
  ``e_score_correction_bias`` keep their fp32 bytes (vLLM's sender-side ``_checked_iter`` accepts
  the stream, rank 1 is a real non-sender engine); the fused layout is transformers' in-memory
  ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first, what vLLM's GLM-4.5 loader chunks in two) and
  ``down_proj`` ``[E, H, I]``, under the names vLLM's routed-expert mapping claims;
* megatron-core's own ``dist_checkpointing`` (full tensors torch's DCP reader assembles from
  megatron's shard metadata): ``MegatronSource`` at TP2, PP2 and EP2 (bf16 wire) on 2 ranks and
  TP2 x EP2 on 4 ranks exports exactly them under ``save_pretrained``'s names, shapes and dtypes --
  q/k/v weights and biases through megatron's per-group fused rows, the dense first layer, shared
  experts, routed experts, the router and its expert bias;
* transformers' ``from_pretrained`` and forward: the FSDP export loads strictly and computes the
  trainer's logits bit for bit; a TP1 Megatron model built by the one builder (``rotary_percent``
  from ``partial_rotary_factor``) computes, with megatron's own forward, the logits of transformers'
  Glm4Moe loaded from its export, and three shape-preserving mistakes (full rotary on the HF side,
  the rotated and passed halves of each k head swapped, the score-correction bias dropped) move
  them far beyond the tolerance;
* hf_configs that disagree with the Megatron model (no q/k norm, no q/k/v bias, other expert
  counts, no shared expert) raise at construction on every rank, naming what differs; so do
  Megatron models without the expert bias or the shared expert.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import tempfile

import pytest
import torch
from family_worlds import check_bf16_wire, check_cli, check_demo, check_fp32_wire, check_layout, check_nccl
from family_worlds import check_refusals, ck_any, expected_dense_mlp, expected_ends, from_pretrained, logits
from family_worlds import preset_config, same_bytes
from family_worlds import write_checkpoint
from fsdp_worlds import unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = "tiny-glm4-moe"
SEED = 3
TOL = 2e-4  # fp32 logits, Megatron vs transformers, relative to the largest logit
#: Kept fp32 on a bf16 wire (vLLM keeps the GLM-4.5 router and its score-correction bias in fp32).
KEPT_FP32 = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def hf_config(**over):
    """The ``tiny-glm4-moe`` preset's ``Glm4MoeConfig`` with ``over`` applied."""
    return preset_config(PRESET, "Glm4MoeForCausalLM", **over)


def _model(seed: int = SEED) -> torch.nn.Module:
    """The test family's tiny Glm4Moe (``moe_models``), every parameter and buffer random."""
    from moe_models import tiny_model

    return tiny_model("glm4_moe", seed=seed)


def _moe_layers(cfg) -> list[int]:
    return list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))


def _swap_rotary_halves(w: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """Each head's rows with the rotated channels moved after the passed-through ones."""
    per = w.view(-1, head_dim, *w.shape[1:])
    return torch.cat([per[:, rotary:], per[:, :rotary]], 1).reshape(w.shape)


# ---- FSDP2: FSDPSource against save_pretrained -----------------------------------------------------


def _fsdp_world(rank: int, world_size: int) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh

    from family_worlds import fsdp_passes
    from fsdp_worlds import meta_facts, module_snapshot, pack, shard, snapshot_diff, stream, to_cpu
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(_model(), mesh)
    before = module_snapshot(model)
    f = fsdp_passes(model, rank)
    fused = FSDPSource(model, dtype=torch.bfloat16, expert_layout="fused")
    f["fused_meta"] = meta_facts(fused.metadata)
    pairs = stream(fused)
    f["fused_order"] = [n for n, _ in pairs]
    f["fused"] = to_cpu(pairs)
    f["module_changed"] = snapshot_diff(before, module_snapshot(model))
    return pack(f)


@pytest.fixture(scope="module")
def fsdp():
    return run_world(_fsdp_world, 2, timeout=400)


def test_fsdp_fp32_and_bf16_wire_equal_save_pretrained(fsdp):
    """fp32: every name, shape and byte of save_pretrained (attention biases, q/k norms, the dense
    first layer, per-expert routed experts, shared experts, router and its bias). bf16: transformers'
    own bf16 cast, byte for byte, except the router weight and e_score_correction_bias, which keep
    their fp32 bytes; metadata declares exactly those dtypes; vLLM's sender check accepts it."""
    from moe_models import saved_state_dict

    ref = _model()
    fp32 = saved_state_dict(ref)
    bf16 = saved_state_dict(copy.deepcopy(ref).to(torch.bfloat16))
    layers = _moe_layers(ref.config)
    assert {n.split("self_attn.")[1] for n in fp32 if ".layers.1.self_attn." in n} == {
        f"{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias")} | {"o_proj.weight", "q_norm.weight", "k_norm.weight"}
    assert "model.layers.0.mlp.gate_proj.weight" in fp32  # first_k_dense_replace=1
    assert f"model.layers.{layers[-1]}.mlp.shared_experts.down_proj.weight" in fp32
    assert f"model.layers.{layers[-1]}.mlp.experts.5.up_proj.weight" in fp32
    kept = sorted(n for n in fp32 if KEPT_FP32.search(n))
    assert kept == [f"model.layers.{i}.mlp.gate.{leaf}" for i in layers for leaf in ("e_score_correction_bias", "weight")]
    want_bf16 = {n: (fp32[n] if n in kept else bf16[n]) for n in fp32}
    for rank, f in fsdp.items():
        check_fp32_wire(f, fp32, f"rank {rank}")
        check_bf16_wire(f, want_bf16, f"rank {rank}")
    check_nccl(fsdp, want_bf16)


def test_fsdp_fused_layout_is_what_vllms_glm4_moe_loader_reads(fsdp):
    """Fused experts on a bf16 wire: exactly transformers' in-memory state dict (names and shapes),
    each fused tensor transformers' own parameter cast to bf16; vLLM's routed-expert mapping
    claims ``gate_up_proj`` as shards w1, w3 of every expert and ``down_proj`` as w2, and its
    ``chunk(2, dim=1)`` of gate_up gives save_pretrained's per-expert gate and up."""
    from moe_models import saved_state_dict
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    ref = _model()
    memory = ref.state_dict()
    bf16 = saved_state_dict(copy.deepcopy(ref).to(torch.bfloat16))
    E = ref.config.n_routed_experts
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", E, include_fused=True)
    for rank, f in fsdp.items():
        got = f["fused"]
        assert f["fused_order"] == [m[0] for m in f["fused_meta"]]
        assert {n: tuple(t.shape) for n, t in got.items()} == {n: tuple(t.shape) for n, t in memory.items()}
        for i in _moe_layers(ref.config):
            pre = f"model.layers.{i}.mlp.experts."
            for leaf, shards in (("gate_up_proj", [(0, "w1"), (1, "w3")]), ("down_proj", [(0, "w2")])):
                name = pre + leaf
                assert same_bytes(got[name], memory[name].to(torch.bfloat16)), (rank, name)
                hits = [(e, sid) for _, w, e, sid in mapping if w in name and "." not in w.split("experts.", 1)[1]]
                assert hits == shards, (name, hits)
            gate, up = got[pre + "gate_up_proj"].chunk(2, dim=1)
            assert torch.equal(gate[E - 1], bf16[f"{pre}{E - 1}.gate_proj.weight"])
            assert torch.equal(up[E - 1], bf16[f"{pre}{E - 1}.up_proj.weight"])
        rest = [n for n in got if ".experts." not in n]
        assert [n for n in rest if not same_bytes(got[n], f["bf16"][n])] == []


def test_fsdp_export_loads_with_from_pretrained_to_the_trainers_logits(fsdp, tmp_path):
    """The fp32 export written as a checkpoint loads strictly (transformers' own per-expert -> fused
    conversion) and computes the trainer model's logits bit for bit; the same checkpoint with the
    rotated and passed halves of every k head swapped does not (partial rotary is visible)."""
    ref = _model()
    want = logits(ref)
    exported = fsdp[0]["fp32"]
    write_checkpoint(ref.config, exported, str(tmp_path / "ok"))
    loaded, info = from_pretrained(str(tmp_path / "ok"))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(logits(loaded), want)
    cfg = ref.config
    rotary = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    assert 0 < rotary < cfg.head_dim
    bad = dict(exported)
    for n in [n for n in bad if n.endswith("self_attn.k_proj.weight") or n.endswith("self_attn.k_proj.bias")]:
        bad[n] = _swap_rotary_halves(bad[n], cfg.head_dim, rotary)
    write_checkpoint(cfg, bad, str(tmp_path / "bad"))
    assert not torch.allclose(logits(from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


# ---- Megatron: MegatronSource against dist_checkpointing and save_pretrained ----------------------


def _hf_of(lay: dict) -> object:
    return hf_config(**lay.get("hf", {}))


def _layout_facts(rank, lay, hf, chunks, src) -> dict:
    """GLM's facts of one layout (``family_worlds.megatron_layouts``): the GPTModel's rotary_percent
    and, on the layout that asks, what MegatronSource raises for hf_configs this model cannot be
    exported as."""
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    (model,) = chunks
    f = {"rotary_percent": model.rotary_percent}
    if lay.get("refusals"):
        bad = {
            "n_shared_experts": hf_config(n_shared_experts=0),
            "use_qk_norm": hf_config(use_qk_norm=False),
            "attention_bias": hf_config(attention_bias=False),
            "n_routed_experts": hf_config(n_routed_experts=8),
        }
        f["refusals"] = {k: errors_of(lambda c=c: MegatronSource(model, hf_config=c)) for k, c in bad.items()}
    return f


def _megatron_world(rank, world_size, *, root, layouts):
    """Every layout in one world (``family_worlds.megatron_layouts``) with GLM-4.5's facts."""
    from family_worlds import megatron_layouts

    return megatron_layouts(rank, world_size, root=root, layouts=layouts, hf_of=_hf_of, extra=_layout_facts)


def _expected(ck, hf) -> dict[str, torch.Tensor]:
    """Every HF tensor but q/k/v, cut from megatron's own full checkpoint ``ck`` by the documented
    layout (DESIGN.md section 3): norms, o_proj, q/k norms, the dense MLP's [gate; up] fc1, the MoE
    layers by test_moe_megatron's oracle, the vocabulary rows trimmed to hf's."""
    from test_moe_megatron import _expected_moe

    from weightsync.sources.megatron.moe_names import HFMoENames

    want = _expected_moe(ck, HFMoENames(hf), _moe_layers(hf))
    for i in range(hf.num_hidden_layers):
        pre = f"model.layers.{i}."
        want[pre + "input_layernorm.weight"] = ck_any(
            ck, i, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        want[pre + "post_attention_layernorm.weight"] = ck_any(
            ck, i, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        want[pre + "self_attn.o_proj.weight"] = ck_any(ck, i, "self_attention.linear_proj.weight")
        want[pre + "self_attn.q_norm.weight"] = ck_any(ck, i, "self_attention.q_layernorm.weight")
        want[pre + "self_attn.k_norm.weight"] = ck_any(ck, i, "self_attention.k_layernorm.weight")
        if i < hf.first_k_dense_replace:
            want.update(expected_dense_mlp(ck, i, pre))
    want.update(expected_ends(ck, hf))
    return want


def _check_layout(res, root, lay) -> dict:
    """``family_worlds.check_layout`` with GLM's layout (q/k/v through megatron's fused rows), plus:
    on a bf16 wire the router and its bias are the kept fp32 tensors; the GPTModel's rotary_percent
    is partial_rotary_factor; mode="local" names the MoE layers. Returns rank 0's facts."""
    hf = _hf_of(lay)
    r0 = check_layout(res, root, lay, hf, expected=_expected, kept_fp32=KEPT_FP32, fused_qkv=True)
    if lay.get("dtype") not in (None, torch.float32):
        from test_moe_megatron import _check_same_wire_dtypes_as_fsdp

        name = lay["name"]
        _check_same_wire_dtypes_as_fsdp({r: {"bf16_meta": [(n, d) for n, _, d, _ in res[r][name]["meta"]]} for r in res}, hf)
    assert r0["rotary_percent"] == 0.5  # the builder's GPTModel: partial_rotary_factor
    for r in res:  # MoE layers: mode="local" refused on every rank, naming them
        assert str(_moe_layers(hf)) in res[r][lay["name"]]["local_error"], (r, res[r][lay["name"]]["local_error"])
    return r0


TWO_RANKS = [
    dict(name="tp2", tp=2, refusals=True),
    dict(name="pp2", pp=2, hf=dict(num_hidden_layers=4)),  # stage 0: dense layer 0 + MoE layer 1
    dict(name="ep2_bf16", ep=2, dtype=torch.bfloat16),
    dict(name="no_expert_bias", tp=2, refuse={"moe_router_enable_expert_bias": False}),
    dict(name="no_shared_expert", ep=2, refuse={"moe_shared_expert_intermediate_size": None}),
]


@pytest.fixture(scope="module")
def two_ranks():
    root = tempfile.mkdtemp()
    return root, run_world(_megatron_world, 2, root=root, layouts=TWO_RANKS, timeout=900)


@pytest.mark.parametrize("lay", [lay for lay in TWO_RANKS if "refuse" not in lay], ids=lambda lay: lay["name"])
def test_megatron_two_ranks_equal_save_pretrained_and_dist_checkpointing(two_ranks, lay):
    root, res = two_ranks
    r0 = _check_layout(res, root, lay)
    if lay["name"] == "ep2_bf16":
        assert r0["got"]["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert r0["got"]["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.bfloat16
    if lay["name"] in ("tp2", "ep2_bf16"):  # the other rank's shards / experts really arrive
        assert r0["stats"]["bytes_received"] > 0


def test_megatron_refusals_raise_on_every_rank_naming_the_field(two_ranks):
    _, res = two_ranks
    check_refusals(res, {
        "n_shared_experts": ("UnmappedParameterError", "shared expert size 0 (hf_config) != 32 (Megatron)"),
        "use_qk_norm": ("UnmappedParameterError", "q_layernorm"),
        "attention_bias": ("UnmappedParameterError", "linear_qkv.bias"),
        "n_routed_experts": ("UnmappedParameterError", "E=8"),
    })
    for r in res:
        err = res[r]["no_expert_bias"]["error"]
        assert err and "moe_router_enable_expert_bias=False" in err and f"rank {r}" in err, err
        err = res[r]["no_shared_expert"]["error"]
        assert err and "moe_shared_expert_intermediate_size=None" in err and f"rank {r}" in err, err


def test_megatron_four_ranks_tp2_ep2():
    root = tempfile.mkdtemp()
    lay = dict(name="tp2_ep2", tp=2, ep=2)
    res = run_world(_megatron_world, 4, root=root, layouts=[lay], timeout=900)
    r0 = _check_layout(res, root, lay)
    assert r0["stats"]["bytes_received"] > 0


# ---- the forward oracle: Megatron's logits vs transformers' on the export ------------------------


@torch.no_grad()
def _balance_groups_with_expert_bias(model, hf, ids) -> float:
    """Set the MoE layer's expert bias so that it decides the group of about half the tokens of
    ``ids``: every token's tiny model prefers the same group by its sigmoid scores alone, so a bias
    that no token's choice depends on could be dropped unnoticed. The bias is minus the median
    preference (split over the group's experts) plus noise; returns the share of tokens routed to
    group 0, recomputed with the bias (both groups must be used)."""
    from megatron_side import megatron_logits

    (layer,) = [lay for lay in model.decoder.layers if hasattr(lay.mlp, "router")]
    router = layer.mlp.router
    seen = {}

    def keep_input(module, args, out) -> None:
        seen.setdefault("x", args[0].detach().clone())

    hook = router.register_forward_hook(keep_input)
    try:
        megatron_logits(model, ids, hf.vocab_size)
    finally:
        hook.remove()
    per = hf.n_routed_experts // hf.n_group
    scores = torch.sigmoid(seen["x"].reshape(-1, hf.hidden_size) @ router.weight.t())
    groups = scores.view(-1, hf.n_group, per).sum(-1)
    assert hf.n_group == 2 and hf.num_experts_per_tok == per  # the group's experts are the top k
    lead = (groups[:, 0] - groups[:, 1]).median()
    noise = 0.02 * torch.randn(router.expert_bias.shape, generator=torch.Generator().manual_seed(9))
    router.expert_bias.copy_(torch.cat([torch.full((per,), -lead / (2 * per)), torch.full((per,), lead / (2 * per))]) + noise)
    biased = (scores + router.expert_bias).view(-1, hf.n_group, per).sum(-1)
    return float((biased[:, 0] > biased[:, 1]).float().mean())


def _forward_world(rank, world_size):
    """One rank, TP1: Megatron's own forward vs transformers' Glm4Moe loaded from the export."""
    sys.path.insert(0, os.path.join(HERE, "gpu"))
    import mla_models as mm
    from megatron_side import allow_cpu_forward, megatron_logits

    from fsdp_worlds import pack
    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.sources import MegatronSource

    allow_cpu_forward()
    hf = hf_config()
    # init std 0.1 (megatron's default is 0.02): sharper attention and routing, so mistakes show
    (model,) = mm.build_megatron(hf, MegatronParallel(), seed=5, overrides={"init_method_std": 0.1})
    model.eval()
    ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    f = {"rotary_percent": model.rotary_percent, "group0_share": _balance_groups_with_expert_bias(model, hf, ids)}
    exported = {n: t.clone() for n, t in MegatronSource(model, hf_config=hf).iter_full()}
    ref = megatron_logits(model, ids, hf.vocab_size)
    f.update(shape=tuple(ref.shape), scale=ref.abs().max().item())
    f["diff"] = (mm.hf_logits(hf, exported, ids) - ref).abs().max().item()
    full = hf_config()
    full.rope_parameters["partial_rotary_factor"] = 1.0
    f["full_rotary_ctrl"] = (mm.hf_logits(full, exported, ids) - ref).abs().max().item()
    rotary = int(hf.head_dim * 0.5)
    halves = {n: (_swap_rotary_halves(t, hf.head_dim, rotary) if ".self_attn.k_proj." in n else t)
              for n, t in exported.items()}
    f["k_halves_ctrl"] = (mm.hf_logits(hf, halves, ids) - ref).abs().max().item()
    no_bias = {n: (torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t) for n, t in exported.items()}
    f["bias_ctrl"] = (mm.hf_logits(hf, no_bias, ids) - ref).abs().max().item()
    return pack(f)


def test_forward_logits_megatron_vs_transformers_from_export():
    f = run_world(_forward_world, 1, timeout=600)[0]
    assert f["shape"] == (2, 24, hf_config().vocab_size) and f["rotary_percent"] == 0.5
    assert 0.2 <= f["group0_share"] <= 0.8, f  # the expert bias decides the group of many tokens
    assert f["diff"] <= TOL * f["scale"], f
    # the controls show the check can fail: partial rotary, the head layout and the expert bias matter
    for ctrl in ("full_rotary_ctrl", "k_halves_ctrl", "bias_ctrl"):
        assert f[ctrl] > 100 * TOL * f["scale"], (ctrl, f)


# ---- the CLI ------------------------------------------------------------------------------------


def test_check_cli_megatron_tp2_ep2():
    """``weightsync check --model tiny-glm4-moe --layout megatron --tp 2 --ep 2`` (the CLI's rank code
    on 4 forked ranks; the README's line): exit 0, every name and shape of ``save_pretrained``, rank 0
    sends all."""
    saved, r = check_cli(PRESET, "--layout", "megatron", "--tp", "2", "--ep", "2", nproc=4,
                         layout_line="layout megatron tp2 pp1 vpp1 ep2 x4")
    assert "tensors checked on 4 rank(s)" in r.stdout
    assert any(".mlp.shared_experts." in n for n in saved) and any(n.endswith("e_score_correction_bias") for n in saved)


def test_demo_trains_and_syncs_the_preset():
    """``weightsync demo --model tiny-glm4-moe`` (2 forked ranks): every sync verified bit for bit
    in a transformers receiver (experts under its in-memory fused names)."""
    check_demo(PRESET, "glm4_moe")
