"""GPT-OSS (``GptOssForCausalLM``, ``sources/families/gpt_oss.py``) on CPU gloo ranks, against
oracles nobody here wrote:

* transformers' ``save_pretrained`` of the same weights, which keeps the experts fused as they are in
  memory (``gate_up_proj`` ``[E, H, 2I]`` with gate/up columns interleaved, ``gate_up_proj_bias``,
  ``down_proj`` ``[E, I, H]``, ``down_proj_bias``): ``FSDPSource`` (FSDP2, 2 ranks) sends its names,
  shapes and bytes by default -- fp32 wire, and bf16 wire where the router weight and bias keep
  their fp32 bytes (vLLM's sender-side ``_checked_iter`` accepts it; rank 1 is a real non-sender);
* vLLM's gpt_oss loader for the per-expert layout: its own ``hf_to_vllm_mapper`` and
  ``_get_streamed_expert_info`` parse every ``mlp.experts.{e}.*`` name into (expert ``e``, that
  fused parameter, its shard), and each tensor is save_pretrained's fused tensor's slice ``[e]``;
* megatron-core's own ``dist_checkpointing`` (full tensors torch's DCP reader assembles):
  ``MegatronSource`` at TP2 (sinks and q/k/v split by head), PP2 and EP2 (bf16 wire, both expert
  layouts) on 2 ranks and TP2 x EP2 on 4 (expert TP 1: megatron-core allows biased experts there
  only) exports exactly them under ``save_pretrained``'s names, shapes and dtypes -- q/k/v weights
  and biases through megatron's per-group fused rows, ``linear_fc1``'s ``[gate; up]`` rows
  interleaved and transposed into ``gate_up_proj``, ``softmax_offset`` as ``sinks``;
* transformers' ``from_pretrained`` and forward: the FSDP export loads strictly and computes the
  trainer's logits bit for bit; a TP1 Megatron model built by the one builder (learnable softmax
  offset, alternating sliding windows, clamped SwiGLU with ``glu_linear_offset``, YaRN, biases)
  computes, with megatron's own forward, the logits of transformers' GptOss loaded from its export,
  and four mistakes (gate/up not interleaved, sinks dropped, every layer full attention, rope
  without YaRN) move them far beyond the tolerance;
* ``attention_bias=False`` is refused at construction on every rank, naming the field; so are a
  Megatron model without sinks (``softmax_type="vanilla"``) and hf_configs it disagrees with.
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
from family_worlds import check_refusals, ck_any, expected_ends, from_pretrained, logits, preset_config, same_bytes
from family_worlds import write_checkpoint
from fsdp_worlds import unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = "tiny-gpt-oss"
SEED = 3
TOL = 2e-4  # fp32 logits, Megatron vs transformers, relative to the largest logit
#: Kept fp32 on a bf16 wire: the router (vLLM keeps it in fp32, the wire policy's allow-list).
KEPT_FP32 = re.compile(r"\.mlp\.router\.(weight|bias)$")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def hf_config(**over):
    """The ``tiny-gpt-oss`` preset's ``GptOssConfig`` with ``over`` applied."""
    return preset_config(PRESET, "GptOssForCausalLM", **over)


def _model(seed: int = SEED) -> torch.nn.Module:
    """The test family's tiny GptOss (``moe_models``), every parameter random (sinks, biases too)."""
    from moe_models import tiny_model

    return tiny_model("gpt_oss", seed=seed)


