"""Megatron MoE export (EP / EP x TP with ETP1 and ETP2 / PP, three expert formats) against
Megatron's own resharding: every rank saves with ``dist_checkpointing``, torch's DCP reader
assembles full tensors from megatron's shard metadata, and rank 0's export must equal them
(per_expert and fused), while other ranks yield nothing. Names/shapes come from transformers'
reversal (checked against ``save_pretrained`` in test_moe_names.py).
"""

from __future__ import annotations

import resource
import tempfile

import pytest
import torch
from fsdp_worlds import unpack
from worlds import errors_of
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _start_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (``clear_refs`` 5, Linux >= 4.0) and return the current RSS
    (KiB): the pass's growth is then its own peak, not one left by model construction or imports.
    Without ``clear_refs``: the process's lifetime peak (``ru_maxrss``), as before."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss_kib() -> int:
    try:
        return _status_kib("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _hf_config(family: str, *, layers: int, experts: int, hidden: int, moe_ffn: int, shared: int | None, dense_first: int = 0):
    from transformers import AutoConfig

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2)
    if family == "qwen2_moe":
        kw = dict(moe_intermediate_size=moe_ffn, shared_expert_intermediate_size=shared,
                  num_experts=experts, intermediate_size=40, mlp_only_layers=list(range(dense_first)))
    elif family == "qwen3_moe":
        kw = dict(moe_intermediate_size=moe_ffn, num_experts=experts, intermediate_size=40,
                  head_dim=hidden // 4, mlp_only_layers=list(range(dense_first)))
    elif family == "mixtral":
        kw = dict(intermediate_size=moe_ffn, num_local_experts=experts, head_dim=hidden // 4)
    elif family == "deepseek_v3":
        kw = dict(moe_intermediate_size=moe_ffn, n_routed_experts=experts, n_shared_experts=shared // moe_ffn,
                  n_group=2, topk_group=1, first_k_dense_replace=dense_first, intermediate_size=40,
                  q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    return AutoConfig.for_model(family, **common, **kw)


def _moe_layers(mcfg) -> list[int]:
    """1 where a layer of ``mcfg`` is MoE: ``moe_layer_freq`` as a list, or megatron's every-k-th rule."""
    f = mcfg.moe_layer_freq
    return list(f) if isinstance(f, (list, tuple)) else [int(i % f == 0) for i in range(mcfg.num_layers)]


def _knobs(shared, shared_gate, expert_bias) -> dict:
    """``TransformerConfig`` overrides for a scenario's knobs where they differ from the family's own
    mapping: a shared expert without its gate, or sigmoid routing with an expert bias."""
    out: dict = {}
    if shared and not shared_gate:
        out["moe_shared_expert_gate"] = False
    if expert_bias:
        out.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    return out


def _world(rank, world_size, *, ckpt, family, tp=1, pp=1, ep=1, etp=None, fmt="sequential", layers=2,
           experts=4, hidden=16, moe_ffn=12, shared=None, shared_gate=False, expert_bias=False,
           dense_first=0, layouts=("per_expert", "fused"), batch_bytes=None, measure_rss=False):
    from moe_megatron import build_gpt, init_parallel, megatron_checkpoint, moe_config

    import torch.distributed as dist
    from weightsync.sources.megatron.moe import MegatronMoEExporter
    from weightsync.sources.megatron.moe_storage import expert_format

    if measure_rss:
        # glibc otherwise serves freed multi-MiB blocks from a heap it does not trim, so peak RSS would
        # track allocator history instead of live bytes: mmap every block >= 128 KiB. Set here, not by
        # MALLOC_MMAP_THRESHOLD_: ranks are forked from a forkserver whose malloc started long ago.
        import ctypes

        M_MMAP_THRESHOLD = -3
        assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    freq = [0] * dense_first + [1] * (layers - dense_first)
    hf = _hf_config(family, layers=layers, experts=experts, hidden=hidden, moe_ffn=moe_ffn,
                    shared=shared, dense_first=dense_first)
    mcfg = moe_config(hf, tp=tp, pp=pp, ep=ep, etp=etp, expert_format=fmt, **_knobs(shared, shared_gate, expert_bias))
    assert _moe_layers(mcfg) == freq, (mcfg.moe_layer_freq, freq)
    model = build_gpt(hf, mcfg, expert_format=fmt)
    if not measure_rss:
        megatron_checkpoint(model, ckpt)
    moe_layers = [i for i in range(layers) if freq[i]]
    facts: dict = {"formats": sorted({expert_format(m.mlp.experts) for m in model.decoder.layers if hasattr(m.mlp, "router")})}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layout in layouts:
        ex = MegatronMoEExporter(model, hf, mcfg, expert_layout=layout,
                                 **({"expert_batch_bytes": batch_bytes} if batch_bytes else {}))
        declared = [e for lay in moe_layers for e in ex.entries(lay)]
        ex.exchange_coords()  # the one cached coordinate exchange: not part of the bounded pass
        rss0 = _start_peak_rss()
        ex.stats.start()
        got = []
        for lay in moe_layers:
            for name, t in ex.export(lay):
                got.append((name, tuple(t.shape), t.dtype, t.is_contiguous()))
                if not measure_rss:
                    facts.setdefault(layout, {})[name] = t.clone()
                del t
        ex.stats.stop()
        facts[f"{layout}_rss_growth_kib"] = _peak_rss_kib() - rss0
        facts[f"{layout}_declared"] = [(n, tuple(s), d) for n, s, d in declared]
        facts[f"{layout}_stream"] = got
        facts[f"{layout}_stats"] = ex.stats.as_dict()
    facts["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    dist.barrier()
    from fsdp_worlds import pack

    return pack(facts)


def _oracle(ckpt):
    from moe_megatron import load_full_checkpoint

    return load_full_checkpoint(ckpt)


def _ck(ck, suffix, layer):
    """One layer's tensor from megatron's checkpoint (per-layer keys, or layers stacked on dim 0)."""
    key = f"decoder.layers.{layer}.{suffix}"
    return ck[key] if key in ck else ck[f"decoder.layers.{suffix}"][layer]


def _expect(ck, hf, layer, spec_names, *, shared=False, gate=False, bias=False):
    """HF-named tensors of one layer, cut from megatron's full checkpoint tensors."""
    fc1 = _ck(ck, "mlp.experts.experts.linear_fc1.weight", layer)
    fc2 = _ck(ck, "mlp.experts.experts.linear_fc2.weight", layer)
    F = fc2.shape[-1]
    out = {spec_names["router"]: _ck(ck, "mlp.router.weight", layer)}
    if bias:
        out[spec_names["bias"]] = _ck(ck, "mlp.router.expert_bias", layer)
    for e in range(fc1.shape[0]):
        out[spec_names["expert"](e, "gate")] = fc1[e, :F]
        out[spec_names["expert"](e, "up")] = fc1[e, F:]
        out[spec_names["expert"](e, "down")] = fc2[e]
    if shared:
        s1 = _ck(ck, "mlp.shared_experts.linear_fc1.weight", layer)
        S = s1.shape[0] // 2
        out[spec_names["shared"][0]] = s1[:S]
        out[spec_names["shared"][1]] = s1[S:]
        out[spec_names["shared"][2]] = _ck(ck, "mlp.shared_experts.linear_fc2.weight", layer)
    if gate:
        out[spec_names["sgate"]] = _ck(ck, "mlp.shared_experts.gate_weight", layer)
    return out


def _expected_moe(ck, names, moe_layers) -> dict[str, torch.Tensor]:
    """Every MoE tensor of ``moe_layers`` cut from Megatron's own full checkpoint ``ck`` under the
    HF names (``HFMoENames``: transformers' reversal) -- no MegatronSource involved."""
    want: dict[str, torch.Tensor] = {}
    for lay in moe_layers:
        L = names.layer(lay)
        spec = dict(router=L.router[0], bias=L.router_bias and L.router_bias[0], expert=L.experts.expert_name,
                    shared=L.shared and [n for n, _ in L.shared], sgate=L.shared_gate and L.shared_gate[0])
        want.update(_expect(ck, None, lay, spec, shared=L.shared is not None, gate=L.shared_gate is not None,
                            bias=L.router_bias is not None))
    return want


def _check(res, ckpt, family, moe_layers, *, experts, **kw):
    from weightsync.sources.megatron.moe_names import HFMoENames

    ck = _oracle(ckpt)
    r0 = res[0]
    names = HFMoENames(_hf_config(family, **kw["hf"]))
    want = _expected_moe(ck, names, moe_layers)
    # per_expert: exactly megatron's tensors under HF names, in declared order, contiguous.
    got = r0["per_expert"]
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n].to(t.dtype), t), n
    assert [(n, s, d) for n, s, d, _ in r0["per_expert_stream"]] == r0["per_expert_declared"]
    assert all(c for *_, c in r0["per_expert_stream"])
    # fused: gate_up[e] == [gate_e; up_e], down[e] == down_e, every other tensor identical.
    if "fused" in r0:
        fz = r0["fused"]
        assert [(n, s, d) for n, s, d, _ in r0["fused_stream"]] == r0["fused_declared"]
        for lay in moe_layers:
            spec = names.layer(lay).experts
            gu, dn = fz[spec.fused_gate_up], fz[spec.fused_down]
            assert tuple(gu.shape) == (experts, 2 * spec.intermediate, spec.hidden)
            for e in range(experts):
                assert torch.equal(gu[e], torch.cat([want[spec.expert_name(e, "gate")], want[spec.expert_name(e, "up")]]))
                assert torch.equal(dn[e], want[spec.expert_name(e, "down")])
        rest = {n for n in want if ".experts." not in n}
        assert all(torch.equal(fz[n], want[n]) for n in rest)
    for r, facts in res.items():
        assert facts["unchanged"], f"rank {r} mutated its model"
        if r:
            assert facts["per_expert_stream"] == [], f"rank {r} yielded tensors"
            assert "per_expert" not in facts
    return r0


def test_ep2_sequential_shared_expert_gate_qwen2_moe():
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=2, experts=4, hidden=16, moe_ffn=12, shared=20)
    res = run_world(_world, 2, ckpt=ckpt, family="qwen2_moe", ep=2, shared_gate=True, **kw)
    assert res[0]["formats"] == ["sequential"]
    r0 = _check(res, ckpt, "qwen2_moe", [0, 1], experts=4, hf=kw)
    # fused wire: 2 tensors per layer instead of 3E
    assert r0["fused_stats"]["tensors"] < r0["per_expert_stats"]["tensors"]


def test_tp2_ep2_etp1_deepseek_bias_shared_first_dense():
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=3, experts=4, hidden=16, moe_ffn=12, shared=12, dense_first=1)
    res = run_world(_world, 4, ckpt=ckpt, family="deepseek_v3", tp=2, ep=2, etp=1, expert_bias=True,
                    timeout=300, **kw)
    r0 = _check(res, ckpt, "deepseek_v3", [1, 2], experts=4, hf=kw)
    assert r0["per_expert"]["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_tp2_ep2_etp2_legacy_grouped_qwen3_moe():
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=2, experts=4, hidden=16, moe_ffn=12, shared=None)
    res = run_world(_world, 4, ckpt=ckpt, family="qwen3_moe", tp=2, ep=2, etp=2, fmt="grouped",
                    timeout=300, **kw)
    assert res[0]["formats"] == ["grouped"]
    _check(res, ckpt, "qwen3_moe", [0, 1], experts=4, hf=kw)


