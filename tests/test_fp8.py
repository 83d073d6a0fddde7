"""FP8 rollouts (``weightsync.sources.FP8Source`` / ``quantize_blocks`` / ``FP8Config``) against oracles
nobody here wrote:

* **numerics**: vLLM's ``per_block_cast_to_fp8`` (the quantizer vLLM's tests use) and
  transformers' ``Fp8Quantize`` (its FineGrainedFP8 save-time quantizer), bit for bit, fp32 and UE8M0
  scales, on edge shapes (N, K not multiples of the block), all-zero blocks, subnormal-range and
  large values, 3-D expert stacks; where the two references disagree, the test says how;
  transformers' ``Fp8Dequantize`` computes our dequantization;
* **names, dtypes, shapes**: transformers' own FP8 model skeleton (``replace_with_fp8_linear`` with the
  ``quantization_config`` weightsync writes) holds exactly the tensors ``FP8Source`` declares;
  ``from_pretrained`` loads the checkpoint ``save_safetensors`` writes from an FP8 stream with nothing
  missing or unexpected;
* **multi-rank**: ``FSDPSource`` on 2 FSDP2 ranks (dense and MoE, per-expert and fused experts,
  ``iter_full`` and block-aligned ``iter_local``, through vLLM's NCCL sender check) and
  ``MegatronSource`` at TP2, EP2 and (MLA) TP2 on 2 ranks: the quantized streams equal vLLM's
  quantizer applied to the unquantized streams, which the family tests prove equal to
  ``save_pretrained`` (FSDP: compared with ``save_pretrained``'s own tensors here);
* **bad input** raises ``FP8ConfigError`` on every rank before any collective: a served config whose
  block size or quantized modules disagree with the model, per-tensor FP8, piecewise quantization
  whose pieces do not fall on block boundaries.
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
from fsdp_worlds import unpack
from worlds import run_world as _run_world

VLLM_BLOCK = [128, 128]


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def _vllm(x: torch.Tensor, block=(128, 128), ue8m0: bool = False):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(x, list(block), use_ue8m0=ue8m0)


def _transformers(x: torch.Tensor, block=(128, 128), fmt: str | None = None):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Q:
        quantization_config = FineGrainedFP8Config(weight_block_size=tuple(block), scale_fmt=fmt or "float")

    out = Fp8Quantize(Q()).convert({"w.weight": x})
    return out["w.weight"], out.get("w.weight_scale_inv")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _adversarial(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values plus an all-zero block, a subnormal-range block, a large-value block and a block
    mixing tiny and huge values, wherever the shape has room for them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    n, k = shape[-2:]
    if n > 8 and k > 8:
        x[..., : n // 4, : k // 4] = 0
        x[..., n // 4 : n // 2, : k // 4] *= 1e-39 if dtype == torch.float32 else 1e-38  # subnormal range
        x[..., : n // 4, k // 2 :] *= 1e30
        x[..., -1, -1] = 3e38 if dtype == torch.float32 else 1e38
    return x.to(dtype)


EDGE_SHAPES = [(1, 1), (1, 5), (7, 300), (127, 129), (128, 128), (129, 257), (256, 384), (300, 200)]


def test_quantize_blocks_is_vllms_quantizer_bit_for_bit():
    """Every shape (edge blocks included), dtype, block and scale format: codes and scales equal
    vLLM's ``per_block_cast_to_fp8``; and the scale tensor is ``[ceil(N/bN), ceil(K/bK)]`` float32."""
    from weightsync.sources import quantize_blocks

    bad, n = [], 0
    for i, shape in enumerate(EDGE_SHAPES):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = _adversarial(shape, dtype, i)
            before = x.clone()
            for block in ((128, 128), (64, 32), (1, 128)):
                for ue in (False, True):
                    rq, rs = _vllm(x, block, ue)
                    q, s = quantize_blocks(x, block, scale_fmt="ue8m0" if ue else None)
                    n += 1
                    if not (_same(q, rq) and _same(s, rs)):
                        bad.append((shape, dtype, block, ue))
                    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            assert torch.equal(x, before), "quantize_blocks modified its input"
    assert not bad, f"{len(bad)}/{n} cases differ from vLLM's quantizer: {bad[:5]}"
    assert n == len(EDGE_SHAPES) * 3 * 3 * 2