def _check_vllm_streamed_experts(per_expert: dict[str, torch.Tensor], fused: dict[str, torch.Tensor]) -> int:
    """Every ``mlp.experts.{e}.*`` tensor as vLLM's gpt_oss loader reads it: its mapper and
    ``_get_streamed_expert_info`` give (expert ``e``, the layer's fused parameter, shard), and the
    tensor is ``fused[...][e]``. Returns how many were checked."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, GptOssModel

    mapper = GptOssForCausalLM.hf_to_vllm_mapper
    names = [n for n in per_expert if ".mlp.experts." in n]
    fused_params = {}
    for n in names:
        layer = n.split(".mlp.experts.")[0]
        for p in ("w13_weight", "w13_bias", "w2_weight", "w2_bias"):
            fused_params[f"{layer}.mlp.experts.routed_experts.{p}"] = None
    shard = {"gate_up_proj": "gpt_oss_w13", "gate_up_proj_bias": "gpt_oss_w13", "down_proj": "gpt_oss_w2",
             "down_proj_bias": "gpt_oss_w2"}
    for name, mapped in zip(names, mapper.apply_list(names)):
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)", name)
        assert m, name
        info = GptOssModel._get_streamed_expert_info(mapped, fused_params)
        assert info is not None and info[0] == int(m[2]) and info[2] == shard[m[3]], (name, mapped, info)
        assert same_bytes(per_expert[name], fused[f"{m[1]}.{m[3]}"][int(m[2])]), name
    return len(names)


def test_fused_checkpoint_layout_is_read_off_the_experts_module():
    """The expert layout comes from transformers: its reversal keeps GPT-OSS's fused tensors (so the
    checkpoint holds them fused) and the experts module declares transposed, interleaved, biased;
    a declaration the shapes contradict raises naming the module instead of guessing."""
    from weightsync.sources.core.ground.errors import UnmappedParameterError
    from weightsync.sources.core.hf.experts import ExpertTransform

    model = _model()
    tr = ExpertTransform.for_module(model)
    spec = tr.specs["model.layers.1.mlp.experts"]
    assert (spec.saved, spec.transposed, spec.interleaved, spec.bias, tr.layout) == ("fused", True, True, True, "fused")
    assert (spec.num_experts, spec.hidden, spec.intermediate) == (6, 16, 12)
    assert tr.handles("model.layers.1.mlp.experts.down_proj_bias") and not tr.handles("model.layers.1.mlp.router.bias")
    model.model.layers[0].mlp.experts.is_transposed = False
    with pytest.raises(UnmappedParameterError, match=r"model\.layers\.0\.mlp\.experts: transformers saves these experts fused"):
        ExpertTransform.for_module(model)


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
    f["fused_meta"] = meta_facts(FSDPSource(model, expert_layout="fused").metadata)
    per = FSDPSource(model, expert_layout="per_expert")
    f["per_expert_meta"] = meta_facts(per.metadata)
    pairs = stream(per)
    f["per_expert_order"] = [n for n, _ in pairs]
    f["per_expert"] = to_cpu(pairs)
    f["module_changed"] = snapshot_diff(before, module_snapshot(model))
    return pack(f)


@pytest.fixture(scope="module")
def fsdp():
    return run_world(_fsdp_world, 2, timeout=400)


def test_fsdp_default_and_bf16_wire_equal_save_pretrained(fsdp):
    """The default layout is the checkpoint's (fused, as saved): every name, shape and byte of
    save_pretrained -- sinks, q/k/v/o biases, the biased router, the fused transposed interleaved
    experts and their biases. bf16: transformers' own bf16 cast byte for byte except the router
    weight and bias, which keep their fp32 bytes; vLLM's sender check accepts it."""
    from moe_models import saved_state_dict

    ref = _model()
    fp32 = saved_state_dict(ref)
    bf16 = saved_state_dict(copy.deepcopy(ref).to(torch.bfloat16))
    E, H, I = ref.config.num_local_experts, ref.config.hidden_size, ref.config.intermediate_size
    assert {n: tuple(t.shape) for n, t in fp32.items() if ".layers.0.mlp.experts." in n} == {
        "model.layers.0.mlp.experts.gate_up_proj": (E, H, 2 * I), "model.layers.0.mlp.experts.gate_up_proj_bias": (E, 2 * I),
        "model.layers.0.mlp.experts.down_proj": (E, I, H), "model.layers.0.mlp.experts.down_proj_bias": (E, H),
    }
    assert "model.layers.1.self_attn.sinks" in fp32 and "model.layers.1.self_attn.o_proj.bias" in fp32
    kept = sorted(n for n in fp32 if KEPT_FP32.search(n))
    assert kept == [f"model.layers.{i}.mlp.router.{w}" for i in range(ref.config.num_hidden_layers) for w in ("bias", "weight")]
    want_bf16 = {n: (fp32[n] if n in kept else bf16[n]) for n in fp32}
    for rank, f in fsdp.items():
        assert f["layout"] == "fused"
        check_fp32_wire(f, fp32, f"rank {rank}")
        assert f["fused_meta"] == f["meta"]  # expert_layout="fused" is the checkpoint's layout here
        check_bf16_wire(f, want_bf16, f"rank {rank}")
    check_nccl(fsdp, want_bf16)


