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
import os
import re
from typing import Any

import pytest
import torch

from worlds import run_world

pytestmark = pytest.mark.slow

VARIANTS = ("q_lora", "no_q_lora")
SEED = 3
RECEIVER_SEED = 11
IDS = [[3, 17, 42, 5, 60, 1, 33, 8], [9, 9, 27, 50, 2, 44, 13, 61]]

#: Names the wire policy keeps in fp32 under a bf16 wire on a DeepSeek-V3 MoE layer (vLLM keeps
#: the router and its score-correction bias in fp32).
KEPT_FP32 = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


def _model(variant: str, seed: int = SEED) -> torch.nn.Module:
    """The variant's preset (``mla_models``), every parameter and buffer random (``moe_models``)."""
    from mla_models import VARIANTS as PRESET_OF
    from moe_models import tiny_model

    from weightsync.plugins.presets import PRESETS

    fields = {k: v for k, v in PRESETS[PRESET_OF[variant]].items() if k != "model_type"}
    return tiny_model("deepseek_v3", seed=seed, **fields)


def _moe_layers(config) -> list[int]:
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


def _world(rank: int, world_size: int, *, ports: dict[str, int], urls: dict[str, str]) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from fsdp_worlds import (
        Untouchable,
        drive_vllm_nccl,
        meta_facts,
        module_snapshot,
        no_collectives,
        pack,
        shard,
        snapshot_diff,
        stream,
        to_cpu,
    )
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback_server import ReceiverClient
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}
    for variant in VARIANTS:
        model = shard(_model(variant), mesh)
        before = module_snapshot(model)
        f: dict[str, Any] = {}
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


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(input_ids=torch.tensor(IDS)).logits.float()


def _from_pretrained(directory: str) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


def _write_checkpoint(config, tensors: dict[str, torch.Tensor], directory: str) -> None:
    """The export as a checkpoint folder: transformers' config.json + one safetensors file."""
    from safetensors.torch import save_file

    config.save_pretrained(directory)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def world():
    from fsdp_worlds import unpack

    from weightsync.plugins.loopback_server import LoopbackReceiver
    from weightsync.plugins.loopback_server import ReceiverServer

    servers = {v: ReceiverServer(LoopbackReceiver(_model(v, seed=RECEIVER_SEED))).start() for v in VARIANTS}
    try:
        before = {v: _logits(s.receiver.model) for v, s in servers.items()}
        res = unpack(run_world(_world, 2, timeout=600, ports={v: 0 for v in VARIANTS},
                               urls={v: s.url for v, s in servers.items()}))
        receivers = {v: (s.receiver.model, s.receiver.state()) for v, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    return res, before, receivers


def _meta_map(meta) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of ``fsdp_worlds.meta_facts`` rows."""
    return {m[0]: (m[1], tuple(m[2])) for m in meta}


def _dtype_shape(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_export_equals_save_pretrained(world, variant):
    from moe_models import saved_state_dict
    from test_fsdp import assert_same_tensors

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
        f = facts[variant]
        assert_same_tensors(f["fp32"], saved, f"rank {rank} {variant} fp32")
        assert f["order"] == [m[0] for m in f["meta"]], "stream order != metadata order"
        assert _meta_map(f["meta"]) == _dtype_shape(saved)
        assert all(m[3] in (None, (0, 1)) for m in f["meta"])  # FSDP: both ranks iterate every tensor
        assert f["module_changed"] == [], f["module_changed"][:5]




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
        f = facts[variant]
        got = f["bf16"]
        assert sorted(got) == sorted(want)
        for n, w in want.items():
            assert got[n].dtype == w.dtype and got[n].shape == w.shape, (rank, n, got[n].dtype, w.dtype)
            assert torch.equal(got[n].view(torch.uint8), w.contiguous().view(torch.uint8)), (rank, n)
        assert _meta_map(f["bf16_meta"]) == _dtype_shape(want)
    sent = res[0][variant]["nccl_sender"]  # passed vLLM's own _checked_iter against metadata
    assert sorted(sent) == sorted(want) and all(torch.equal(sent[n], want[n]) for n in want)
    assert res[1][variant]["nccl_is_sender"] is False
    assert res[1][variant]["nccl_nonsender_tensors"] == len(want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(world, variant, tmp_path):
    """The per-expert export written as a checkpoint is one transformers loads strictly (its own
    per-expert -> fused conversion), and the loaded model computes the trainer's logits."""
    res, _, _ = world
    ref = _model(variant)
    want = _logits(ref)
    _write_checkpoint(ref.config, res[0][variant]["fp32"], str(tmp_path))
    loaded, info = _from_pretrained(str(tmp_path))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(_logits(loaded), want)
    # The check can fail: the same checkpoint with one kv_b_proj row changed gives other logits.
    bad = dict(res[0][variant]["fp32"])
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    bad[name] = bad[name].clone()
    bad[name][3] += 1.0
    _write_checkpoint(ref.config, bad, str(tmp_path / "bad"))
    assert not torch.allclose(_logits(_from_pretrained(str(tmp_path / "bad"))[0]), want, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loopback_received_model_reloads_with_the_trainer_logits(world, variant, tmp_path):
    """FSDPSource (fused experts on the wire) -> loopback engine -> a transformers DeepSeek-V3
    receiver of another init; the receiver's ``save_pretrained`` re-loaded by ``from_pretrained``
    computes the trainer model's logits bit for bit (and the receiver's did not before)."""
    from moe_models import fused_params

    res, before, receivers = world
    ref = _model(variant)
    want = _logits(ref)
    model, state = receivers[variant]
    assert state["weight_version"] == f"mla-{variant}" and state["updates_finished"] == 1
    fused_names = set(fused_params(ref))
    assert fused_names and fused_names <= set(res[0][variant]["fused_names"])
    assert not torch.allclose(before[variant], want, atol=1e-3)
    model.save_pretrained(str(tmp_path))
    loaded, info = _from_pretrained(str(tmp_path))
    assert {k: v for k, v in info.items() if v} == {}, info
    assert torch.equal(_logits(loaded), want)
    assert res[0][variant]["loopback_tensors"] == len(res[0][variant]["fused_names"])


def test_check_cli_deepseek_v3_fsdp_two_ranks():
    """``weightsync check`` on a tiny DeepSeek-V3 (MLA with q_lora_rank, first dense layer, shared
    experts), FSDP layout, 2 ranks (the CLI's rank code on forked ranks): exit 0, every name and
    shape of ``save_pretrained``."""
    from test_demo_cli import _listed, _saved
    from worlds import run_cli

    from weightsync.plugins.presets import build_model, load_config

    saved = _saved(build_model(load_config("tiny-deepseek-v3")))
    r = run_cli("check", "--model", "tiny-deepseek-v3", "--nproc", "2", "--show", "1000", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS") and "layout fsdp x2" in out
    assert _listed(out) == {n: s for n, (_, s) in saved.items()}
    assert any(".self_attn.kv_b_proj.weight" in n for n in saved)
    assert "Traceback" not in r.stderr
