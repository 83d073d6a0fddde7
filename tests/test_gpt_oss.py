"""GPT-OSS (``GptOssForCausalLM``, ``sources/families/gpt_oss.py``) on CPU gloo ranks, against
oracles nobody here wrote:

* transformers' ``save_pretrained`` of the same weights, which keeps the experts fused as they are in
  memory (``gate_up_proj`` ``[E, H, 2I]`` with gate/up columns interleaved, ``gate_up_proj_bias``,
  ``down_proj`` ``[E, I, H]``, ``down_proj_bias``): ``FSDPSource`` (FSDP2, 2 ranks) sends its names,
  shapes and bytes by default -- fp32 wire, and bf16 wire where the router weight and bias keep
  their fp32 bytes (vLLM's sender-side ``_checked_iter`` accepts it; rank 1 is a real non-sender);
* vLLM 0.33's gpt_oss loader for the per-expert layout: its own ``hf_to_vllm_mapper`` and
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
from fsdp_worlds import unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = "tiny-gpt-oss"
SEED = 3
TOL = 2e-4  # fp32 logits, Megatron vs transformers, relative to the largest logit
IDS = [[3, 17, 42, 5, 60, 1, 33, 8], [9, 9, 27, 50, 2, 44, 13, 61]]
#: Kept fp32 on a bf16 wire: the router (vLLM keeps it in fp32, the wire policy's allow-list).
KEPT_FP32 = re.compile(r"\.mlp\.router\.(weight|bias)$")
EXPERT_LEAVES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def hf_config(**over):
    """The ``tiny-gpt-oss`` preset's ``GptOssConfig`` with ``over`` applied."""
    from transformers import AutoConfig

    from weightsync.plugins.presets import PRESETS

    kw = {**PRESETS[PRESET], **over}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


def _model(seed: int = SEED) -> torch.nn.Module:
    """The test family's tiny GptOss (``moe_models``), every parameter random (sinks, biases too)."""
    from moe_models import tiny_model

    return tiny_model("gpt_oss", seed=seed)


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


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


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
        assert _same_bytes(per_expert[name], fused[f"{m[1]}.{m[3]}"][int(m[2])]), name
    return len(names)


def test_fused_checkpoint_layout_is_read_off_the_experts_module():
    """The expert layout comes from transformers: its reversal keeps GPT-OSS's fused tensors (so the
    checkpoint holds them fused) and the experts module declares transposed, interleaved, biased;
    a declaration the shapes contradict raises naming the module instead of guessing."""
    from weightsync.sources.core.errors import UnmappedParameterError
    from weightsync.sources.core.experts import ExpertTransform

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

    from fsdp_worlds import drive_vllm_nccl, meta_facts, module_snapshot, no_collectives, pack, shard, snapshot_diff
    from fsdp_worlds import stream, to_cpu
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(_model(), mesh)
    before = module_snapshot(model)
    f: dict = {}
    src = FSDPSource(model)
    f["layout"] = src.expert_transform.layout
    with no_collectives():
        f["meta"] = meta_facts(src.metadata)
    pairs = stream(src)
    f["order"] = [n for n, _ in pairs]
    f["fp32"] = to_cpu(pairs)
    f["fused_meta"] = meta_facts(FSDPSource(model, expert_layout="fused").metadata)
    bf = FSDPSource(model, dtype=torch.bfloat16)
    f["bf16_meta"] = meta_facts(bf.metadata)
    f["bf16"] = to_cpu(stream(bf))
    drive_vllm_nccl(bf, rank, f)
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


def _meta_map(meta) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {m[0]: (m[1], tuple(m[2])) for m in meta}