def test_pp2_ep2_sequential_mixtral():
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=4, experts=4, hidden=16, moe_ffn=12, shared=None)
    res = run_world(_world, 4, ckpt=ckpt, family="mixtral", pp=2, ep=2, timeout=300, **kw)
    r0 = _check(res, ckpt, "mixtral", [0, 1, 2, 3], experts=4, hf=kw)
    assert "model.layers.3.block_sparse_moe.experts.3.w3.weight" in r0["per_expert"]
    assert "model.layers.3.block_sparse_moe.experts.w13" in r0["fused"]


def test_te_grouped_names_map_to_the_same_pieces():
    """TE is not installed: TEGroupedMLP's storage (linear_fc{1,2}.weight{j}) is checked by name."""
    from weightsync.sources.megatron.moe_storage import expert_format, local_expert_weights, megatron_moe_suffixes

    class _Lin(torch.nn.Module):
        def __init__(self, shapes):
            super().__init__()
            for j, s in enumerate(shapes):
                self.register_parameter(f"weight{j}", torch.nn.Parameter(torch.randn(*s)))

    class TEGroupedMLP(torch.nn.Module):
        num_local_experts = 2

        def __init__(self):
            super().__init__()
            self.linear_fc1 = _Lin([(24, 16)] * 2)
            self.linear_fc2 = _Lin([(16, 12)] * 2)

    m = TEGroupedMLP()
    assert expert_format(m) == "te_grouped"
    fc1, fc2 = local_expert_weights(m, 1, 16)
    assert fc1 is m.linear_fc1.weight1 and fc2 is m.linear_fc2.weight1
    names = {f"mlp.experts.{n}" for n, _ in m.named_parameters()}
    claimed = set(megatron_moe_suffixes(2, "te_grouped"))
    # the weights, and (absent here) the biases add_bias_linear would give the experts and the router
    assert names == {n for n in claimed if not n.endswith(("bias0", "bias1", "router.bias"))}
    assert claimed - names == {"mlp.router.bias"} | {f"mlp.experts.linear_fc{k}.bias{j}" for k in (1, 2) for j in (0, 1)}


