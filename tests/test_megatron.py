"""MegatronSource on CPU gloo worlds: layout vs transformers, gather vs Megatron's own resharding,
who does what under TP / PP / VPP / DP, and vLLM's NCCL trainer engine on non-sender ranks.

Oracles: ``save_pretrained`` of the same transformers config (names, shapes, dtypes, bytes);
Megatron's own modules on CPU (``get_query_key_value_tensors`` after q/k norm, the MLP, the norm,
the vocab-parallel embedding) versus transformers' modules loaded with the exported tensors;
``dist_checkpointing`` save at TP2/PP2 and PP2xVPP2, load at TP1; vLLM's ``_checked_iter`` and
``NCCLTrainerWeightTransferEngine.trainer_init`` / ``send_weights`` (non-sender side, which runs on
CPU). One world per scenario; each returns facts asserted here.
"""

from __future__ import annotations


import pytest
import torch

import megatron_worlds as mw
from worlds import CONTEXT, run_world

pytestmark = pytest.mark.slow


def _exported(src) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in src.iter_full()}


def _mismatch(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bytes, dtype or shape), or are missing on one side."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def _meta_rows(src) -> list:
    return [(m.name, str(m.dtype), tuple(m.shape), m.owners, m.mesh_shape, m.placements) for m in src.metadata]


# ---- world 1: every family against save_pretrained and Megatron's own modules --------------------


def _rank_families(rank, world_size, tmp):
    from weightsync.sources import MegatronSource

    facts = {}
    for fam, tied in [("llama", False), ("qwen2", False), ("qwen3", False), ("mistral", False), ("llama", True)]:
        key = fam + ("-tied" if tied else "")
        cfg = mw.hf_config(fam, tied=tied)
        saved = mw.saved_checkpoint(mw.hf_model(cfg), f"{tmp}/{key}")
        mw.init_parallel(1, 1)
        model = mw.megatron_model(cfg)
        mw.import_hf(model, saved, cfg)
        with mw.count_comm() as comm:
            src = MegatronSource(model, hf_config=cfg)
            meta = src.metadata
        out = _exported(src)
        bf16 = _exported(MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16))
        # Megatron's own modules on its random init (norms/biases randomized): no importer involved.
        mw.init_parallel(1, 1, seed=99)
        rand = mw.megatron_model(cfg)
        mw.randomize_norms_and_biases(rand)
        rand_out = _exported(MegatronSource(rand, hf_config=cfg))
        facts[key] = dict(
            meta={m.name: (m.dtype, m.shape, m.owners) for m in meta},
            saved={n: (t.dtype, tuple(t.shape)) for n, t in saved.items()},
            order=list(out) == [m.name for m in meta],
            bytes=_mismatch(out, saved),
            bf16=_mismatch(bf16, {n: t.to(torch.bfloat16) for n, t in saved.items()}),
            meta_comm=dict(comm),
            modules=mw.hf_module_mismatches(cfg, rand_out, [mw.megatron_module_outputs(rand, cfg)], tp=1),
        )
    return facts


def test_every_family_matches_save_pretrained_and_megatron_modules(tmp_path):
    facts = run_world(_rank_families, 1, timeout=400, tmp=str(tmp_path))[0]
    for key, f in facts.items():
        assert {n: (d, s) for n, (d, s, _) in f["meta"].items()} == f["saved"], key
        assert all(o == (0,) for _, _, o in f["meta"].values()), key
        assert f["order"], key
        assert f["bytes"] == [], (key, f["bytes"])
        assert f["bf16"] == [], (key, f["bf16"])
        assert f["meta_comm"] == {}, (key, f["meta_comm"])
        assert f["modules"] == [], (key, f["modules"])
    assert "lm_head.weight" not in facts["llama-tied"]["meta"]
    assert "model.layers.0.self_attn.q_proj.bias" in facts["qwen2"]["meta"]
    assert facts["qwen3"]["meta"]["model.layers.0.self_attn.q_norm.weight"][1] == (32,)


# ---- world 4: TP2 x DP2 -----------------------------------------------------------------------------