def test_quantize_blocks_rule_transformers_is_fp8quantize_bit_for_bit():
    """Block-multiple shapes (the ones transformers quantizes), 2-D and 3-D expert stacks, fp32 and
    UE8M0 scales (transformers stores UE8M0 scales as float8_e8m0fnu; weightsync sends them as the
    same powers of two in float32, the dtype vLLM's parameter holds)."""
    from weightsync.sources import quantize_blocks

    bad = []
    for i, shape in enumerate([(128, 128), (256, 384), (3, 256, 128), (384, 128)]):
        for dtype in (torch.bfloat16, torch.float32):
            x = _adversarial(shape, dtype, 10 + i)
            for fmt in (None, "ue8m0"):
                tq, ts = _transformers(x, fmt=fmt)
                q, s = quantize_blocks(x, scale_fmt=fmt, rule="transformers")
                if not (_same(q, tq) and _same(s, ts.to(torch.float32))):
                    bad.append((shape, dtype, fmt))
                if fmt == "ue8m0":
                    assert ts.dtype == torch.float8_e8m0fnu and torch.equal(ts.to(torch.float32), s)
    assert not bad, bad


def test_the_two_references_disagree_and_vllm_loads_either():
    """Where vLLM's and transformers' quantizers differ (documented in quant/fp8.py): an all-zero block's
    scale (1e-4/448 vs 1), the last bit of scales (1/(448/a) vs a/448), shapes that are not block
    multiples (transformers passes them through unquantized). What vLLM's loader computes from either
    -- codes times the stored block scale -- is within FP8 rounding of the input for both."""
    from weightsync.sources import dequantize_blocks, quantize_blocks

    x = torch.randn(512, 384, generator=torch.Generator().manual_seed(5))
    x[:128, :128] = 0
    rq, rs = _vllm(x)
    tq, ts = _transformers(x)
    assert rs[0, 0].item() == pytest.approx(1e-4 / 448) and ts[0, 0].item() == 1.0
    assert (rs != ts).sum() > 0, "on random data some scales differ in the last bit"
    nonzero = torch.ones_like(rs, dtype=torch.bool)
    nonzero[0, 0] = False
    assert ((rs - ts).abs()[nonzero] <= rs[nonzero] * 2**-23).all(), "and only in the last bit"
    edge = torch.randn(130, 200)
    tq_edge, ts_edge = _transformers(edge)
    assert tq_edge.dtype == torch.float32 and ts_edge is None, "transformers leaves non-multiples unquantized"
    q, s = quantize_blocks(edge)
    assert _same(q, _vllm(edge)[0]) and s.shape == (2, 2)
    for qq, ss in ((rq, rs), (tq, ts)):
        deq = dequantize_blocks(qq, ss)
        unit = ss.repeat_interleave(128, 0).repeat_interleave(128, 1)  # the block's scale
        # e4m3: half an ulp is 2^-4 relative for normals, 2^-10 of the scale for subnormal codes
        assert ((deq - x).abs() <= x.abs() * 2**-4 + unit * 2**-10).all()