def test_per_expert_never_materializes_a_layer():
    """Rank 0's peak RSS growth over a pass (the OS's number, not ours) stays far below one layer's
    experts with a 1-expert batch bound, and exceeds a third of a layer when the bound is lifted (so the
    test can fail)."""
    kw = dict(layers=1, experts=16, hidden=512, moe_ffn=1024, shared=None)
    per_expert = 3 * 512 * 1024 * 4  # 6 MiB of fp32 per expert
    layer_kib = 16 * per_expert // 1024  # 96 MiB
    # (the world sets glibc's mmap threshold to 128 KiB: see _world)
    small = run_world(_world, 2, ckpt="", family="qwen3_moe", ep=2, layouts=("per_expert",),
                      batch_bytes=per_expert, measure_rss=True, timeout=400, **kw)[0]
    big = run_world(_world, 2, ckpt="", family="qwen3_moe", ep=2, layouts=("per_expert",),
                    batch_bytes=64 * per_expert, measure_rss=True, timeout=400, **kw)[0]
    # rank 0 holds experts 0-7 itself (yielded as views) and receives experts 8-15 (48 MiB)
    assert small["per_expert_rss_growth_kib"] < layer_kib // 4, small["per_expert_rss_growth_kib"]
    assert big["per_expert_rss_growth_kib"] > layer_kib // 3, big["per_expert_rss_growth_kib"]
    assert small["per_expert_stats"]["peak_extra_bytes"] <= 2 * per_expert