def test_fsdp_per_expert_is_what_vllms_gpt_oss_loader_streams(fsdp):
    """``expert_layout="per_expert"``: each fused expert tensor's slice per expert, named as vLLM's
    gpt_oss loader streams them (its mapper + ``_get_streamed_expert_info``), every other tensor
    save_pretrained's; metadata order is stream order."""
    from moe_models import saved_state_dict

    ref = _model()
    saved = saved_state_dict(ref)
    E, L = ref.config.num_local_experts, ref.config.num_hidden_layers
    for rank, f in fsdp.items():
        got = f["per_expert"]
        assert f["per_expert_order"] == [m[0] for m in f["per_expert_meta"]]
        assert _check_vllm_streamed_experts(got, saved) == 4 * E * L
        rest = [n for n in got if ".mlp.experts." not in n]
        assert sorted(rest) == sorted(n for n in saved if ".mlp.experts." not in n)
        assert [n for n in rest if not same_bytes(got[n], saved[n])] == []


def test_fsdp_export_loads_with_from_pretrained_to_the_trainers_logits(fsdp, tmp_path):
    """The default export written as a checkpoint loads strictly and computes the trainer model's
    logits bit for bit; the same checkpoint with gate/up de-interleaved ([gate; up] columns, the
    other frameworks' layout) does not."""
    ref = _model()
    want = logits(ref)
    exported = fsdp[0]["fp32"]
    write_checkpoint(ref.config, exported, str(tmp_path / "ok"))
    loaded, info = from_pretrained(str(tmp_path / "ok"))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(logits(loaded), want)
    bad = {n: (_concat_gate_up(t) if n.endswith(("gate_up_proj", "gate_up_proj_bias")) else t)
           for n, t in exported.items()}
    write_checkpoint(ref.config, bad, str(tmp_path / "bad"))
    assert not torch.allclose(logits(from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


def _concat_gate_up(t: torch.Tensor) -> torch.Tensor:
    """A fused gate/up tensor (last dim interleaved) with its last dim as [all gate; all up]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], -1)


# ---- Megatron: MegatronSource against dist_checkpointing and save_pretrained ----------------------


def _hf_of(lay: dict) -> object:
    return hf_config(**lay.get("hf", {}))


def _layout_facts(rank, lay, hf, chunks, src) -> dict:
    """GPT-OSS's facts of one layout (``family_worlds.megatron_layouts``): the expert TP size the
    builder chose; with ``per_expert``, a second export in vLLM's per-expert layout (one expert per
    batch); with ``refusals``, what MegatronSource raises for hf_configs this model cannot be
    exported as."""
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    (model,) = chunks
    f: dict = {"etp": model.config.expert_tensor_parallel_size}
    if lay.get("per_expert"):
        per = MegatronSource(model, hf_config=hf, dtype=lay.get("dtype"), expert_layout="per_expert",
                             expert_batch_bytes=1)
        f["per_expert_meta"] = [m.name for m in per.metadata]
        per_got = {n: t.clone() for n, t in per.iter_full()}
        if rank == 0:
            f["per_expert"] = per_got
    if lay.get("refusals"):
        bad = {
            "attention_bias": hf_config(attention_bias=False),
            "num_local_experts": hf_config(num_local_experts=8),
            "head_dim": hf_config(head_dim=8),
        }
        f["refusals"] = {k: errors_of(lambda c=c: MegatronSource(model, hf_config=c)) for k, c in bad.items()}
    return f


def _megatron_world(rank, world_size, *, root, layouts):
    """Every layout in one world (``family_worlds.megatron_layouts``) with GPT-OSS's facts."""
    from family_worlds import megatron_layouts

    return megatron_layouts(rank, world_size, root=root, layouts=layouts, hf_of=_hf_of, extra=_layout_facts)


def _interleave_rows(fc1: torch.Tensor) -> torch.Tensor:
    """Megatron's ``linear_fc1`` rows ``[gate; up]`` (dim -2 for weights, -1 for biases given as
    ``[..., 2I, 1]``) as transformers' alternating ``gate_0, up_0, gate_1, ...``."""
    gate, up = fc1.chunk(2, dim=-2)
    return torch.stack([gate, up], dim=-2).flatten(-3, -2)


def _expected(ck, hf) -> dict[str, torch.Tensor]:
    """Every HF tensor but q/k/v, cut from megatron's own full checkpoint ``ck`` by the documented
    layout: norms, o_proj weight and bias, sinks (``softmax_offset``), the router and its bias, and the
    experts -- fc1 rows ``[gate; up]`` interleaved then transposed into ``gate_up_proj [E, H, 2I]``
    (its bias interleaved alike), fc2 transposed into ``down_proj [E, I, H]``."""
    want: dict[str, torch.Tensor] = {}
    for i in range(hf.num_hidden_layers):
        pre = f"model.layers.{i}."
        want[pre + "input_layernorm.weight"] = ck_any(
            ck, i, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        want[pre + "post_attention_layernorm.weight"] = ck_any(
            ck, i, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        want[pre + "self_attn.o_proj.weight"] = ck_any(ck, i, "self_attention.linear_proj.weight")
        want[pre + "self_attn.o_proj.bias"] = ck_any(ck, i, "self_attention.linear_proj.bias")
        want[pre + "self_attn.sinks"] = ck_any(ck, i, "self_attention.core_attention.softmax_offset")
        want[pre + "mlp.router.weight"] = ck_any(ck, i, "mlp.router.weight")
        want[pre + "mlp.router.bias"] = ck_any(ck, i, "mlp.router.bias")
        fc1 = ck_any(ck, i, "mlp.experts.experts.linear_fc1.weight")  # [E, 2I, H]
        fc1b = ck_any(ck, i, "mlp.experts.experts.linear_fc1.bias")  # [E, 2I]
        fc2 = ck_any(ck, i, "mlp.experts.experts.linear_fc2.weight")  # [E, H, I]
        want[pre + "mlp.experts.gate_up_proj"] = _interleave_rows(fc1).transpose(1, 2)
        want[pre + "mlp.experts.gate_up_proj_bias"] = _interleave_rows(fc1b.unsqueeze(-1)).squeeze(-1)
        want[pre + "mlp.experts.down_proj"] = fc2.transpose(1, 2)
        want[pre + "mlp.experts.down_proj_bias"] = ck_any(ck, i, "mlp.experts.experts.linear_fc2.bias")
    want.update(expected_ends(ck, hf))
    return want


def _check_layout(res, root, lay) -> dict:
    """``family_worlds.check_layout`` with GPT-OSS's layout (q/k/v through megatron's fused rows),
    plus: the experts at expert TP 1; the per-expert export is what vLLM's gpt_oss loader streams,
    slice by slice of the default one. Returns rank 0's facts."""
    hf = _hf_of(lay)
    r0 = check_layout(res, root, lay, hf, expected=_expected, kept_fp32=KEPT_FP32, fused_qkv=True)
    assert r0["etp"] == 1  # the builder: megatron-core's MoE biases need expert TP 1
    if lay.get("per_expert"):
        got, per = r0["got"], r0["per_expert"]
        assert list(per) == r0["per_expert_meta"]
        assert _check_vllm_streamed_experts(per, got) == 4 * hf.num_local_experts * hf.num_hidden_layers
        assert all(torch.equal(per[n], got[n]) for n in per if ".mlp.experts." not in n)
    return r0


TWO_RANKS = [
    dict(name="tp2", tp=2, refusals=True),
    dict(name="pp2", pp=2, hf=dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)),
    dict(name="ep2_bf16", ep=2, dtype=torch.bfloat16, per_expert=True),
    dict(name="no_sinks", tp=2, refuse={"softmax_type": "vanilla"}),
]


@pytest.fixture(scope="module")
def two_ranks():
    root = tempfile.mkdtemp()
    return root, run_world(_megatron_world, 2, root=root, layouts=TWO_RANKS, timeout=900)


@pytest.mark.parametrize("lay", [lay for lay in TWO_RANKS if "refuse" not in lay], ids=lambda lay: lay["name"])
def test_megatron_two_ranks_equal_save_pretrained_and_dist_checkpointing(two_ranks, lay):
    root, res = two_ranks
    r0 = _check_layout(res, root, lay)
    if lay["name"] in ("tp2", "ep2_bf16"):  # the other rank's heads / experts really arrive
        assert r0["stats"]["bytes_received"] > 0
    if lay["name"] == "ep2_bf16":
        assert r0["got"]["model.layers.1.mlp.router.bias"].dtype == torch.float32
        assert r0["got"]["model.layers.1.mlp.experts.down_proj_bias"].dtype == torch.bfloat16


def test_megatron_refusals_raise_on_every_rank_naming_the_field(two_ranks):
    _, res = two_ranks
    check_refusals(res, {
        "attention_bias": ("UnmappedParameterError", "attention_bias=False"),
        "num_local_experts": ("UnmappedParameterError", "E=8"),
        "head_dim": ("ValueError", "head_dim=8"),
    })
    for r in res:
        err = res[r]["no_sinks"]["error"]  # a Megatron model without the sinks the checkpoint has
        assert err and err.startswith("ValueError") and "self_attn.sinks" in err and f"rank {r}" in err, err


def test_megatron_four_ranks_tp2_ep2():
    root = tempfile.mkdtemp()
    lay = dict(name="tp2_ep2", tp=2, ep=2)
    res = run_world(_megatron_world, 4, root=root, layouts=[lay], timeout=900)
    r0 = _check_layout(res, root, lay)
    assert r0["stats"]["bytes_received"] > 0


# ---- the forward oracle: Megatron's logits vs transformers' on the export ------------------------


def _forward_world(rank, world_size):
    """One rank, TP1: Megatron's own forward vs transformers' GptOss loaded from the export."""
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
    with torch.no_grad():  # sinks of the size trained ones have (init: N(0, 0.1)), so that they matter
        g = torch.Generator().manual_seed(7)
        for layer in model.decoder.layers:
            sinks = layer.self_attention.core_attention.softmax_offset
            sinks.copy_(2.0 * torch.randn(sinks.shape, generator=g))
    exported = {n: t.clone() for n, t in MegatronSource(model, hf_config=hf).iter_full()}
    ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))  # > window 8
    ref = megatron_logits(model, ids, hf.vocab_size)
    f = {"shape": tuple(ref.shape), "scale": ref.abs().max().item(),
         "windows": [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in model.decoder.layers],
         "rope": type(model.rotary_pos_emb).__name__}
    f["diff"] = (mm.hf_logits(hf, exported, ids) - ref).abs().max().item()
    concat = {n: (_concat_gate_up(t) if n.endswith(("gate_up_proj", "gate_up_proj_bias")) else t) for n, t in exported.items()}
    f["concat_ctrl"] = (mm.hf_logits(hf, concat, ids) - ref).abs().max().item()
    no_sinks = {n: (torch.zeros_like(t) if n.endswith("self_attn.sinks") else t) for n, t in exported.items()}
    f["sinks_ctrl"] = (mm.hf_logits(hf, no_sinks, ids) - ref).abs().max().item()
    full = hf_config(layer_types=["full_attention"] * hf.num_hidden_layers)
    f["window_ctrl"] = (mm.hf_logits(full, exported, ids) - ref).abs().max().item()
    plain = hf_config(rope_parameters={"rope_type": "default", "rope_theta": hf.rope_parameters["rope_theta"]})
    f["yarn_ctrl"] = (mm.hf_logits(plain, exported, ids) - ref).abs().max().item()
    # What vLLM's gpt_oss loader does on TP ranks != 0 to the expert down bias it is handed (through
    # IPC: the trainer's memory): zero it in place. Neither source may let that reach the model.
    from weightsync.sources import FSDPSource

    for layout in ("fused", "per_expert"):
        f[f"megatron_{layout}"] = _vllm_zeroing(
            model, hf, lambda: MegatronSource(model, hf_config=hf, expert_layout=layout)
        )
        hf_model = _model()
        f[f"fsdp_{layout}"] = _vllm_zeroing(hf_model, hf_model.config, lambda: FSDPSource(hf_model, expert_layout=layout))
    f["megatron_ctrl"] = _vllm_zeroing(model, hf, lambda: MegatronSource(model, hf_config=hf), also="model.norm.weight")
    hf_model = _model()
    f["fsdp_ctrl"] = _vllm_zeroing(hf_model, hf_model.config, lambda: FSDPSource(hf_model), also="model.norm.weight")
    return pack(f)


