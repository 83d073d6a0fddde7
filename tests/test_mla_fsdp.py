"""FSDPSource over transformers-5 DeepSeek-V3 (MLA attention, fused experts in memory), FSDP2 on 2
gloo ranks, against oracles we did not write:

* transformers' ``save_pretrained`` of the same weights: names, order-free set, dtypes, shapes and
  bytes of every tensor, MLA projections (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` or
  ``q_proj``, ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``), the first
  dense layer, shared experts, per-expert routed experts and ``e_score_correction_bias`` included;
  fp32 wire and bf16 wire (routers and the score-correction bias keep fp32, the wire policy's
  allow-list; everything else is transformers' own bf16 cast, byte for byte);
* transformers' ``from_pretrained``: the per-expert export written as a checkpoint loads with no
  missing, unexpected or mismatched key and computes the trainer model's logits bit for bit; a
  receiver synced through the loopback engine (fused experts on the wire, vLLM's four-phase
  protocol) saved and re-loaded by ``from_pretrained`` computes them too, and did not before;
* vLLM's NCCL trainer engine: rank 0 runs the sender's own stream-vs-metadata check
  (``_checked_iter``), rank 1 is a real non-sender engine;
* ``weightsync check`` (one torchrun launch) exits 0 with every name and shape of
  ``save_pretrained``.

Both MLA variants of ``tests/mla_models`` (the ``tiny-deepseek-v3`` presets): with ``q_lora_rank``
(DeepSeek-V3) and without it (DeepSeek-V2-Lite style ``q_proj``). Every MLA dimension differs, so a
transposed or mis-split tensor cannot pass a shape check by accident.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from family_worlds import check_bf16_wire, check_cli, check_fp32_wire, check_nccl, from_pretrained, logits
from family_worlds import write_checkpoint
from worlds import run_world

pytestmark = pytest.mark.slow

VARIANTS = ("q_lora", "no_q_lora")
SEED = 3
RECEIVER_SEED = 11

#: Names the wire policy keeps in fp32 under a bf16 wire on a DeepSeek-V3 MoE layer (vLLM keeps
#: the router and its score-correction bias in fp32).
KEPT_FP32 = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


def _model(variant: str, seed: int = SEED) -> torch.nn.Module:
    """The variant's preset (``mla_models``), every parameter and buffer random (``moe_models``)."""
    from mla_models import VARIANTS as PRESET_OF
    from moe_models import tiny_model

    from weightsync.plugins.testbed.presets import PRESETS

    fields = {k: v for k, v in PRESETS[PRESET_OF[variant]].items() if k != "model_type"}
    return tiny_model("deepseek_v3", seed=seed, **fields)


def _moe_layers(config) -> list[int]:
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


def _world(rank: int, world_size: int, *, ports: dict[str, int], urls: dict[str, str]) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from family_worlds import fsdp_passes
    from fsdp_worlds import Untouchable, module_snapshot, pack, shard, snapshot_diff
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}
    for variant in VARIANTS:
        model = shard(_model(variant), mesh)
        before = module_snapshot(model)
        f = fsdp_passes(model, rank)
        # Fused experts on the wire: the names a transformers receiver holds in memory.
        fused = FSDPSource(model, expert_layout="fused")
        f["fused_names"] = [m.name for m in fused.metadata]
        info = LoopbackTrainerInitInfo("127.0.0.1", ports[variant], 2, rank=rank, timeout_s=60)
        client = ReceiverClient(urls[variant]) if rank == 0 else Untouchable()
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=fused)
        engine.send_weights(weight_version=f"mla-{variant}")
        f["loopback_tensors"] = fused.last_pass.tensors
        f["module_changed"] = snapshot_diff(before, module_snapshot(model))
        facts[variant] = f
    return pack(facts)