# ---- MegatronSource on MoE models (the exporter wired in): one world per scenario ------------------


def _source_world(rank, world_size, *, ckpt, family, tp=1, pp=1, ep=1, etp=None, layers=2, experts=4,
                  hidden=16, moe_ffn=12, shared=None, shared_gate=False, dense_first=0):
    """Sharded MegatronSource (per_expert and fused) + its errors, then the same weights resharded to
    TP1/PP1/EP1 by megatron's dist_checkpointing and exported again, in one world."""
    import torch.distributed as dist
    from moe_megatron import build_gpt, init_parallel, megatron_checkpoint, megatron_load, moe_config

    from weightsync.sources import MegatronSource

    freq = [0] * dense_first + [1] * (layers - dense_first)
    hf = _hf_config(family, layers=layers, experts=experts, hidden=hidden, moe_ffn=moe_ffn, shared=shared,
                    dense_first=dense_first)
    if family == "qwen2_moe":
        hf.mlp_only_layers = list(range(dense_first))
        hf.shared_expert_intermediate_size = shared

    def mcfg_at(tp, pp, ep, etp):
        mcfg = moe_config(hf, tp=tp, pp=pp, ep=ep, etp=etp, **_knobs(shared, shared_gate, False))
        assert _moe_layers(mcfg) == freq, (mcfg.moe_layer_freq, freq)
        return mcfg

    init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    mcfg = mcfg_at(tp, pp, ep, etp)
    model = build_gpt(hf, mcfg)
    megatron_checkpoint(model, ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    facts: dict = {}
    src = MegatronSource(model, hf_config=hf)
    facts["moe_layers"] = src.moe_layers
    facts["meta"] = [(m.name, tuple(m.shape), str(m.dtype), m.owners) for m in src.metadata]
    got = {n: t.clone() for n, t in src.iter_full()}
    facts["stats"] = src.last_pass.as_dict()
    facts["second_pass_same"] = all(torch.equal(got[n], t) for n, t in src.iter_full())  # fresh pass per call
    fused_src = MegatronSource(model, hf_config=hf, expert_layout="fused", expert_batch_bytes=1)
    fused = {n: t.clone() for n, t in fused_src.iter_full()}
    facts["fused_meta"] = [(m.name, tuple(m.shape)) for m in fused_src.metadata]
    # the wire-dtype policy every source shares: compared with FSDPSource's in the parent
    facts["bf16_meta"] = [(m.name, str(m.dtype)) for m in MegatronSource(model, hf_config=hf, dtype=torch.bfloat16).metadata]
    facts["local"] = errors_of(lambda: MegatronSource(model, hf_config=hf, mode="local"))
    # A DeepseekV3 hf_config describes multi-head latent attention; this model's attention is a fused
    # linear_qkv, which no DeepseekV3 checkpoint can hold (MLA models: test_mla_megatron.py).
    mla = _hf_config("deepseek_v3", layers=layers, experts=experts, hidden=hidden, moe_ffn=moe_ffn,
                     shared=moe_ffn, dense_first=dense_first)
    facts["mla"] = errors_of(lambda: MegatronSource(model, hf_config=mla))
    facts["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    dist.barrier()
    # Megatron's own resharding: the same checkpoint loaded at TP1/PP1/EP1 on every rank.
    init_parallel()
    flat = build_gpt(hf, mcfg_at(1, 1, 1, None), seed=77)
    fresh = {n: t.clone() for n, t in MegatronSource(flat, hf_config=hf).iter_full()}
    megatron_load(flat, ckpt)
    ref = {n: t.clone() for n, t in MegatronSource(flat, hf_config=hf).iter_full()}
    if rank == 0:
        facts["got"], facts["fused"], facts["ref"] = got, fused, ref
        facts["load_changed"] = sum(not torch.equal(fresh[n], ref[n]) for n in ref)
    else:
        facts["yielded"] = len(got) + len(fused) + len(ref) + len(fresh)
    dist.barrier()
    from fsdp_worlds import pack

    return pack(facts)


def _saved_pretrained(hf, tmp) -> dict[str, tuple[int, ...]]:
    """Names and shapes that transformers' ``save_pretrained`` writes for a tiny model of ``hf``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp)
    out = {}
    import glob

    for f in glob.glob(f"{tmp}/*.safetensors"):
        with safe_open(f, "pt") as fh:
            out.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return out


def _check_same_wire_dtypes_as_fsdp(res, hf):
    """MegatronSource and FSDPSource over the same MoE model (fp32 in memory) at dtype=bfloat16
    declare identical names and dtypes: routers, shared-expert gate and expert bias stay fp32."""
    from transformers import AutoModelForCausalLM

    from weightsync.sources import FSDPSource

    fsdp = FSDPSource(AutoModelForCausalLM.from_config(hf), dtype=torch.bfloat16, rank=0)
    want = {m.name: str(m.dtype) for m in fsdp.metadata}
    for r in res:
        got = dict(res[r]["bf16_meta"])
        assert len(got) == len(res[r]["bf16_meta"])
        assert got == want, (r, {n: (got.get(n), want.get(n)) for n in set(got) | set(want) if got.get(n) != want.get(n)})
    kept = sorted(n for n, d in want.items() if d == "torch.float32")
    routers = [n for n in want if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
    assert routers and set(routers) <= set(kept), kept
    assert all(n.endswith(("gate.weight", "shared_expert_gate.weight", "e_score_correction_bias")) for n in kept), kept
    if hf.model_type == "qwen2_moe":
        assert any(n.endswith("shared_expert_gate.weight") for n in kept), kept


def _check_source(res, ckpt, tmp, family, moe_layers, **kw):
    from weightsync.sources.megatron.moe_names import HFMoENames

    r0 = res[0]
    assert r0["moe_layers"] == moe_layers
    hf = _hf_config(family, **kw)
    if family == "qwen2_moe":
        hf.mlp_only_layers = list(range(kw.get("dense_first", 0)))
    # metadata: identical on every rank, every tensor owned by rank 0 == save_pretrained names/shapes
    assert all(res[r]["meta"] == r0["meta"] for r in res)
    assert all(o == (0,) for *_, o in r0["meta"])
    meta = {n: s for n, s, _, _ in r0["meta"]}
    assert len(meta) == len(r0["meta"])
    assert meta == _saved_pretrained(hf, tmp)
    _check_same_wire_dtypes_as_fsdp(res, hf)
    # rank 0's stream: metadata order, names, shapes
    got, fused, ref = r0["got"], r0["fused"], r0["ref"]
    assert list(got) == [n for n, *_ in r0["meta"]]
    assert list(fused) == [n for n, _ in r0["fused_meta"]]
    # MoE tensors == megatron's dist_checkpointing full tensors cut under HF names (no MegatronSource)
    ck = _oracle(ckpt)
    names = HFMoENames(hf)
    want = _expected_moe(ck, names, moe_layers)
    assert len(want) > 0 and all(n in got for n in want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # every tensor (attention, norms, dense MLPs, embeddings too) == the export of the same weights
    # resharded by megatron to TP1/PP1/EP1; and the load really changed the freshly built model
    assert sorted(got) == sorted(ref)
    bad = [n for n in got if not torch.equal(got[n], ref[n])]
    assert bad == []
    assert r0["load_changed"] == len(ref)  # the comparison is not vacuous
    # fused layout: same non-expert tensors, experts stacked gate-first
    for lay in moe_layers:
        spec = names.layer(lay).experts
        for e in range(spec.num_experts):
            gu = fused[spec.fused_gate_up][e]
            assert torch.equal(gu, torch.cat([got[spec.expert_name(e, "gate")], got[spec.expert_name(e, "up")]]))
            assert torch.equal(fused[spec.fused_down][e], got[spec.expert_name(e, "down")])
    assert all(torch.equal(fused[n], got[n]) for n in fused if n in got)
    for r, f in res.items():
        assert f["unchanged"], f"rank {r} mutated its model"
        assert f["second_pass_same"]
        assert f["local"].startswith("NotImplementedError") and f"rank {r}" in f["local"]
        assert str(moe_layers) in f["local"]
        assert f["mla"].startswith("UnmappedParameterError") and f"rank {r}" in f["mla"]
        assert "multi_latent_attention=False" in f["mla"] and "q_lora_rank" in f["mla"]
        if r:
            assert f["yielded"] == 0, f"rank {r} yielded tensors"
            assert f["stats"]["tensors"] == 0 and f["stats"]["bytes_received"] == 0
    return r0


def test_source_ep2_qwen3_moe_sequential(tmp_path):
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=2, experts=4, hidden=16, moe_ffn=12, shared=None)
    res = run_world(_source_world, 2, ckpt=ckpt, family="qwen3_moe", ep=2, timeout=300, **kw)
    r0 = _check_source(res, ckpt, str(tmp_path), "qwen3_moe", [0, 1], **kw)
    assert "model.layers.1.self_attn.q_norm.weight" in r0["got"]
    # EP2 at TP1: rank 1 is outside rank 0's dense replica but sends its experts (2 per layer x 2 layers)
    assert res[1]["stats"]["collectives"] > 0


def test_source_tp2_ep2_qwen2_moe_shared_first_dense(tmp_path):
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=3, experts=4, hidden=16, moe_ffn=12, shared=20, dense_first=1)
    res = run_world(_source_world, 4, ckpt=ckpt, family="qwen2_moe", tp=2, ep=2, etp=1, shared_gate=True,
                    timeout=400, **kw)
    r0 = _check_source(res, ckpt, str(tmp_path), "qwen2_moe", [1, 2], **kw)
    assert "model.layers.0.mlp.gate_proj.weight" in r0["got"]  # the dense first layer
    assert "model.layers.1.mlp.shared_expert_gate.weight" in r0["got"]
    assert "model.layers.0.self_attn.q_proj.bias" in r0["got"]


def test_source_pp2_ep2_mixtral_all_moe(tmp_path):
    """PP2 x EP2: rank 0's stage sends nothing of stage 1, whose experts live on ranks 2 and 3;
    an all-MoE model never builds a dense MLP, so Mixtral's intermediate_size (the expert size) is
    not compared with ffn_hidden_size."""
    ckpt = tempfile.mkdtemp()
    kw = dict(layers=4, experts=4, hidden=16, moe_ffn=12, shared=None)
    res = run_world(_source_world, 4, ckpt=ckpt, family="mixtral", pp=2, ep=2, timeout=400, **kw)
    r0 = _check_source(res, ckpt, str(tmp_path), "mixtral", [0, 1, 2, 3], **kw)
    assert "model.layers.3.block_sparse_moe.experts.3.w2.weight" in r0["got"]
    assert all(res[r]["stats"]["collectives"] > 0 for r in (1, 2, 3))