def _dtype_shape(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


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
        assert sorted(f["fp32"]) == sorted(fp32), rank
        assert [n for n, t in fp32.items() if not _same_bytes(f["fp32"][n], t)] == [], rank
        assert f["order"] == [m[0] for m in f["meta"]], "stream order != metadata order"
        assert _meta_map(f["meta"]) == _dtype_shape(fp32)
        assert f["fused_meta"] == f["meta"]  # expert_layout="fused" is the checkpoint's layout here
        assert all(m[3] in (None, (0, 1)) for m in f["meta"])
        assert sorted(f["bf16"]) == sorted(want_bf16)
        assert [n for n, t in want_bf16.items() if not _same_bytes(f["bf16"][n], t)] == [], rank
        assert _meta_map(f["bf16_meta"]) == _dtype_shape(want_bf16)
        assert f["module_changed"] == [], f["module_changed"][:5]
    sent = fsdp[0]["nccl_sender"]
    assert sorted(sent) == sorted(want_bf16) and all(_same_bytes(sent[n], want_bf16[n]) for n in want_bf16)
    assert fsdp[1]["nccl_is_sender"] is False and fsdp[1]["nccl_nonsender_tensors"] == len(want_bf16)


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
        assert [n for n in rest if not _same_bytes(got[n], saved[n])] == []


def test_fsdp_export_loads_with_from_pretrained_to_the_trainers_logits(fsdp, tmp_path):
    """The default export written as a checkpoint loads strictly and computes the trainer model's
    logits bit for bit; the same checkpoint with gate/up de-interleaved ([gate; up] columns, the
    other frameworks' layout) does not."""
    ref = _model()
    want = _logits(ref)
    exported = fsdp[0]["fp32"]
    _write_checkpoint(ref.config, exported, str(tmp_path / "ok"))
    loaded, info = _from_pretrained(str(tmp_path / "ok"))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(_logits(loaded), want)
    bad = {n: (_concat_gate_up(t) if n.endswith(("gate_up_proj", "gate_up_proj_bias")) else t)
           for n, t in exported.items()}
    _write_checkpoint(ref.config, bad, str(tmp_path / "bad"))
    assert not torch.allclose(_logits(_from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


def _concat_gate_up(t: torch.Tensor) -> torch.Tensor:
    """A fused gate/up tensor (last dim interleaved) with its last dim as [all gate; all up]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], -1)


# ---- Megatron: MegatronSource against dist_checkpointing and save_pretrained ----------------------


def _refusals(model) -> dict[str, str | None]:
    """What MegatronSource raises for hf_configs this Megatron GPT-OSS model cannot be exported as."""
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    bad = {
        "attention_bias": hf_config(attention_bias=False),
        "num_local_experts": hf_config(num_local_experts=8),
        "head_dim": hf_config(head_dim=8),
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
        if lay.get("refuse"):  # a Megatron variant the GPT-OSS checkpoint cannot express
            chunks = mm.build_megatron(hf, par, overrides=lay["refuse"])
            facts[name] = {"error": errors_of(lambda: MegatronSource(chunks[0], hf_config=hf))}
            continue
        (model,) = mm.build_megatron(hf, par)
        os.makedirs(f"{root}/{name}", exist_ok=True)
        dcp_save(model, f"{root}/{name}")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        src = MegatronSource(model, hf_config=hf, dtype=lay.get("dtype"))
        f: dict = {"meta": [(m.name, tuple(m.shape), str(m.dtype), m.owners) for m in src.metadata]}
        f["etp"] = model.config.expert_tensor_parallel_size
        got = {n: t.clone() for n, t in src.iter_full()}
        f["stats"] = src.last_pass.as_dict()
        f["again"] = all(torch.equal(got[n], t) for n, t in src.iter_full())
        if lay.get("per_expert"):
            per = MegatronSource(model, hf_config=hf, dtype=lay.get("dtype"), expert_layout="per_expert",
                                 expert_batch_bytes=1)
            f["per_expert_meta"] = [m.name for m in per.metadata]
            per_got = {n: t.clone() for n, t in per.iter_full()}
            if rank == 0:
                f["per_expert"] = per_got
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
    """Names, shapes and dtypes transformers' save_pretrained writes for ``hf`` in ``dtype``."""
    from moe_models import saved_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf)
    if dtype != torch.float32:
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    return {n: (tuple(t.shape), t.dtype) for n, t in saved_state_dict(model).items()}


def _ck_any(ck, layer: int, *suffixes: str) -> torch.Tensor:
    from test_moe_megatron import _ck

    for s in suffixes:
        if f"decoder.layers.{layer}.{s}" in ck or f"decoder.layers.{s}" in ck:
            return _ck(ck, s, layer)
    raise KeyError(f"layer {layer}: none of {suffixes} in megatron's checkpoint")


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
        want[pre + "input_layernorm.weight"] = _ck_any(
            ck, i, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        want[pre + "post_attention_layernorm.weight"] = _ck_any(
            ck, i, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        want[pre + "self_attn.o_proj.weight"] = _ck_any(ck, i, "self_attention.linear_proj.weight")
        want[pre + "self_attn.o_proj.bias"] = _ck_any(ck, i, "self_attention.linear_proj.bias")
        want[pre + "self_attn.sinks"] = _ck_any(ck, i, "self_attention.core_attention.softmax_offset")
        want[pre + "mlp.router.weight"] = _ck_any(ck, i, "mlp.router.weight")
        want[pre + "mlp.router.bias"] = _ck_any(ck, i, "mlp.router.bias")
        fc1 = _ck_any(ck, i, "mlp.experts.experts.linear_fc1.weight")  # [E, 2I, H]
        fc1b = _ck_any(ck, i, "mlp.experts.experts.linear_fc1.bias")  # [E, 2I]
        fc2 = _ck_any(ck, i, "mlp.experts.experts.linear_fc2.weight")  # [E, H, I]
        want[pre + "mlp.experts.gate_up_proj"] = _interleave_rows(fc1).transpose(1, 2)
        want[pre + "mlp.experts.gate_up_proj_bias"] = _interleave_rows(fc1b.unsqueeze(-1)).squeeze(-1)
        want[pre + "mlp.experts.down_proj"] = fc2.transpose(1, 2)
        want[pre + "mlp.experts.down_proj_bias"] = _ck_any(ck, i, "mlp.experts.experts.linear_fc2.bias")
    want["model.embed_tokens.weight"] = ck["embedding.word_embeddings.weight"][: hf.vocab_size]
    want["model.norm.weight"] = ck["decoder.final_layernorm.weight"]
    want["lm_head.weight"] = ck["output_layer.weight"][: hf.vocab_size]
    return want


def _check_layout(res, root, lay) -> dict:
    """Every check on one layout's results; returns rank 0's facts."""
    import megatron_worlds as mw
    from moe_megatron import load_full_checkpoint

    from weightsync.sources import FSDPSource

    name = lay["name"]
    r0 = res[0][name]
    hf = hf_config(**lay.get("hf", {}))
    dtype = lay.get("dtype") or torch.float32
    assert all(res[r][name]["meta"] == r0["meta"] for r in res)
    assert all(o == (0,) for *_, o in r0["meta"])
    saved = _saved(hf, dtype)
    if dtype != torch.float32:  # the router keeps the model's fp32 on the wire, as FSDPSource declares it
        saved = {n: (s, torch.float32 if KEPT_FP32.search(n) else d) for n, (s, d) in saved.items()}
        from transformers import AutoModelForCausalLM

        fsdp = FSDPSource(AutoModelForCausalLM.from_config(hf), dtype=dtype, rank=0)
        assert {n: d for n, _, d, _ in r0["meta"]} == {m.name: str(m.dtype) for m in fsdp.metadata}
    assert {n: (s, d) for n, s, d, _ in r0["meta"]} == {n: (s, str(d)) for n, (s, d) in saved.items()}
    got = r0["got"]
    assert list(got) == [n for n, *_ in r0["meta"]]
    assert {n: (tuple(t.shape), t.dtype) for n, t in got.items()} == saved
    assert r0["etp"] == 1  # the builder: megatron-core's MoE biases need expert TP 1
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
    if lay.get("per_expert"):
        per = r0["per_expert"]
        assert list(per) == r0["per_expert_meta"]
        assert _check_vllm_streamed_experts(per, got) == 4 * hf.num_local_experts * hf.num_hidden_layers
        assert all(torch.equal(per[n], got[n]) for n in per if ".mlp.experts." not in n)
    for r, f in res.items():
        f = f[name]
        assert f["unchanged"], f"rank {r} mutated its model"
        assert f["again"], f"rank {r}: a second pass differs"
        if r:
            assert f["yielded"] == 0 and f["stats"]["tensors"] == 0, f"rank {r} yielded tensors"
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
    words = {
        "attention_bias": ("UnmappedParameterError", "attention_bias=False"),
        "num_local_experts": ("UnmappedParameterError", "E=8"),
        "head_dim": ("ValueError", "head_dim=8"),
    }
    for r in res:
        got = res[r]["tp2"]["refusals"]
        for field, (kind, word) in words.items():
            err = got[field]
            assert err is not None, f"rank {r}: {field} was not refused"
            assert err.startswith(kind) and word in err and f"rank {r}" in err, (r, field, err)
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
    from weightsync.plugins.megatron_build import MegatronParallel
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
    return pack(f)


def test_forward_logits_megatron_vs_transformers_from_export():
    f = run_world(_forward_world, 1, timeout=600)[0]
    hf = hf_config()
    assert f["shape"] == (2, 24, hf.vocab_size) and f["rope"] == "YarnRotaryEmbedding"
    assert f["windows"] == [(hf.sliding_window - 1, 0), None]  # layer_types: sliding, full
    assert f["diff"] <= TOL * f["scale"], f
    for ctrl in ("concat_ctrl", "sinks_ctrl", "window_ctrl", "yarn_ctrl"):
        assert f[ctrl] > 100 * TOL * f["scale"], (ctrl, f)


# ---- the CLI ------------------------------------------------------------------------------------


def test_check_cli_megatron_tp2_ep2():
    """``weightsync check --model tiny-gpt-oss --layout megatron --tp 2 --ep 2`` (4 forked ranks;
    the builder runs the experts at expert TP 1): exit 0, every name and shape of save_pretrained."""
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
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in saved) and any(n.endswith("sinks") for n in saved)


def test_check_cli_fsdp_per_expert_bf16():
    """``weightsync check --model tiny-gpt-oss --expert-layout per_expert --dtype bfloat16`` on 2
    FSDP ranks: exit 0 against save_pretrained's fused experts unfolded to vLLM's per-expert names
    (``unfold_experts``), the router kept in fp32."""
    from test_demo_cli import _listed, _saved
    from worlds import run_cli

    from weightsync.plugins.cli.check import unfold_experts
    from weightsync.plugins.presets import build_model, load_config

    saved = _saved(build_model(load_config(PRESET)))
    per = unfold_experts({n: (None, s) for n, (_, s) in saved.items()})
    assert len(per) == len(saved) + 4 * (hf_config().num_local_experts - 1) * hf_config().num_hidden_layers
    r = run_cli("check", "--model", PRESET, "--nproc", "2", "--expert-layout", "per_expert", "--dtype", "bfloat16",
                "--show", "1000", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS") and "layout fsdp x2" in out
    assert _listed(out) == {n: s for n, (_, s) in per.items()}
    assert re.search(r"^\s+4\s+\S+ KB\s+float32\s+0,1$", out, re.M), out  # router weight + bias, 2 layers


def test_demo_trains_and_syncs_the_preset():
    """``weightsync demo --model tiny-gpt-oss`` (2 forked ranks): every sync verified bit for bit in
    a transformers receiver."""
    from worlds import run_cli

    r = run_cli("demo", "--model", PRESET, "--steps", "2", nproc=2, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert re.search(r"weightsync demo: 2/2 syncs verified, .* \(2 ranks, gpt_oss, .*-> PASS", r.stdout), r.stdout
    assert "before any sync: receiver logits equal trainer's: False" in r.stdout
