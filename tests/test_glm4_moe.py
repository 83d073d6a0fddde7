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
from fsdp_worlds import unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = "tiny-glm4-moe"
SEED = 3
TOL = 2e-4  # fp32 logits, Megatron vs transformers, relative to the largest logit
IDS = [[3, 17, 42, 5, 60, 1, 33, 8], [9, 9, 27, 50, 2, 44, 13, 61]]
#: Kept fp32 on a bf16 wire (vLLM keeps the GLM-4.5 router and its score-correction bias in fp32).
KEPT_FP32 = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def hf_config(**over):
    """The ``tiny-glm4-moe`` preset's ``Glm4MoeConfig`` with ``over`` applied."""
    from transformers import AutoConfig

    from weightsync.plugins.presets import PRESETS

    kw = {**PRESETS[PRESET], **over}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg.architectures = ["Glm4MoeForCausalLM"]
    return cfg


def _model(seed: int = SEED) -> torch.nn.Module:
    """The test family's tiny Glm4Moe (``moe_models``), every parameter and buffer random."""
    from moe_models import tiny_model

    return tiny_model("glm4_moe", seed=seed)


def _moe_layers(cfg) -> list[int]:
    return list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(input_ids=torch.tensor(IDS)).logits.float()


def _write_checkpoint(config, tensors: dict[str, torch.Tensor], directory: str) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(directory)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