#: The names vLLM's gpt_oss loader zeroes in place (``.down_proj_bias`` and ``.down_proj.bias``
#: both map to its ``w2_bias``), written out here independently of the sources' own patterns.
VLLM_ZEROES = re.compile(r"\.mlp\.experts\.(\d+\.)?down_proj(_bias|\.bias)$")


def _vllm_zeroing(module, cfg, make, also: str | None = None) -> dict:
    """One pass whose consumer zeroes, in place, every tensor vLLM's loader zeroes (and ``also``:
    a control, a tensor the source yields as module storage); the parameters that changed."""
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    zeroed = 0
    with torch.no_grad():
        for name, t in make().iter_full():
            if VLLM_ZEROES.search(name) or name == also:
                t.zero_()
                zeroed += 1
        changed = sorted(n for n, p in module.named_parameters() if not torch.equal(p, before[n]))
        for n, p in module.named_parameters():
            p.copy_(before[n])
    return {"zeroed": zeroed, "changed": changed, "layers": cfg.num_hidden_layers, "experts": cfg.num_local_experts}


@pytest.fixture(scope="module")
def forward():
    return run_world(_forward_world, 1, timeout=600)[0]


def test_forward_logits_megatron_vs_transformers_from_export(forward):
    f = forward
    hf = hf_config()
    assert f["shape"] == (2, 24, hf.vocab_size) and f["rope"] == "YarnRotaryEmbedding"
    assert f["windows"] == [(hf.sliding_window - 1, 0), None]  # layer_types: sliding, full
    assert f["diff"] <= TOL * f["scale"], f
    for ctrl in ("concat_ctrl", "sinks_ctrl", "window_ctrl", "yarn_ctrl"):
        assert f[ctrl] > 100 * TOL * f["scale"], (ctrl, f)