@pytest.fixture(scope="module")
def world():
    from fsdp_worlds import unpack

    from weightsync.plugins.loopback.receiver import LoopbackReceiver
    from weightsync.plugins.loopback.receiver import ReceiverServer

    servers = {v: ReceiverServer(LoopbackReceiver(_model(v, seed=RECEIVER_SEED))).start() for v in VARIANTS}
    try:
        before = {v: logits(s.receiver.model) for v, s in servers.items()}
        res = unpack(run_world(_world, 2, timeout=600, ports={v: 0 for v in VARIANTS},
                               urls={v: s.url for v, s in servers.items()}))
        receivers = {v: (s.receiver.model, s.receiver.state()) for v, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    return res, before, receivers


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_export_equals_save_pretrained(world, variant):
    from moe_models import saved_state_dict

    res, _, _ = world
    ref = _model(variant)
    saved = saved_state_dict(ref)
    last = _moe_layers(ref.config)[-1]
    attn = {n.split("self_attn.")[1] for n in saved if ".layers.1.self_attn." in n}
    q = {"q_proj.weight"}
    if variant == "q_lora":
        q = {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}
    assert attn == q | {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert "model.layers.0.mlp.gate_proj.weight" in saved  # first_k_dense_replace=1: a dense layer
    assert f"model.layers.{last}.mlp.shared_experts.up_proj.weight" in saved
    assert f"model.layers.{last}.mlp.gate.e_score_correction_bias" in saved
    for rank, facts in res.items():
        check_fp32_wire(facts[variant], saved, f"rank {rank} {variant}")




@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_wire_equals_save_pretrained_in_bf16(world, variant):
    """bf16 on the wire: transformers' own bf16 cast, byte for byte, except the router weight and
    the score-correction bias, which travel in fp32 (their fp32 checkpoint bytes); metadata
    declares exactly those dtypes; vLLM's sender-side check accepts the stream."""
    from moe_models import saved_state_dict

    res, _, _ = world
    ref = _model(variant)
    fp32 = saved_state_dict(ref)
    bf16 = saved_state_dict(copy.deepcopy(ref).to(torch.bfloat16))
    kept = sorted(n for n in fp32 if KEPT_FP32.search(n))
    assert kept == [f"model.layers.{i}.mlp.gate.{leaf}" for i in _moe_layers(ref.config)
                    for leaf in ("e_score_correction_bias", "weight")]
    want = {n: (fp32[n] if n in kept else bf16[n]) for n in fp32}
    for rank, facts in res.items():
        check_bf16_wire(facts[variant], want, f"rank {rank} {variant}")
    check_nccl({r: facts[variant] for r, facts in res.items()}, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(world, variant, tmp_path):
    """The per-expert export written as a checkpoint is one transformers loads strictly (its own
    per-expert -> fused conversion), and the loaded model computes the trainer's logits."""
    res, _, _ = world
    ref = _model(variant)
    want = logits(ref)
    write_checkpoint(ref.config, res[0][variant]["fp32"], str(tmp_path))
    loaded, info = from_pretrained(str(tmp_path))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(logits(loaded), want)
    # The check can fail: the same checkpoint with one kv_b_proj row changed gives other logits.
    bad = dict(res[0][variant]["fp32"])
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    bad[name] = bad[name].clone()
    bad[name][3] += 1.0
    write_checkpoint(ref.config, bad, str(tmp_path / "bad"))
    assert not torch.allclose(logits(from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loopback_received_model_reloads_with_the_trainer_logits(world, variant, tmp_path):
    """FSDPSource (fused experts on the wire) -> loopback engine -> a transformers DeepSeek-V3
    receiver of another init; the receiver's ``save_pretrained`` re-loaded by ``from_pretrained``
    computes the trainer model's logits bit for bit (and the receiver's did not before)."""
    from moe_models import fused_params

    res, before, receivers = world
    ref = _model(variant)
    want = logits(ref)
    model, state = receivers[variant]
    assert state["weight_version"] == f"mla-{variant}" and state["updates_finished"] == 1
    fused_names = set(fused_params(ref))
    assert fused_names and fused_names <= set(res[0][variant]["fused_names"])
    assert not torch.allclose(before[variant], want, atol=1e-3)
    model.save_pretrained(str(tmp_path))
    loaded, info = from_pretrained(str(tmp_path))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(logits(loaded), want)
    assert res[0][variant]["loopback_tensors"] == len(res[0][variant]["fused_names"])


def test_check_cli_deepseek_v3_fsdp_two_ranks():
    """``weightsync check`` on a tiny DeepSeek-V3 (MLA with q_lora_rank, first dense layer, shared
    experts), FSDP layout, 2 ranks (the CLI's rank code on forked ranks): exit 0, every name and
    shape of ``save_pretrained``."""
    saved, _ = check_cli("tiny-deepseek-v3", "--nproc", "2", nproc=2, layout_line="layout fsdp x2")
    assert any(".self_attn.kv_b_proj.weight" in n for n in saved)