class _NoClient:
    """A non-sender never touches the client; calling it is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"non-sender rank called client.{name}")


def _rank_tp2_dp2(rank, world_size, tmp):
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from weightsync.sources import MegatronSource

    facts: dict = {}
    # qwen2: qkv bias; vocab 250 padded to 256 at tp2 -> shard 1 holds 122 real rows (not a chunk).
    cfg = mw.hf_config("qwen2")
    saved = mw.shared_checkpoint(cfg, f"{tmp}/qwen2")
    mw.init_parallel(2, 1)
    model = mw.megatron_model(cfg)
    mw.import_hf(model, saved, cfg)
    with mw.count_comm() as comm:
        src = MegatronSource(model, hf_config=cfg)
        facts["meta_rows"] = _meta_rows(src)
    facts["meta_comm"] = dict(comm)
    sharded = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]
    facts["tp_params"] = len(sharded)
    facts["max_shard_bytes"] = max(p.numel() * p.element_size() for p in model.parameters())
    with mw.count_comm() as comm:
        out = _exported(src)
    facts["pass_comm"] = dict(comm)
    facts["stats"] = src.last_pass.as_dict()
    if rank == 0:
        facts["bytes"] = _mismatch(out, saved)
    facts["yielded"] = len(out)
    # Cast before gather: bf16 wire moves half the bytes.
    src16 = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16)
    out16 = _exported(src16)
    facts["stats16"] = src16.last_pass.as_dict()
    if rank == 0:
        facts["bytes16"] = _mismatch(out16, {n: t.to(torch.bfloat16) for n, t in saved.items()})
    # vLLM's NCCL trainer engine: non-senders build it and drive send_weights(); rank 0 drains
    # vLLM's own metadata-checked iterator (the broadcast itself needs a GPU).
    if rank == 0:
        facts["vllm_sender"] = {n: t.clone() for n, t in NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata)}
        facts["vllm_sender"] = _mismatch(facts["vllm_sender"], saved)
    else:
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=rank)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=_NoClient(), source=src)
        engine.send_weights()
        facts["vllm_nonsender_stats"] = src.last_pass.as_dict()
    # Megatron's own modules at TP2 (heads split across ranks) vs transformers on the export.
    mw.init_parallel(2, 1, seed=5)
    rand = mw.megatron_model(cfg)
    mw.randomize_norms_and_biases(rand)
    rand_out = _exported(MegatronSource(rand, hf_config=cfg))
    outs = mw.megatron_module_outputs(rand, cfg)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, outs)
    if rank == 0:
        facts["modules"] = mw.hf_module_mismatches(cfg, rand_out, everyone[:2], tp=2)
    # iter_local: pieces concatenated per placements equal iter_full; vocab 250/256 falls back.
    local = MegatronSource(model, hf_config=cfg, mode="local")
    facts["local_meta"] = _meta_rows(local)
    rebuilt = mw.gather_local_pieces(local)
    facts["local_stats"] = local.last_pass.as_dict()
    if rank == 0:
        facts["local_vs_full"] = _mismatch(rebuilt, out)
    # A vocabulary whose trimmed shards ARE torch.chunk pieces: 255 rows padded to 256.
    cfg2 = mw.hf_config("llama", vocab=255)
    m2 = mw.megatron_model(cfg2, divisible_by=1)
    mw.randomize_norms_and_biases(m2)
    full2 = _exported(MegatronSource(m2, hf_config=cfg2))
    local2 = MegatronSource(m2, hf_config=cfg2, mode="local")
    facts["local2_meta"] = _meta_rows(local2)
    rebuilt2 = mw.gather_local_pieces(local2)
    if rank == 0:
        facts["local2_vs_full"] = _mismatch(rebuilt2, full2)
    return facts


def test_tp2_dp2_gathers_to_sender_only(tmp_path):
    from vllm.distributed.weight_transfer.base import Shard

    f = run_world(_rank_tp2_dp2, 4, timeout=500, tmp=str(tmp_path))
    # metadata: identical everywhere, no communication
    assert all(f[r]["meta_rows"] == f[0]["meta_rows"] for r in f)
    assert all(f[r]["meta_comm"] == {} for r in f)
    # exported bytes = save_pretrained, in fp32 and cast to bf16, also through vLLM's checked iterator
    assert f[0]["bytes"] == [] and f[0]["bytes16"] == [] and f[0]["vllm_sender"] == []
    assert f[0]["yielded"] == len(f[0]["meta_rows"])
    # non-sender TP peer: sends one message per TP-sharded parameter, yields and holds no full tensor
    s1 = f[1]["stats"]
    assert f[1]["yielded"] == 0 and s1["tensors"] == 0 and s1["bytes_received"] == 0
    assert s1["collectives"] == f[1]["tp_params"] == f[1]["pass_comm"].get("isend") and len(f[1]["pass_comm"]) == 1
    assert s1["peak_extra_bytes"] == 0  # fp32 shards are sent in place
    assert 0 < f[1]["stats16"]["peak_extra_bytes"] <= f[1]["max_shard_bytes"] // 2
    # the sender receives exactly those messages; bf16 halves the bytes it receives
    s0 = f[0]["stats"]
    assert s0["collectives"] == f[0]["pass_comm"].get("irecv") == f[1]["tp_params"]
    assert f[0]["stats16"]["bytes_received"] * 2 == s0["bytes_received"] > 0
    # the other data-parallel replica does nothing at all (after the first pass's metadata check)
    for r in (2, 3):
        assert f[r]["yielded"] == 0 and f[r]["stats"]["collectives"] == 0
        assert f[r]["stats"]["tensors"] == 0 and f[r]["stats"]["bytes_received"] == 0
        assert f[r]["pass_comm"] == {}  # not even the metadata check uses a process group
    # vLLM NCCL engine on non-senders: same work as a plain pass
    assert f[1]["vllm_nonsender_stats"]["collectives"] == f[1]["tp_params"]
    assert f[2]["vllm_nonsender_stats"]["collectives"] == 0
    # Megatron's own attention/MLP/norm/embedding at TP2 agree with transformers on the export
    assert f[0]["modules"] == []
    # iter_local: concatenation per placements == iter_full, no communication but the fallback
    assert f[0]["local_vs_full"] == [] and f[0]["local2_vs_full"] == []
    lm = {row[0]: row for row in f[0]["local_meta"]}
    assert lm["model.layers.0.self_attn.q_proj.weight"][3:] == ((0, 1), (2,), (Shard(0),))
    assert lm["model.layers.0.self_attn.k_proj.bias"][3:] == ((0, 1), (2,), (Shard(0),))
    assert lm["model.layers.0.mlp.up_proj.weight"][3:] == ((0, 1), (2,), (Shard(0),))
    assert lm["model.layers.0.self_attn.o_proj.weight"][3:] == ((0, 1), (2,), (Shard(1),))
    assert lm["model.layers.0.mlp.down_proj.weight"][3:] == ((0, 1), (2,), (Shard(1),))
    assert lm["model.norm.weight"][3:] == ((0, 1), (2,), None)
    assert lm["model.embed_tokens.weight"][3:] == ((0,), (1,), None)  # 250 in 2x128: not a chunk
    assert f[1]["local_stats"]["collectives"] == 2  # embed + lm_head rows to their single owner
    lm2 = {row[0]: row for row in f[0]["local2_meta"]}
    assert lm2["model.embed_tokens.weight"][3:] == ((0, 1), (2,), (Shard(0),))  # 255 in 2x128
    for r in (2, 3):
        assert f[r]["local_stats"]["tensors"] == 0 and f[r]["local_stats"]["collectives"] == 0


# ---- world 2: PP2, tied embeddings --------------------------------------------------------------


def _rank_pp2_tied(rank, world_size, tmp):
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from weightsync.sources import MegatronSource

    facts: dict = {}
    cfg = mw.hf_config("llama", tied=True)
    saved = mw.shared_checkpoint(cfg, f"{tmp}/llama")
    mw.init_parallel(1, 2)
    model = mw.megatron_model(cfg)
    mw.import_hf(model, saved, cfg)
    src = MegatronSource(model, hf_config=cfg)
    facts["meta_rows"] = _meta_rows(src)
    out = _exported(src)
    facts["stats"] = src.last_pass.as_dict()
    facts["n_params"] = sum(1 for _ in model.named_parameters())
    facts["has_output_copy"] = any(n == "output_layer.weight" for n, _ in model.named_parameters())
    if rank == 0:
        facts["bytes"] = _mismatch(out, saved)
        facts["stage1_bytes"] = sum(
            t.numel() * t.element_size() for n, t in saved.items()
            if n == "model.norm.weight" or any(n.startswith(f"model.layers.{i}.") for i in (2, 3))
        )
    # The last stage's output_layer copy of the tied embedding is never read: corrupt it.
    if rank == 1:
        with torch.no_grad():
            model.output_layer.weight.fill_(float("nan"))
    again = _exported(src)
    if rank == 0:
        facts["copy_ignored"] = _mismatch(again, saved)
    # Non-sender through vLLM's NCCL trainer engine.
    if rank == 1:
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=1)
        NCCLTrainerWeightTransferEngine.trainer_init(info, client=_NoClient(), source=src).send_weights()
        facts["vllm_stats"] = src.last_pass.as_dict()
    else:
        facts["vllm_sender"] = _mismatch(dict(NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata)), saved)
    # Local mode under PP: owners are each stage's ranks, so NCCL broadcast must refuse it.
    local = MegatronSource(model, hf_config=cfg, mode="local")
    facts["local_meta"] = _meta_rows(local)
    try:
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=rank)
        NCCLTrainerWeightTransferEngine.trainer_init(info, client=_NoClient(), source=local)
        facts["nccl_local"] = "accepted"
    except (ValueError, TypeError) as e:
        facts["nccl_local"] = str(e)
    rebuilt = mw.gather_local_pieces(local)
    if rank == 0:
        facts["local_vs_full"] = _mismatch(rebuilt, out)
    return facts


def test_pp2_tied_brings_every_stage_to_rank0(tmp_path):
    f = run_world(_rank_pp2_tied, 2, timeout=400, tmp=str(tmp_path))
    assert f[0]["meta_rows"] == f[1]["meta_rows"]
    assert f[0]["bytes"] == [] and f[0]["copy_ignored"] == [] and f[0]["vllm_sender"] == []
    assert "lm_head.weight" not in {row[0] for row in f[0]["meta_rows"]}
    assert f[1]["has_output_copy"]  # Megatron keeps a tied copy on the last stage ...
    # ... and stage 1 sends each of its other parameters once, whole (tp=1), to rank 0
    assert f[1]["stats"]["collectives"] == f[1]["n_params"] - 1 == f[0]["stats"]["collectives"]
    assert f[1]["stats"]["tensors"] == 0 and f[1]["stats"]["peak_extra_bytes"] == 0
    assert f[0]["stats"]["bytes_received"] == f[0]["stage1_bytes"]
    assert f[1]["vllm_stats"]["collectives"] == f[1]["stats"]["collectives"]
    owners = {row[0]: row[3] for row in f[0]["local_meta"]}
    assert owners["model.layers.0.self_attn.q_proj.weight"] == (0,)
    assert owners["model.layers.3.self_attn.q_proj.weight"] == (1,)
    assert owners["model.norm.weight"] == (1,)
    for r in (0, 1):
        assert "does not implement iter_full()" in f[r]["nccl_local"], f[r]["nccl_local"]
    assert f[0]["local_vs_full"] == []


# ---- Megatron's own resharding: dist_checkpointing at TP2xPP2 and PP2xVPP2, loaded at TP1 ---------


def _rank_reshard(rank, world_size, tp, pp, vpp, family, tmp):
    from weightsync.sources import MegatronSource

    facts: dict = {}
    cfg = mw.hf_config(family, layers=8 if vpp else 4)
    mw.init_parallel(tp, pp, vpp, seed=11 + rank)
    model = mw.megatron_model(cfg)
    mw.randomize_norms_and_biases(model)
    src = MegatronSource(model, hf_config=cfg)
    sharded = _exported(src)
    facts["stats"] = src.last_pass.as_dict()
    facts["tp_params"] = sum(
        1 for c in mw.chunk_list(model) for _, p in c.named_parameters() if getattr(p, "tensor_model_parallel", False)
    )
    facts["n_params"] = sum(1 for c in mw.chunk_list(model) for _ in c.named_parameters())
    local = mw.gather_local_pieces(MegatronSource(model, hf_config=cfg, mode="local"))
    mw.dcp_save(model, tmp)
    # Same world, re-initialised at TP1/PP1: every rank loads the whole model (DP = world size).
    mw.init_parallel(1, 1, seed=1000 + rank)
    flat = mw.megatron_model(cfg)
    before = _exported(MegatronSource(flat, hf_config=cfg))
    mw.dcp_load(flat, tmp)
    flat_src = MegatronSource(flat, hf_config=cfg)
    ref = _exported(flat_src)
    facts["flat_stats"] = flat_src.last_pass.as_dict()
    if rank == 0:
        facts["vs_dcp"] = _mismatch(sharded, ref)
        facts["local_vs_dcp"] = _mismatch(local, ref)
        facts["n"] = len(ref)
        facts["loaded"] = len(_mismatch(before, ref))  # the load really replaced the weights
    return facts


@pytest.mark.parametrize(
    "world,tp,pp,vpp,family",
    [(4, 2, 2, None, "qwen2"), (2, 1, 2, 2, "qwen3")],
    ids=["tp2xpp2", "pp2xvpp2"],
)
def test_export_equals_megatron_dist_checkpointing_reshard(tmp_path, world, tp, pp, vpp, family):
    (tmp_path / "ckpt").mkdir()
    f = run_world(_rank_reshard, world, timeout=500, tp=tp, pp=pp, vpp=vpp, family=family, tmp=str(tmp_path / "ckpt"))
    assert f[0]["vs_dcp"] == [] and f[0]["local_vs_dcp"] == []
    assert f[0]["loaded"] == f[0]["n"]  # every tensor changed by the load: the comparison is not vacuous
    # at TP1 every other rank is a data-parallel replica: nothing at all
    for r in range(1, world):
        assert f[r]["flat_stats"]["collectives"] == 0 and f[r]["flat_stats"]["tensors"] == 0
    # sharded pass: each non-sender sends each of its parameters it holds a needed piece of, once
    for r in range(1, world):
        s = f[r]["stats"]
        assert s["tensors"] == 0 and s["bytes_received"] == 0 and s["peak_extra_bytes"] == 0
        assert 0 < s["collectives"] <= f[r]["n_params"]
    assert f[0]["stats"]["collectives"] == sum(f[r]["stats"]["collectives"] for r in range(1, world))


# ---- the loopback engine (weightsync.plugins.loopback) end to end, TP2 x PP2 -------------------


def _hf_receiver(family: str):
    return mw.hf_model(mw.hf_config(family), seed=1)  # differs from the trainer's seed-0 weights


def _rank_loopback(rank, world_size, url, port, family, tmp):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.sources import MegatronSource

    cfg = mw.hf_config(family)
    saved = mw.shared_checkpoint(cfg, f"{tmp}/hf", seed=0)
    mw.init_parallel(2, 2)
    model = mw.megatron_model(cfg)
    mw.import_hf(model, saved, cfg)
    src = MegatronSource(model, hf_config=cfg)
    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=120)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=ReceiverClient(url), source=src)
    engine.send_weights()
    return {"stats": src.last_pass.as_dict()}


def test_loopback_engine_delivers_megatron_tp2_pp2(tmp_path):
    import functools
    import hashlib

    from weightsync.plugins.loopback.receiver import start_receiver_process

    family = "qwen3"
    client, handle = start_receiver_process(functools.partial(_hf_receiver, family), mp_context=CONTEXT)
    with handle:
        before = client.weight_digests()

        f = run_world(_rank_loopback, 4, timeout=400, url=handle.url, port=0, family=family, tmp=str(tmp_path))
        after = client.weight_digests()
        ids = [[1, 5, 9, 200], [7, 3, 249, 0]]
        rlogits, _ = client.logits(ids)
    trainer = mw.hf_model(mw.hf_config(family), seed=0)  # the weights imported into Megatron
    want = {
        n: hashlib.sha256(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        for n, p in trainer.named_parameters()
    }
    assert before != after
    assert after == {n: want[n] for n in after} and set(after) == set(want)
    with torch.no_grad():
        assert torch.equal(rlogits, trainer(input_ids=torch.tensor(ids)).logits.float())
    assert f[0]["stats"]["tensors"] == len(want)
    assert all(f[r]["stats"]["tensors"] == 0 and f[r]["stats"]["collectives"] > 0 for r in (1, 2, 3))


# ---- bad input: raised at construction on every rank, naming rank / parameter / difference ------


def _rank_bad_input(rank, world_size, tmp):
    import transformers as tf

    from weightsync.sources import MegatronSource

    def catch(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    facts: dict = {}
    mw.init_parallel(2, 1)
    cfg = mw.hf_config("llama")
    model = mw.megatron_model(cfg)
    # unknown architecture
    gpt2 = tf.GPT2Config()
    gpt2.architectures = ["GPT2LMHeadModel"]
    facts["arch"] = catch(lambda: MegatronSource(model, hf_config=gpt2))
    # shapes that disagree with the model
    facts["shape"] = catch(lambda: MegatronSource(model, hf_config=mw.hf_config("llama", intermediate_size=128)))
    # a Megatron parameter the family's checkpoint does not carry (qkv bias vs a bias-free Llama)
    facts["extra"] = catch(lambda: MegatronSource(mw.megatron_model(mw.hf_config("qwen2")), hf_config=cfg))
    # a checkpoint tensor the model does not have (Qwen2 wants qkv bias)
    facts["missing"] = catch(lambda: MegatronSource(model, hf_config=mw.hf_config("qwen2")))
    # wrong mode for the engine
    facts["mode"] = catch(lambda: list(MegatronSource(model, hf_config=cfg).iter_local()))
    # MoE layers: unmapped until the MoE handler is registered
    facts["moe"] = catch(lambda: MegatronSource(_moe_model(cfg), hf_config=cfg))
    # ranks that disagree (rank 1 asks for another wire dtype): raised before any byte moves
    src = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16 if rank == 1 else None, timeout_s=60)
    with mw.count_comm() as comm:
        facts["diverge"] = catch(lambda: list(src.iter_full()))
    facts["diverge_comm"] = {k: v for k, v in comm.items() if k in ("isend", "irecv")}
    facts["diverge_stats"] = src.last_pass.as_dict()
    return facts


def _moe_model(cfg):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    mcfg = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, ffn_hidden_size=96, gated_linear_unit=True, normalization="RMSNorm",
        activation_func=torch.nn.functional.silu, add_bias_linear=False, num_moe_experts=4,
        moe_router_topk=2, moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=96,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True, params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    return GPTModel(mcfg, spec, vocab_size=256, max_sequence_length=128, position_embedding_type="rope")


def test_bad_input_raises_on_every_rank_before_bytes_move(tmp_path):
    f = run_world(_rank_bad_input, 2, timeout=400, tmp=str(tmp_path))
    for r in (0, 1):
        x = f[r]
        assert x["arch"].startswith("UnmappedParameterError") and "GPT2LMHeadModel" in x["arch"]
        assert x["shape"].startswith("ValueError") and f"rank {r}" in x["shape"]
        assert "intermediate_size=128" in x["shape"] and "ffn_hidden_size=96" in x["shape"]
        assert x["extra"].startswith("UnmappedParameterError") and "linear_qkv.bias" in x["extra"]
        assert x["missing"].startswith("ValueError") and "q_proj.bias" in x["missing"]
        assert x["mode"].startswith("NotImplementedError")
        assert x["moe"].startswith("UnmappedParameterError") and "mlp.router.weight" in x["moe"]
        assert "mlp.experts" in x["moe"]
        assert x["diverge"] is not None and "Mismatch" in x["diverge"].split(":")[0], x["diverge"]
        assert x["diverge_comm"] == {} and x["diverge_stats"]["collectives"] == 0