def test_a_loader_zeroing_the_expert_down_bias_leaves_the_trainers_model_alone(forward):
    """vLLM's gpt_oss loader zeroes the expert down-projection bias it is handed on TP ranks != 0,
    and through IPC that is the trainer's memory. On one rank (nothing gathered), both expert layouts:
    FSDPSource yields it as a copy (``core/receiver_writes``), MegatronSource at TP1 as the new tensor
    its expert export builds -- zeroing every one of them changes no parameter. Control: zeroing ``model.norm.weight``,
    which both yield as module storage as ModuleSource does, does change the model."""
    f = forward
    for src in ("megatron", "fsdp"):
        fused, per = f[f"{src}_fused"], f[f"{src}_per_expert"]
        assert fused["zeroed"] == fused["layers"] and fused["changed"] == [], (src, fused)
        assert per["zeroed"] == per["layers"] * per["experts"] and per["changed"] == [], (src, per)
        ctrl = f[f"{src}_ctrl"]
        assert ctrl["zeroed"] == ctrl["layers"] + 1 and len(ctrl["changed"]) == 1, (src, ctrl)


# ---- the CLI ------------------------------------------------------------------------------------


def test_check_cli_megatron_tp2_ep2():
    """``weightsync check --model tiny-gpt-oss --layout megatron --tp 2 --ep 2`` (4 forked ranks;
    the README's line; the builder runs the experts at expert TP 1): exit 0, every name and shape of
    save_pretrained."""
    saved, _ = check_cli(PRESET, "--layout", "megatron", "--tp", "2", "--ep", "2", nproc=4,
                         layout_line="layout megatron tp2 pp1 vpp1 ep2 x4")
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in saved) and any(n.endswith("sinks") for n in saved)