def test_dequantize_blocks_is_transformers_fp8dequantize():
    """The receiver's dequantization (``dequantize_blocks``, what vLLM's loader multiplies) equals
    transformers' ``Fp8Dequantize`` on block-multiple shapes, 2-D and 3-D."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from weightsync.sources import dequantize_blocks, quantize_blocks

    class Q:
        quantization_config = None

    deq = Fp8Dequantize(Q())
    for shape in ((256, 384), (3, 128, 256)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        q, s = quantize_blocks(x)
        ours = dequantize_blocks(q, s)
        theirs = deq._dequantize_one(q, s, torch.float32)
        assert torch.equal(ours, theirs)


def test_fused_gate_up_scales_follow_the_concat():
    """A fused ``experts.gate_up_proj`` [E, 2I, H] with I not a block multiple: gate and up are
    quantized as two tensors and their scales concatenated (``[E, 2*ceil(I/bN), ceil(H/bK)]``, the
    rows vLLM's ``w13_weight_scale_inv`` holds): vLLM's fused-expert loader, which chunks the scale in
    two like the weight, then reads exactly the per-expert gate and up scales."""
    from weightsync.sources import FP8Config, quantize_blocks

    cfg = FP8Config()
    E, inter, hidden = 2, 192, 256
    plan = cfg.plan("model.layers.0.mlp.experts.gate_up_proj", (E, 2 * inter, hidden))
    assert plan.scale_name == "model.layers.0.mlp.experts.gate_up_proj_scale_inv"
    assert plan.scale_shape == (E, 4, 2) and plan.parts == 2
    down = cfg.plan("model.layers.0.mlp.experts.down_proj", (E, hidden, inter))
    assert down.scale_shape == (E, 2, 2) and down.parts == 1
    x = torch.randn(E, 2 * inter, hidden)
    halves = [quantize_blocks(h) for h in x.chunk(2, dim=1)]
    scale = torch.cat([h[1] for h in halves], dim=1)
    gate_s, up_s = scale.chunk(2, dim=1)  # what RoutedExperts.load_weights does with a fused scale
    for e in range(E):
        assert torch.equal(gate_s[e], _vllm(x[e, :inter])[1]) and torch.equal(up_s[e], _vllm(x[e, inter:])[1])


NAMES = {  # checkpoint name -> quantized by default?
    "model.embed_tokens.weight": False, "lm_head.weight": False, "model.norm.weight": False,
    "model.layers.0.input_layernorm.weight": False, "model.layers.0.self_attn.q_norm.weight": False,
    "model.layers.0.self_attn.q_proj.weight": True, "model.layers.0.self_attn.o_proj.weight": True,
    "model.layers.0.self_attn.q_proj.bias": False, "model.layers.0.self_attn.sinks": False,
    "model.layers.0.mlp.gate_proj.weight": True, "model.layers.0.mlp.down_proj.weight": True,
    "model.layers.1.mlp.gate.weight": False, "model.layers.1.mlp.gate.e_score_correction_bias": False,
    "model.layers.1.mlp.experts.3.up_proj.weight": True, "model.layers.1.mlp.shared_expert.down_proj.weight": True,
    "model.layers.1.mlp.shared_experts.gate_proj.weight": True, "model.layers.1.mlp.shared_expert_gate.weight": False,
    "model.layers.1.block_sparse_moe.gate.weight": False, "model.layers.1.block_sparse_moe.experts.0.w1.weight": True,
    "model.layers.0.self_attn.q_a_proj.weight": True, "model.layers.0.self_attn.q_a_layernorm.weight": False,
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": True, "model.layers.0.self_attn.kv_b_proj.weight": True,
    "model.layers.0.self_attn.indexer.wq_b.weight": True, "model.layers.0.self_attn.indexer.weights_proj.weight": False,
    "model.layers.0.self_attn.indexer.k_norm.weight": False, "model.layers.0.mlp.router.weight": False,
    "model.layers.0.linear_attn.conv1d.weight": False,
}


def test_default_selection_and_served_configs():
    """The documented default set; ``modules_to_not_convert`` / ``ignored_layers`` (transformers'
    matching); a served ``quantization_config`` read as vLLM reads it; what cannot be honoured is
    refused naming the field."""
    from weightsync.sources import FP8Config, FP8ConfigError

    cfg = FP8Config()
    for name, want in NAMES.items():
        shape = (64, 32, 3) if name.endswith("conv1d.weight") else (64, 32) if name.endswith(".weight") else (64,)
        assert (cfg.plan(name, shape) is not None) == want, name
    served = FP8Config.from_hf({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 32],
        "scale_fmt": "ue8m0", "modules_to_not_convert": ["model.layers.0.self_attn.o_proj", "mlp.down_proj"],
    }})
    assert served.block == (64, 32) and served.scale_fmt == "ue8m0"
    assert served.plan("model.layers.0.self_attn.o_proj.weight", (64, 64)) is None
    assert served.plan("model.layers.1.self_attn.o_proj.weight", (64, 64)).scale_shape == (1, 2)
    assert served.plan("model.layers.3.mlp.down_proj.weight", (64, 64)) is None
    assert FP8Config.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128],
                              "ignored_layers": ["lm_head", "re:.*q_proj"]}).not_convert == ("lm_head", "re:.*q_proj")
    refusals = {
        "weight_block_size": {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "fmt": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
        "quant_method": {"quant_method": "awq", "weight_block_size": [128, 128]},
        "scale_fmt": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e8m0x"},
    }
    for field, q in refusals.items():
        with pytest.raises(FP8ConfigError, match=field):
            FP8Config.from_hf(q)


def _tiny_moe(hidden=256, inter=128, moe_inter=128, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, vocab_size=96, num_experts=3, num_experts_per_tok=2,
                         moe_intermediate_size=moe_inter, mlp_only_layers=[1], tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _skeleton_state(model, quantization_config: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What transformers' own FP8 model holds for ``model``'s architecture under ``quantization_config``."""
    import copy

    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.utils.quantization_config import FineGrainedFP8Config

    q = quantization_config
    cfg = FineGrainedFP8Config(weight_block_size=tuple(q["weight_block_size"]),
                               modules_to_not_convert=q.get("modules_to_not_convert"))
    m = copy.deepcopy(model)
    replace_with_fp8_linear(m, modules_to_not_convert=cfg.modules_to_not_convert, quantization_config=cfg,
                            pre_quantized=True)
    return {n: (t.dtype, tuple(t.shape)) for n, t in m.state_dict().items()}


def test_one_process_sources_checkpoint_and_served_folder():
    """One process: ``FP8Source`` over ``SafetensorsSource`` (a ``save_pretrained`` folder) and over
    vLLM's ``ModuleSource`` (fused experts): metadata = transformers' FP8 skeleton of the same
    architecture, bytes = vLLM's quantizer on the file's tensors; ``save_safetensors`` writes an FP8
    checkpoint ``from_pretrained`` loads with nothing missing or unexpected, its weights transformers'
    dequantization of ours; that folder, as the served model, makes the same stream; folders that
    disagree with the model raise before a byte moves; the caller's config and model are untouched."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import FP8Config, FP8ConfigError, FP8Source, SafetensorsSource, dequantize_blocks

    model = _tiny_moe()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(f"{d}/bf")
        src = FP8Source(SafetensorsSource(f"{d}/bf"))
        meta = {m.name: (m.dtype, tuple(m.shape)) for m in src.metadata}
        skeleton = _skeleton_state(model, src.quantization_config)
        # transformers' skeleton holds fused experts; the checkpoint per-expert names (save_pretrained's)
        per_expert = {n for n in meta if re.search(r"\.experts\.\d+\.", n)}
        assert {n: v for n, v in meta.items() if n not in per_expert} == \
            {n: v for n, v in skeleton.items() if ".experts." not in n}
        assert sum(1 for n in meta if n.endswith("weight_scale_inv")) == 4 * 2 + 3 * 3 * 1 + 3 * 1  # attn, experts, dense mlp
        files = dict(SafetensorsSource(f"{d}/bf").iter_full())
        got = dict(src.iter_full())
        for name, t in files.items():
            p = src._plans.get(name)
            if p is None:
                assert _same(got[name], t), name
            else:
                q, s = _vllm(t)
                assert _same(got[name], q) and _same(got[p.scale_name], s), name

        fused = FP8Source(ModuleSource(model))
        fmeta = {m.name: (m.dtype, tuple(m.shape)) for m in fused.metadata}
        assert fmeta == skeleton, sorted(set(fmeta.items()) ^ set(skeleton.items()))[:4]
        fgot = dict(fused.iter_full())
        gu = model.model.layers[0].mlp.experts.gate_up_proj.detach()
        assert _same(fgot["model.layers.0.mlp.experts.gate_up_proj"],
                     torch.cat([_vllm(gu[e])[0] for e in range(3)]).view(3, 256, 256))

        cfg_before = model.config.to_dict()
        save_safetensors(src, f"{d}/fp8", config=model.config)
        assert model.config.to_dict() == cfg_before
        loaded, info = AutoModelForCausalLM.from_pretrained(f"{d}/fp8", dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info
        sd = loaded.state_dict()
        deq = {name: dequantize_blocks(got[name], got[p.scale_name]) for name, p in src._plans.items()}
        for name, t in deq.items():
            if name not in per_expert:
                assert torch.equal(sd[name], t.to(sd[name].dtype)), name
        pre = "model.layers.0.mlp.experts"
        for e in range(3):  # transformers holds the experts fused: [gate; up] and down
            assert torch.equal(sd[f"{pre}.gate_up_proj"][e],
                               torch.cat([deq[f"{pre}.{e}.gate_proj.weight"], deq[f"{pre}.{e}.up_proj.weight"]]))
            assert torch.equal(sd[f"{pre}.down_proj"][e], deq[f"{pre}.{e}.down_proj.weight"])

        served = FP8Config.from_checkpoint(f"{d}/fp8")
        assert served.modules == frozenset(n[: -len(".weight")] for n in src._plans)
        again = FP8Source(SafetensorsSource(f"{d}/bf"), f"{d}/fp8")
        assert [(m.name, m.dtype, m.shape) for m in again.metadata] == [(m.name, m.dtype, m.shape) for m in src.metadata]

        with pytest.raises(FP8ConfigError, match=r"scale has shape .* weight_block_size=\[64, 64\]"):
            bad = FP8Config(block=(64, 64), modules=served.modules, expected_scales=served.expected_scales)
            FP8Source(SafetensorsSource(f"{d}/bf"), bad).metadata
        with pytest.raises(FP8ConfigError, match="does not send, e.g. 'model.layers.5.self_attn.q_proj'"):
            FP8Source(SafetensorsSource(f"{d}/bf"), FP8Config(modules=served.modules | {"model.layers.5.self_attn.q_proj"})).metadata
        with pytest.raises(FP8ConfigError, match="already quantized"):
            FP8Source(src)
        with pytest.raises(FP8ConfigError, match="already sends"):
            FP8Source(SafetensorsSource(f"{d}/fp8")).metadata


# ---- FSDP2, 2 ranks -------------------------------------------------------------------------------

SMALL = (16, 16)  # tiny models: several blocks per tensor, edge blocks included
LOCAL = (8, 16)  # every FSDP piece of the dense tiny model starts on a block boundary


def _fsdp_world(rank, world_size, *, oracle_dir):
    import torch.distributed as dist
    from fsdp_worlds import drive_vllm_nccl, module_snapshot, no_collectives, pack, save_oracle, shard
    from fsdp_worlds import snapshot_diff, stream, tiny_model, to_cpu
    from torch.distributed.device_mesh import init_device_mesh
    from worlds import errors_of

    from weightsync.sources import FP8Config, FP8Source, FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts = {}
    for family in ("qwen3", "qwen3_moe"):
        model = tiny_model(family, tied=False, vocab=96)
        if rank == 0:
            save_oracle(model, os.path.join(oracle_dir, family), torch.bfloat16)
            save_oracle(model, os.path.join(oracle_dir, family + "-fp32"))
        shard(model, mesh)
        before = module_snapshot(model)
        f = {}
        layouts = {"default": None} if family == "qwen3" else {"default": None, "fused": "fused"}
        for tag, layout in layouts.items():
            src = FP8Source(FSDPSource(model, dtype=torch.bfloat16, expert_layout=layout), FP8Config(block=SMALL))
            with no_collectives():
                f[f"{tag}_meta"] = [(m.name, str(m.dtype), tuple(m.shape)) for m in src.metadata]
            f[f"{tag}_full"] = to_cpu(stream(src))
            f[f"{tag}_qcfg"] = src.quantization_config
        if family == "qwen3":
            f["local"] = to_cpu(stream(FP8Source(FSDPSource(model, dtype=torch.bfloat16), FP8Config(block=LOCAL)), "local"))
            f["local_refused"] = errors_of(lambda: stream(FP8Source(FSDPSource(model), FP8Config(block=(24, 16))), "local"))
            bad = FP8Config(block=SMALL, modules=frozenset({"model.layers.0.self_attn.q_proj", "model.layers.7.mlp.up_proj"}))
            with no_collectives():
                f["served_mismatch"] = errors_of(lambda: FP8Source(FSDPSource(model), bad).metadata)
            drive_vllm_nccl(FP8Source(FSDPSource(model, dtype=torch.bfloat16), FP8Config(block=SMALL)), rank, f)
        f["module_changed"] = snapshot_diff(before, module_snapshot(model))
        facts[family] = f
        dist.barrier()
    return pack(facts)


@pytest.fixture(scope="module")
def fsdp_world():
    d = tempfile.mkdtemp()
    return d, run_world(_fsdp_world, 2, oracle_dir=d, timeout=400)


def _quantized_reference(tensors: dict, block, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """vLLM's quantizer over ``save_pretrained``'s tensors, default selection; fused experts built the
    way transformers holds them ([gate; up] per expert, halves quantized separately)."""
    from weightsync.sources import FP8Config

    cfg, out = FP8Config(block=block), {}
    if fused_experts:
        grouped: dict[str, dict] = {}
        for name in list(tensors):
            m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
            if m:
                grouped.setdefault(m[1], {})[(int(m[2]), m[3])] = tensors.pop(name)
        for pre, parts in grouped.items():
            E = 1 + max(e for e, _ in parts)
            gu = [_vllm(parts[(e, w)], block) for e in range(E) for w in ("gate_proj", "up_proj")]
            out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([gu[2 * e][0], gu[2 * e + 1][0]]) for e in range(E)])
            out[f"{pre}.gate_up_proj_scale_inv"] = torch.stack([torch.cat([gu[2 * e][1], gu[2 * e + 1][1]]) for e in range(E)])
            dn = [_vllm(parts[(e, "down_proj")], block) for e in range(E)]
            out[f"{pre}.down_proj"] = torch.stack([q for q, _ in dn])
            out[f"{pre}.down_proj_scale_inv"] = torch.stack([s for _, s in dn])
    for name, t in tensors.items():
        p = cfg.plan(name, tuple(t.shape))
        if p is None:
            out[name] = t
        else:
            out[name], out[p.scale_name] = _vllm(t, block)
    return out


def _bf16_wire(d: str, family: str) -> dict[str, torch.Tensor]:
    """``save_pretrained``'s tensors as a bf16 wire carries them: bf16, routers in fp32 (vLLM keeps them)."""
    from fsdp_worlds import load_oracle

    bf16, fp32 = load_oracle(os.path.join(d, family)), load_oracle(os.path.join(d, family + "-fp32"))
    return {n: fp32[n] if n.endswith("mlp.gate.weight") else t for n, t in bf16.items()}


def _equal_maps(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    bad += [n for n in set(got) & set(want) if not _same(got[n], want[n])]
    return bad


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fsdp_fp8_stream_is_vllms_quantizer_on_save_pretrained(fsdp_world, family):
    """Both ranks yield exactly vLLM's quantizer applied to ``save_pretrained``'s bf16 tensors (names,
    dtypes, shapes, bytes), metadata in stream order without a collective, per-expert and fused
    experts; the trainer's model is untouched."""
    from fsdp_worlds import load_oracle

    d, res = fsdp_world
    oracle = _bf16_wire(d, family)
    for rank in (0, 1):
        f = res[rank][family]
        assert not f["module_changed"], f["module_changed"]
        for tag in ("default", "fused") if family == "qwen3_moe" else ("default",):
            want = _quantized_reference(dict(oracle), SMALL, fused_experts=tag == "fused")
            got = f[f"{tag}_full"]
            assert not _equal_maps(got, want), (tag, _equal_maps(got, want)[:5])
            assert [n for n, _, _ in f[f"{tag}_meta"]] == list(got), "metadata order is the stream's"
            assert "lm_head" in f[f"{tag}_qcfg"]["modules_to_not_convert"]
    assert res[0][family]["default_full"].keys() == res[1][family]["default_full"].keys()


def test_fsdp_fp8_iter_local_nccl_and_refusals(fsdp_world):
    """``iter_local`` with block-aligned pieces: the two ranks' pieces are the rows of the full FP8
    tensors and scales; unaligned pieces raise on both ranks naming the parameter; vLLM's NCCL sender
    check accepts the FP8 stream and a real non-sender engine drains it; a served config quantizing a
    module the model lacks raises on both ranks, before any collective."""
    from fsdp_worlds import load_oracle

    d, res = fsdp_world
    want = _quantized_reference(_bf16_wire(d, "qwen3"), LOCAL)
    local = [res[r]["qwen3"]["local"] for r in (0, 1)]
    assert local[0].keys() == want.keys()
    for name, full in want.items():
        pieces = [local[r][name] for r in (0, 1)]
        if pieces[0].shape == full.shape:  # replicated (1-D, or not a Shard placement)
            assert all(_same(p, full) for p in pieces), name
        else:
            assert _same(torch.cat(pieces), full), name
    assert any(n.endswith("weight_scale_inv") and local[0][n].shape != want[n].shape for n in want), \
        "some scales are sharded like their weights"
    for r in (0, 1):
        f = res[r]["qwen3"]
        assert re.search(rf"rank {r}: FP8Source.iter_local: '.*' .* weight_block_size=\[24, 16\]", f["local_refused"] or "")
        assert re.search(rf"rank {r}: .*does not send, e.g. 'model.layers.7.mlp.up_proj'", f["served_mismatch"] or "")
    sent = res[0]["qwen3"]["nccl_sender"]
    assert not _equal_maps(sent, _quantized_reference(_bf16_wire(d, "qwen3"), SMALL))
    assert res[1]["qwen3"]["nccl_is_sender"] is False and res[1]["qwen3"]["nccl_nonsender_tensors"] > 0


# ---- MegatronSource, 2 ranks ----------------------------------------------------------------------

MEGATRON_LAYOUTS = [
    dict(name="dense_tp2", family="qwen3", tp=2, dtype=torch.bfloat16),
    dict(name="moe_ep2", family="qwen3_moe", ep=2),
    dict(name="mla_tp2", family="deepseek_v3", tp=2, dtype=torch.bfloat16),
]


def _megatron_hf(lay):
    from transformers import AutoConfig

    if lay["family"] == "qwen3":
        from megatron_worlds import hf_config

        return hf_config("qwen3")
    if lay["family"] == "deepseek_v3":
        import mla_models

        return mla_models.hf_config("q_lora")
    from moe_models import FAMILIES

    cfg = AutoConfig.for_model("qwen3_moe", **FAMILIES["qwen3_moe"])
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def _megatron_fp8(rank, lay, hf, chunks, src):
    """The quantized pass of the same model: rank 0's stream, every rank's metadata and yield count."""
    from weightsync.sources import FP8Config, FP8Source, MegatronSource

    fp8 = FP8Source(MegatronSource(chunks[0], hf_config=hf, dtype=lay.get("dtype")), FP8Config(block=SMALL))
    got = {n: t.clone() for n, t in fp8.iter_full()}
    return {"fp8_meta": [(m.name, str(m.dtype), tuple(m.shape), m.owners) for m in fp8.metadata],
            "fp8_got": got if rank == 0 else len(got), "fp8_qcfg": fp8.quantization_config}


def _megatron_world(rank, world_size, *, root):
    from family_worlds import megatron_layouts

    return megatron_layouts(rank, world_size, root=root, layouts=MEGATRON_LAYOUTS, hf_of=_megatron_hf,
                            extra=_megatron_fp8)


@pytest.fixture(scope="module")
def megatron_world():
    return run_world(_megatron_world, 2, root=tempfile.mkdtemp(), timeout=900)


@pytest.mark.parametrize("lay", MEGATRON_LAYOUTS, ids=lambda lay: lay["name"])
def test_megatron_fp8_stream_is_vllms_quantizer_on_the_export(megatron_world, lay):
    """TP2 (dense, bf16 wire), EP2 (MoE, fp32) and TP2 MLA (bf16): rank 0 alone yields, and what it
    yields is vLLM's quantizer applied to ``MegatronSource``'s unquantized export of the same model
    (proven equal to ``save_pretrained`` and to megatron's own ``dist_checkpointing`` by the family
    tests), attention / MLA / dense MLP / expert / shared-expert projections quantized, embeddings,
    norms, routers and their biases not; the metadata is the same on both ranks, owned by rank 0."""
    r0, r1 = megatron_world[0][lay["name"]], megatron_world[1][lay["name"]]
    want = _quantized_reference(dict(r0["got"]), SMALL)
    got = r0["fp8_got"]
    assert not _equal_maps(got, want), _equal_maps(got, want)[:5]
    assert list(got) == [n for n, *_ in r0["fp8_meta"]] and r0["fp8_meta"] == r1["fp8_meta"]
    assert all(o == (0,) for *_, o in r0["fp8_meta"]) and r1["fp8_got"] == 0
    fp8 = {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 and not any(re.search(r"embed|norm|lm_head|mlp\.gate\.|e_score", n) for n in fp8), sorted(fp8)[:5]
    kinds = {"dense_tp2": r"self_attn\.o_proj", "moe_ep2": r"experts\.\d+\.down_proj",
             "mla_tp2": r"kv_a_proj_with_mqa"}
    assert any(re.search(kinds[lay["name"]], n) for n in fp8)
    assert r0["unchanged"] and r1["unchanged"]


# ---- the CLI and the demo -------------------------------------------------------------------------


def test_cli_export_and_check_fp8():
    """``weightsync export --quantize fp8`` (FSDP, 2 ranks) writes an FP8 checkpoint; ``weightsync check
    --quantize fp8 --checkpoint`` of it from a Megatron TP2 model of the same config passes with every
    tensor's bytes equal (two layouts, one FP8 checkpoint); ``check --quantize fp8`` against
    ``save_pretrained``'s index passes for a MoE preset at EP2; and a served config whose block size
    differs from the folder's scales fails naming the module."""
    import json

    from worlds import run_cli

    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/fp8"
        r = run_cli("export", "--model", "tiny-qwen3", "--quantize", "fp8", "--out", out, nproc=2)
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
        q = json.load(open(f"{out}/config.json"))["quantization_config"]
        assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and "lm_head" in q["modules_to_not_convert"]
        r = run_cli("check", "--model", "tiny-qwen3", "--quantize", "fp8", "--checkpoint", out,
                    "--layout", "megatron", "--tp", "2", nproc=2)
        assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
        assert re.search(r"bytes: (\d+) of \1 tensors compared equal", r.stdout), r.stdout
        r = run_cli("check", "--model", "tiny-qwen3-moe", "--quantize", "fp8", "--layout", "megatron", "--ep", "2",
                    nproc=2)
        assert r.returncode == 0 and "PASS" in r.stdout and "float8_e4m3fn" in r.stdout, r.stdout + r.stderr
        cfg = json.load(open(f"{out}/config.json"))
        cfg["quantization_config"]["weight_block_size"] = [16, 16]
        json.dump(cfg, open(f"{d}/served.json", "w"))
        r = run_cli("check", "--model", "tiny-qwen3", "--quantize", "fp8", "--quantize-config", f"{d}/served.json",
                    "--checkpoint", out, nproc=1)
        assert r.returncode == 1 and "weight_scale_inv" in r.stdout + r.stderr, r.stdout + r.stderr


def test_demo_fp8_syncs_within_tolerance_and_control():
    """``weightsync demo --quantize fp8`` on 2 ranks: every sync's wire checksums match and the
    receiver's dequantized logits are within ``FP8_LOGITS_TOL`` of the trainer's; before any sync (a
    receiver with other weights) they are far outside it -- the tolerance can fail."""
    from worlds import run_cli

    from weightsync.plugins.cli.demo import FP8_LOGITS_TOL

    r = run_cli("demo", "--steps", "2", "--quantize", "fp8", nproc=2)
    assert r.returncode == 0 and "2/2 syncs verified" in r.stdout, r.stdout + r.stderr
    rel = [float(x) for x in re.findall(r"max rel \|diff\| ([0-9.e-]+) <=", r.stdout)]
    assert len(rel) == 2 and all(0 < x <= FP8_LOGITS_TOL for x in rel), r.stdout
    m = re.search(r"before any sync: .*\(max rel \|diff\| ([0-9.e+-]+)\)", r.stdout)
    assert m, r.stdout
    before = float(m[1])
    assert before > 5 * FP8_LOGITS_TOL, r.stdout


def test_gpt_oss_experts_go_out_as_they_are():
    """GPT-OSS keeps its experts transposed and gate/up-interleaved (fused, or per expert under vLLM's
    gpt_oss names): 128x128 blocks of those tensors are not an FP8 checkpoint's (GPT-OSS ships MXFP4
    experts), so ``FP8Source`` sends them as they are and lists them in ``modules_to_not_convert``;
    its attention projections go out FP8, router and sinks not."""
    from moe_models import tiny_model
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FP8Config, FP8Source, FSDPSource

    model = tiny_model("gpt_oss")
    for src in (FP8Source(ModuleSource(model), FP8Config(block=(8, 8))),
                FP8Source(FSDPSource(model, expert_layout="per_expert", rank=0), FP8Config(block=(8, 8)))):
        fp8 = {m.name for m in src.metadata if m.dtype == torch.float8_e4m3fn}
        assert "model.layers.0.self_attn.q_proj.weight" in fp8, sorted(fp8)
        assert not any("experts" in n or "router" in n or "sinks" in n for n in fp8), sorted(fp8)
    kept = FP8Source(ModuleSource(model), FP8Config(block=(8, 8))).quantization_config["modules_to_not_convert"]
    assert "model.layers.0.mlp.experts" in kept


def test_launch_windows_yield_the_tensor_by_tensor_stream():
    """What ``FP8Source`` does on CUDA -- consecutive 2-D weights (and the small tensors between them)
    held in windows of ``batch_bytes`` and quantized together -- run on CPU (``_windowed`` forced on;
    ``quantize_many`` then goes tensor by tensor): at every window size the stream has the names,
    order, dtypes and bytes of the tensor-by-tensor stream (each scale right after its weight, the 3-D
    fused experts and the unquantized tensors in place) -- the stream the tests above prove equal to
    vLLM's quantizer. The kernel itself is checked on the GPU (bench_gpu_fp8)."""
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FP8Source

    class Windowed(FP8Source):
        @staticmethod
        def _windowed(tensor: torch.Tensor) -> bool:
            return True

    model = _tiny_moe()
    plain = dict(ModuleSource(model).iter_full())
    one_by_one = list(FP8Source(ModuleSource(model), batch_bytes=0).iter_full())
    plans = FP8Source(ModuleSource(model))._plans
    assert any(p.parts > 1 for p in plans.values()) and any(len(plain[n].shape) == 3 for n in plans)
    for limit in (1, 64 << 10, 300 << 10, 1 << 30):  # every weight alone ... the whole model in one window
        src = Windowed(ModuleSource(model), batch_bytes=limit)
        got = list(src.iter_full())
        assert [(n, t.dtype, tuple(t.shape)) for n, t in got] == \
            [(n, t.dtype, tuple(t.shape)) for n, t in one_by_one], limit
        assert all(_same(a, b) for (_, a), (_, b) in zip(got, one_by_one)), limit


def test_torch_path_reciprocal_at_fp8_ties_on_cpu():
    """The vLLM rule's ``1/sf`` on the torch path: on CPU the IEEE reciprocal (eager vLLM's; no
    ``div.full.f32`` exists there to match), so a constructed FP8 tie -- ``x * (1/sf)`` exactly halfway
    between two e4m3 codes -- rounds to even as eager torch does. (On CUDA the same function takes
    Triton's ``div.full.f32`` through the jiterator: bench_fp8's "kernels == torch path" checks it.)"""
    from weightsync.sources.quant import fp8 as fp8mod

    amax = torch.tensor([448.0 * 29.0 / 28.0, 1e-6, 3.0], dtype=torch.float32)
    sf, mult = fp8mod._scales_from_amax(amax, "vllm", None)
    assert torch.equal(mult.view(torch.int32), (1.0 / sf).view(torch.int32))
    # a tie: 29.0 lies halfway between e4m3's 28 and 30; round to nearest even gives 28
    x = torch.full((128, 128), 29.0, dtype=torch.float32)
    x[0, 0] = 448.0  # amax 448: sf = 1, 1/sf = 1 exactly, so x * (1/sf) = 29.0, a tie
    q, s = fp8mod.quantize_blocks(x)
    assert s.item() == 1.0 and q.float()[0, 1].item() == 28.0
    assert torch.equal(q.view(torch.uint8), (x * (1.0 / s)).to(torch.float8_e4m3fn).view(torch.uint8))