def _from_pretrained(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


def _swap_rotary_halves(w: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """Each head's rows with the rotated channels moved after the passed-through ones."""
    per = w.view(-1, head_dim, *w.shape[1:])
    return torch.cat([per[:, rotary:], per[:, :rotary]], 1).reshape(w.shape)


# ---- FSDP2: FSDPSource against save_pretrained -----------------------------------------------------


def _fsdp_world(rank: int, world_size: int) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_worlds import drive_vllm_nccl, meta_facts, module_snapshot, no_collectives, pack, shard, snapshot_diff
    from fsdp_worlds import stream, to_cpu
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(_model(), mesh)
    before = module_snapshot(model)
    f: dict = {}
    src = FSDPSource(model)
    with no_collectives():
        f["meta"] = meta_facts(src.metadata)
    pairs = stream(src)
    f["order"] = [n for n, _ in pairs]
    f["fp32"] = to_cpu(pairs)
    bf = FSDPSource(model, dtype=torch.bfloat16)
    f["bf16_meta"] = meta_facts(bf.metadata)
    f["bf16"] = to_cpu(stream(bf))
    drive_vllm_nccl(bf, rank, f)
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


def _meta_map(meta) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {m[0]: (m[1], tuple(m[2])) for m in meta}


def _dtype_shape(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


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
        assert sorted(f["fp32"]) == sorted(fp32), rank
        assert [n for n, t in fp32.items() if not _same_bytes(f["fp32"][n], t)] == [], rank
        assert f["order"] == [m[0] for m in f["meta"]], "stream order != metadata order"
        assert _meta_map(f["meta"]) == _dtype_shape(fp32)
        assert all(m[3] in (None, (0, 1)) for m in f["meta"])  # FSDP: both ranks iterate every tensor
        assert sorted(f["bf16"]) == sorted(want_bf16)
        assert [n for n, t in want_bf16.items() if not _same_bytes(f["bf16"][n], t)] == [], rank
        assert _meta_map(f["bf16_meta"]) == _dtype_shape(want_bf16)
        assert f["module_changed"] == [], f["module_changed"][:5]
    sent = fsdp[0]["nccl_sender"]  # passed vLLM's own _checked_iter against metadata
    assert sorted(sent) == sorted(want_bf16) and all(_same_bytes(sent[n], want_bf16[n]) for n in want_bf16)
    assert fsdp[1]["nccl_is_sender"] is False and fsdp[1]["nccl_nonsender_tensors"] == len(want_bf16)


def test_fsdp_fused_layout_is_what_vllms_glm4_moe_loader_reads(fsdp):
    """Fused experts on a bf16 wire: exactly transformers' in-memory state dict (names and shapes),
    each fused tensor transformers' own parameter cast to bf16; vLLM 0.33's routed-expert mapping
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
                assert _same_bytes(got[name], memory[name].to(torch.bfloat16)), (rank, name)
                hits = [(e, sid) for _, w, e, sid in mapping if w in name and "." not in w.split("experts.", 1)[1]]
                assert hits == shards, (name, hits)
            gate, up = got[pre + "gate_up_proj"].chunk(2, dim=1)
            assert torch.equal(gate[E - 1], bf16[f"{pre}{E - 1}.gate_proj.weight"])
            assert torch.equal(up[E - 1], bf16[f"{pre}{E - 1}.up_proj.weight"])
        rest = [n for n in got if ".experts." not in n]
        assert [n for n in rest if not _same_bytes(got[n], f["bf16"][n])] == []


def test_fsdp_export_loads_with_from_pretrained_to_the_trainers_logits(fsdp, tmp_path):
    """The fp32 export written as a checkpoint loads strictly (transformers' own per-expert -> fused
    conversion) and computes the trainer model's logits bit for bit; the same checkpoint with the
    rotated and passed halves of every k head swapped does not (partial rotary is visible)."""
    ref = _model()
    want = _logits(ref)
    exported = fsdp[0]["fp32"]
    _write_checkpoint(ref.config, exported, str(tmp_path / "ok"))
    loaded, info = _from_pretrained(str(tmp_path / "ok"))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(_logits(loaded), want)
    cfg = ref.config
    rotary = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    assert 0 < rotary < cfg.head_dim
    bad = dict(exported)
    for n in [n for n in bad if n.endswith("self_attn.k_proj.weight") or n.endswith("self_attn.k_proj.bias")]:
        bad[n] = _swap_rotary_halves(bad[n], cfg.head_dim, rotary)
    _write_checkpoint(cfg, bad, str(tmp_path / "bad"))
    assert not torch.allclose(_logits(_from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


# ---- Megatron: MegatronSource against dist_checkpointing and save_pretrained ----------------------


def _refusals(model) -> dict[str, str | None]:
    """What MegatronSource raises for hf_configs this Megatron GLM model cannot be exported as."""
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    bad = {
        "n_shared_experts": hf_config(n_shared_experts=0),
        "use_qk_norm": hf_config(use_qk_norm=False),
        "attention_bias": hf_config(attention_bias=False),
        "n_routed_experts": hf_config(n_routed_experts=8),
    }
    return {k: errors_of(lambda c=c: MegatronSource(model, hf_config=c)) for k, c in bad.items()}


def _megatron_world(rank, world_size, *, root, layouts):
    """Each layout: build (the one builder), save with megatron's dist_checkpointing, export."""
    import mla_models as mm
    import torch.distributed as dist
    from megatron_worlds import dcp_save
    from worlds import errors_of

    from fsdp_worlds import pack
    from weightsync.plugins.megatron_build import MegatronParallel
    from weightsync.sources import MegatronSource

    facts: dict = {}
    for lay in layouts:
        name = lay["name"]
        hf = hf_config(**lay.get("hf", {}))
        par = MegatronParallel(tp=lay.get("tp", 1), pp=lay.get("pp", 1), ep=lay.get("ep", 1))
        if lay.get("refuse"):  # a Megatron variant the GLM-4.5 checkpoint cannot express
            chunks = mm.build_megatron(hf, par, overrides=lay["refuse"])
            facts[name] = {"error": errors_of(lambda: MegatronSource(chunks[0], hf_config=hf))}
            continue
        (model,) = mm.build_megatron(hf, par)
        os.makedirs(f"{root}/{name}", exist_ok=True)
        dcp_save(model, f"{root}/{name}")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        src = MegatronSource(model, hf_config=hf, dtype=lay.get("dtype"))
        f: dict = {"meta": [(m.name, tuple(m.shape), str(m.dtype), m.owners) for m in src.metadata]}
        f["rotary_percent"] = model.rotary_percent
        got = {n: t.clone() for n, t in src.iter_full()}
        f["stats"] = src.last_pass.as_dict()
        f["again"] = all(torch.equal(got[n], t) for n, t in src.iter_full())
        f["local_error"] = errors_of(lambda: MegatronSource(model, hf_config=hf, mode="local"))
        if lay.get("refusals"):
            f["refusals"] = _refusals(model)
        f["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        if rank == 0:
            f["got"] = got
        else:
            f["yielded"] = len(got)
        facts[name] = f
        dist.barrier()
    return pack(facts)


def _saved(hf, dtype=torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes transformers' save_pretrained writes for ``hf`` in ``dtype`` (an fp32
    model loaded back with ``from_pretrained(dtype=...)``, which keeps e_score_correction_bias fp32)."""
    from moe_models import saved_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf)
    if dtype != torch.float32:
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    return {n: (tuple(t.shape), t.dtype) for n, t in saved_state_dict(model).items()}


def _ck_any(ck, layer: int, *suffixes: str) -> torch.Tensor:
    """One layer's tensor from megatron's full checkpoint under the first key it uses (local-spec
    norms are saved under Transformer-Engine-compatible keys in some layers)."""
    from test_moe_megatron import _ck

    for s in suffixes:
        if f"decoder.layers.{layer}.{s}" in ck or f"decoder.layers.{s}" in ck:
            return _ck(ck, s, layer)
    raise KeyError(f"layer {layer}: none of {suffixes} in megatron's checkpoint")


def _expected(ck, hf) -> dict[str, torch.Tensor]:
    """Every HF tensor but q/k/v, cut from megatron's own full checkpoint ``ck`` by the documented
    layout (DESIGN.md section 3): norms, o_proj, q/k norms, the dense MLP's [gate; up] fc1, the MoE
    layers by test_moe_megatron's oracle, the vocabulary rows trimmed to hf's."""
    from test_moe_megatron import _expected_moe

    from weightsync.sources.moe_names import HFMoENames

    want = _expected_moe(ck, HFMoENames(hf), _moe_layers(hf))
    for i in range(hf.num_hidden_layers):
        pre = f"model.layers.{i}."
        want[pre + "input_layernorm.weight"] = _ck_any(
            ck, i, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        want[pre + "post_attention_layernorm.weight"] = _ck_any(
            ck, i, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        want[pre + "self_attn.o_proj.weight"] = _ck_any(ck, i, "self_attention.linear_proj.weight")
        want[pre + "self_attn.q_norm.weight"] = _ck_any(ck, i, "self_attention.q_layernorm.weight")
        want[pre + "self_attn.k_norm.weight"] = _ck_any(ck, i, "self_attention.k_layernorm.weight")
        if i < hf.first_k_dense_replace:
            fc1 = _ck_any(ck, i, "mlp.linear_fc1.weight")
            want[pre + "mlp.gate_proj.weight"], want[pre + "mlp.up_proj.weight"] = fc1.chunk(2, 0)
            want[pre + "mlp.down_proj.weight"] = _ck_any(ck, i, "mlp.linear_fc2.weight")
    want["model.embed_tokens.weight"] = ck["embedding.word_embeddings.weight"][: hf.vocab_size]
    want["model.norm.weight"] = ck["decoder.final_layernorm.weight"]
    want["lm_head.weight"] = ck["output_layer.weight"][: hf.vocab_size]
    return want


def _check_layout(res, root, lay) -> dict:
    """Every check on one layout's results; returns rank 0's facts."""
    import megatron_worlds as mw
    from moe_megatron import load_full_checkpoint

    name = lay["name"]
    r0 = res[0][name]
    hf = hf_config(**lay.get("hf", {}))
    dtype = lay.get("dtype") or torch.float32
    assert all(res[r][name]["meta"] == r0["meta"] for r in res)
    assert all(o == (0,) for *_, o in r0["meta"])
    saved = _saved(hf, dtype)
    if dtype != torch.float32:  # the router keeps the model's fp32 on the wire (save_pretrained rounds it)
        saved = {n: (s, torch.float32 if KEPT_FP32.search(n) else d) for n, (s, d) in saved.items()}
        from test_moe_megatron import _check_same_wire_dtypes_as_fsdp

        _check_same_wire_dtypes_as_fsdp({r: {"bf16_meta": [(n, d) for n, _, d, _ in res[r][name]["meta"]]} for r in res}, hf)
    assert {n: (s, d) for n, s, d, _ in r0["meta"]} == {n: (s, str(d)) for n, (s, d) in saved.items()}
    got = r0["got"]
    assert list(got) == [n for n, *_ in r0["meta"]]
    assert {n: (tuple(t.shape), t.dtype) for n, t in got.items()} == saved
    assert r0["rotary_percent"] == 0.5  # the builder's GPTModel: partial_rotary_factor
    ck = load_full_checkpoint(f"{root}/{name}")
    want = _expected(ck, hf)
    qkv = {n for n in got if re.search(r"self_attn\.[qkv]_proj\.", n)}
    assert sorted(want) == sorted(set(got) - qkv)
    assert [n for n, t in want.items() if not torch.equal(got[n], t.to(got[n].dtype))] == []
    for i in range(hf.num_hidden_layers):  # q/k/v (weights and biases): megatron's per-group rows
        for leaf in ("weight", "bias"):
            q, k, v = (got[f"model.layers.{i}.self_attn.{x}_proj.{leaf}"] for x in "qkv")
            full = _ck_any(ck, i, f"self_attention.linear_qkv.{leaf}")
            assert torch.equal(mw._fused_qkv_rows(hf, q, k, v), full.to(q.dtype)), (name, i, leaf)
    for r, f in res.items():
        f = f[name]
        assert f["unchanged"], f"rank {r} mutated its model"
        assert f["again"], f"rank {r}: a second pass differs"
        err = f["local_error"]  # MoE layers: mode="local" refused on every rank, naming them
        assert err.startswith("NotImplementedError") and f"rank {r}" in err and str(_moe_layers(hf)) in err
        if r:
            assert f["yielded"] == 0 and f["stats"]["tensors"] == 0, f"rank {r} yielded tensors"
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
    words = {
        "n_shared_experts": ("UnmappedParameterError", "shared expert size 0 (hf_config) != 32 (Megatron)"),
        "use_qk_norm": ("UnmappedParameterError", "q_layernorm"),
        "attention_bias": ("UnmappedParameterError", "linear_qkv.bias"),
        "n_routed_experts": ("UnmappedParameterError", "E=8"),
    }
    for r in res:
        got = res[r]["tp2"]["refusals"]
        for field, (kind, word) in words.items():
            err = got[field]
            assert err is not None, f"rank {r}: {field} was not refused"
            assert err.startswith(kind) and word in err and f"rank {r}" in err, (r, field, err)
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
    from weightsync.plugins.megatron_build import MegatronParallel
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
    on 4 forked ranks): exit 0, every name and shape of ``save_pretrained``, rank 0 sends all."""
    from test_demo_cli import _listed, _saved
    from worlds import run_cli

    from weightsync.plugins.presets import build_model, load_config

    saved = _saved(build_model(load_config(PRESET)))
    r = run_cli("check", "--model", PRESET, "--layout", "megatron", "--tp", "2", "--ep", "2", "--show", "1000",
                nproc=4, timeout=600)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS") and "layout megatron tp2 pp1 vpp1 ep2 x4" in out
    assert _listed(out) == {n: s for n, (_, s) in saved.items()}
    assert "tensors checked on 4 rank(s)" in out and "Traceback" not in r.stderr
    assert any(".mlp.shared_experts." in n for n in saved) and any(n.endswith("e_score_correction_bias") for n in saved)


def test_demo_trains_and_syncs_the_preset():
    """``weightsync demo --model tiny-glm4-moe`` (2 forked ranks): every sync verified bit for bit
    in a transformers receiver (experts under its in-memory fused names)."""
    from worlds import run_cli

    r = run_cli("demo", "--model", PRESET, "--steps", "2", nproc=2, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert re.search(r"weightsync demo: 2/2 syncs verified, .* \(2 ranks, glm4_moe, .*-> PASS", r.stdout), r.stdout
    assert "before any sync: receiver logits equal trainer's: False" in r.stdout