def test_check_cli_fsdp_per_expert_bf16():
    """``weightsync check --model tiny-gpt-oss --expert-layout per_expert --dtype bfloat16`` on 2
    FSDP ranks: exit 0 against save_pretrained's fused experts unfolded to vLLM's per-expert names
    (``unfold_experts``), the router kept in fp32."""
    from test_demo_cli import _saved

    from weightsync.plugins.cli.oracle import unfold_experts
    from weightsync.plugins.testbed.presets import build_model, load_config

    saved = _saved(build_model(load_config(PRESET)))
    per = unfold_experts({n: (None, s) for n, (_, s) in saved.items()})
    assert len(per) == len(saved) + 4 * (hf_config().num_local_experts - 1) * hf_config().num_hidden_layers
    _, r = check_cli(PRESET, "--nproc", "2", "--expert-layout", "per_expert", "--dtype", "bfloat16", nproc=2,
                     layout_line="layout fsdp x2", names={n: s for n, (_, s) in per.items()})
    assert re.search(r"^\s+4\s+\S+ KB\s+float32\s+0,1$", r.stdout, re.M), r.stdout  # router weight + bias, 2 layers


def test_demo_trains_and_syncs_the_preset():
    """``weightsync demo --model tiny-gpt-oss`` (2 forked ranks): every sync verified bit for bit in
    a transformers receiver."""
    check_demo(PRESET, "gpt_oss")
