"""PEFT LoRA models through ``FSDPSource``: merged Hugging Face weights, the model untouched.

Oracle (written by peft and transformers, not by us): ``merge_and_unload()`` of an unsharded deepcopy
of the same PEFT model, then ``save_pretrained`` -- names, shapes and bytes. The source merges in
fp32 in peft's own op order (``W += transpose(B @ A) * scaling``), so fp32 is compared bit for bit,
and the bf16 wire against the same fp32 merge cast to bf16 (rounding once, as we do), bit for bit.

Worlds (2 gloo ranks each; many checks per world, asserted here):

* ``world_merge``: FSDP2 per decoder layer + root on ``get_peft_model(...)`` models with non-zero B:
  tied Qwen3 with rsLoRA on q/k/v/o + MLP; untied Qwen2 (biased q/k/v) with a non-default alpha, r=3
  (uneven shard rows) and ``modules_to_save`` (lm_head and every norm); GPT-2 (Conv1D weights,
  ``fan_in_fan_out``) with two adapters active at once, one rsLoRA on a subset; fp32 and bf16 wire;
  ``iter_local``; a one-rank shard mesh and an unsharded model; disabled adapters; collectives vs
  FSDP units; model unchanged bit for bit; vLLM's NCCL trainer engine on a non-sender rank.
* ``world_bad``: DoRA, LoRA on embeddings, IA3, lora_bias, LoRA on a tied lm_head: every rank raises
  ``UnsupportedAdapterError`` naming the module, before any collective.
* ``world_loopback``: end to end through weightsync's loopback engine (vLLM's trainer factory) into
  a receiver process; the receiver's logits equal those of peft's merged model.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_worlds import (
    Untouchable,
    drive_vllm_nccl,
    count_pass,
    errors_of,
    fsdp_unit_count,
    load_oracle,
    meta_facts,
    module_snapshot,
    no_collectives,
    pack,
    shard,
    snapshot_diff,
    stream,
    tiny_model,
    to_cpu,
    unpack,
)
from worlds import CONTEXT, run_world

pytestmark = pytest.mark.slow

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCENARIOS = ("qwen3-tied-rslora", "qwen2-untied-mts", "gpt2-fan-in-fan-out-2-adapters")
#: Checkpoint-name suffixes of the base weights each scenario merges LoRA into.
MERGED = {
    "qwen3-tied-rslora": tuple(f"{t}.weight" for t in ALL_LINEAR),
    "qwen2-untied-mts": tuple(f"{t}.weight" for t in ALL_LINEAR),
    "gpt2-fan-in-fan-out-2-adapters": ("c_attn.weight", "c_proj.weight", "c_fc.weight"),
}
EXTRA_RUNS = 1  # as in test_fsdp: the root unit is gathered in two runs (embeddings, then the end)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("peft").setLevel(logging.ERROR)


def lora_model(scenario: str, *, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(peft model with non-zero B and trained modules_to_save copies, a copy of the base model)``."""
    from peft import LoraConfig, get_peft_model

    if scenario == "qwen3-tied-rslora":
        base = tiny_model("qwen3", tied=True, seed=seed)
        cfg = LoraConfig(r=4, lora_alpha=12, use_rslora=True, target_modules=ALL_LINEAR)
    elif scenario == "qwen2-untied-mts":
        base = tiny_model("qwen2", tied=False, seed=seed)
        cfg = LoraConfig(r=3, lora_alpha=7, target_modules=ALL_LINEAR, modules_to_save=["lm_head", "norm"])
    elif scenario == "gpt2-fan-in-fan-out-2-adapters":
        from transformers import AutoModelForCausalLM, GPT2Config

        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_config(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=127, n_positions=64, bos_token_id=0, eos_token_id=0)
        )
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    else:
        raise ValueError(scenario)
    base.eval()  # GPT-2 has dropout: logits are compared below (the export does not depend on it)
    base_copy = copy.deepcopy(base)
    model = get_peft_model(base, cfg)
    if scenario.startswith("gpt2"):
        # GPT-2's Conv1D weights are [in, out] (fan_in_fan_out); two adapters active at once, the
        # second on a subset of layers with rsLoRA: merged in order, like LoraLayer.merge.
        model.add_adapter("other", LoraConfig(r=2, lora_alpha=5, use_rslora=True, target_modules=["c_attn", "c_fc"],
                                              fan_in_fan_out=True))
        model.base_model.set_adapter(["default", "other"])
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:  # as if trained: the merge is visible
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.5 if "modules_to_save" in name else 0.0))
    return model, base_copy


def peft_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    hf = model.base_model.model
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def adapter_state(model: torch.nn.Module) -> list[tuple]:
    """Everything peft keeps about adapters on each tuner layer / wrapper, plus requires_grad."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    out = []
    for n, m in model.named_modules():
        if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            out.append((
                n,
                tuple(m.active_adapters),
                bool(m.disable_adapters),
                tuple(getattr(m, "merged_adapters", ()) or ()),
                tuple(sorted(getattr(m, "scaling", {}).items())),
            ))
    out += [(n, p.requires_grad) for n, p in model.named_parameters()]
    return out


def save_merged(model: torch.nn.Module, directory: str, dtype: torch.dtype | None = None) -> None:
    """peft's merge of an unsharded deepcopy, written by transformers: the oracle."""
    merged = copy.deepcopy(model).merge_and_unload()
    if dtype is not None:
        merged = merged.to(dtype)
    merged.save_pretrained(directory)


# ---- worlds -------------------------------------------------------------------------------------


def world_merge(rank: int, world_size: int, *, oracle_dir: str) -> bytes:
    _quiet()
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}
    ids = torch.randint(0, 127, (2, 8), generator=torch.Generator().manual_seed(3))
    for scenario in SCENARIOS:
        f: dict[str, Any] = {}
        model, base = lora_model(scenario)
        d = os.path.join(oracle_dir, scenario)
        if rank == 0:
            save_merged(model, d)
            save_merged(model, d + "-bf16", torch.bfloat16)
            base.save_pretrained(d + "-base")
        with torch.no_grad():
            merged_ref = copy.deepcopy(model).merge_and_unload()
            f["merged_logits"] = merged_ref(input_ids=ids).logits
        unsharded = copy.deepcopy(model)  # plain modules, no DTensor: the "plain" path
        shard(model, mesh, layers=peft_layers(model))
        f["units"] = fsdp_unit_count(model)
        f["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)[:3]
        before, state_before = module_snapshot(model), adapter_state(model)

        src = FSDPSource(model)
        with no_collectives():
            f["meta"] = meta_facts(src.metadata)
        f["fp32"] = to_cpu(stream(src))  # first pass: also the cross-rank metadata agreement
        f["calls"], f["ops"], second = count_pass(src)
        f["stats"] = src.last_pass.as_dict()
        f["second_equal"] = sorted(second) == sorted(f["fp32"]) and all(
            torch.equal(second[n], t) for n, t in f["fp32"].items()
        )
        f["local"] = to_cpu(stream(src, "local"))
        f["local_meta"] = [(m.name, m.placements is None) for m in src.metadata]
        bf = FSDPSource(model, dtype=torch.bfloat16)
        f["bf16"] = to_cpu(stream(bf))
        f["bf16_meta_dtypes"] = sorted({str(m.dtype) for m in bf.metadata})
        for _ in range(3):  # more passes: still nothing changes
            stream(src)
        f["module_changed"] = snapshot_diff(before, module_snapshot(model))
        f["adapter_state_equal"] = state_before == adapter_state(model)
        with torch.no_grad():
            f["trainer_logits"] = model(input_ids=ids).logits  # the PEFT forward, unmerged, sharded
        model.reshard()  # FSDP2 keeps the root unsharded after forward

        # The unsharded PEFT model (plain tensors, aliases of the module) and a one-rank shard mesh.
        plain_before = module_snapshot(unsharded)
        f["unsharded"] = to_cpu(stream(FSDPSource(unsharded)))
        f["unsharded_changed"] = snapshot_diff(plain_before, module_snapshot(unsharded))
        one = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "one"))["one"]
        single = copy.deepcopy(unsharded)
        shard(single, one, layers=peft_layers(single))
        f["one_rank_mesh"] = to_cpu(stream(FSDPSource(single, dtype=torch.bfloat16)))

        # Disabled adapters: what the model then computes -- the base weights, original modules.
        # The state is fixed per source: leaving the context makes the next pass raise, on every rank.
        with model.disable_adapter():
            off = FSDPSource(model)
            f["disabled"] = to_cpu(stream(off))
            f["disabled_collectives"] = off.last_pass.collectives
        f["err_state"] = errors_of(off.iter_full)
        facts[scenario] = f
        dist.barrier()

    # LoRA A/B in FSDP units of their own (not their base weight's): gathered separately, merged
    # all the same. Same seed as the first scenario, so its oracle applies.
    model, _ = lora_model("qwen3-tied-rslora")
    from torch.distributed.fsdp import fully_shard

    for layer in peft_layers(model):
        fully_shard(layer.self_attn.q_proj.lora_A["default"], mesh=mesh)
        fully_shard(layer.mlp.down_proj.lora_B["default"], mesh=mesh)
        fully_shard(layer.self_attn.k_proj, mesh=mesh)  # the LoRA layer itself: class FSDPLinear
    shard(model, mesh, layers=peft_layers(model))
    split = FSDPSource(model)
    facts["split_units"] = {"full": to_cpu(stream(split)), "collectives": split.last_pass.collectives,
                            "units": fsdp_unit_count(model)}

    # Wrappers around and inside the PEFT model: activation checkpointing per decoder layer,
    # FSDP2, then torch.compile of the whole PeftModel.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, _ = lora_model("qwen2-untied-mts")
    layers = peft_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    shard(model, mesh, layers=layers)
    compiled = torch.compile(model)
    facts["wrapped_inmemory"] = [n for n, _ in compiled.named_parameters()][1]
    facts["wrapped"] = to_cpu(stream(FSDPSource(compiled)))

    # A MoE model (transformers-5 fused experts, exported per expert) with LoRA on attention.
    moe_cfg = LoraConfig(r=4, target_modules=["q_proj", "o_proj"])
    moe = get_peft_model(tiny_model("qwen3_moe", tied=False, seed=6), moe_cfg)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    if rank == 0:
        save_merged(moe, os.path.join(oracle_dir, "moe"))
    shard(moe, mesh, layers=peft_layers(moe))
    facts["moe"] = to_cpu(stream(FSDPSource(moe)))
    dist.barrier()

    # bf16 parameters (a bf16-loaded base and bf16 adapters): the merge runs in fp32 and rounds once.
    # Oracles: peft's merge of an fp32 upcast (upcasting is exact and the op order is peft's: ours
    # must be that, rounded once) and peft's merge in bf16 itself, which rounds the delta to bf16
    # and then the sum: elementwise never closer to the fp32 merge than ours.
    model, _ = lora_model("qwen3-tied-rslora", seed=2)
    model.to(torch.bfloat16)
    fp32_merge = copy.deepcopy(model).float().merge_and_unload().state_dict()
    native = copy.deepcopy(model).merge_and_unload().state_dict()
    shard(model, mesh, layers=peft_layers(model))
    got = to_cpu(stream(FSDPSource(model)))
    ours_err = {n: (t.float() - fp32_merge[n]).abs() for n, t in got.items()}
    peft_err = {n: (native[n].float() - fp32_merge[n]).abs() for n in got}
    facts["bf16_params"] = {
        "dtypes": sorted({str(t.dtype) for t in got.values()}),
        "not_fp32_merge_rounded": [n for n, t in got.items() if not torch.equal(t, fp32_merge[n].to(torch.bfloat16))],
        "farther_than_peft_bf16": [n for n in got if not bool((ours_err[n] <= peft_err[n]).all())],
        "ours_total_err": float(sum(e.sum() for e in ours_err.values())),
        "peft_bf16_total_err": float(sum(e.sum() for e in peft_err.values())),
    }

    # vLLM's NCCL trainer engine: rank 1 is a non-sender and drains iter_full() itself; rank 0
    # runs the sender's own metadata check (_checked_iter) over the same source.
    model, _ = lora_model("qwen3-tied-rslora")
    shard(model, mesh, layers=peft_layers(model))
    src = FSDPSource(model, dtype=torch.bfloat16)
    drive_vllm_nccl(src, rank, facts)
    dist.barrier()
    return pack(facts)


def world_bad(rank: int, world_size: int) -> bytes:
    _quiet()
    from peft import IA3Config, LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    cases = {
        "dora": (False, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True)),
        "embedding": (False, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])),
        "ia3": (False, IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])),
        "lora_bias": (False, LoraConfig(r=4, target_modules=["k_proj"], lora_bias=True)),
        "tied_lm_head": (True, LoraConfig(r=4, target_modules=["lm_head", "q_proj"])),
    }
    out: dict[str, Any] = {}
    for key, (tied, cfg) in cases.items():
        model = get_peft_model(tiny_model("qwen2", tied=tied, seed=7), cfg)
        shard(model, mesh, layers=peft_layers(model))
        with no_collectives():  # raised before any collective: nothing to hang on
            out[key] = errors_of(FSDPSource, model)
    dist.barrier()
    # Ranks whose adapters differ (rank 4 here, 8 there) hold identical metadata (base names and
    # shapes); the first pass must still refuse before any gather, on both ranks, naming a LoRA input.
    cfg = LoraConfig(r=4 if rank == 0 else 8, target_modules=["q_proj"])
    model = get_peft_model(tiny_model("qwen2", tied=False, seed=7), cfg)
    shard(model, mesh, layers=peft_layers(model))
    src = FSDPSource(model)
    out["diverging_meta_equal_local"] = [m.name for m in src.metadata]
    out["diverging"] = errors_of(src.iter_full)
    out["diverging_collectives"] = src.last_pass.collectives
    dist.barrier()
    return pack(out)


def receiver_model() -> torch.nn.Module:
    """The loopback receiver: the base architecture (what vLLM serves), another init."""
    return tiny_model("qwen3", tied=True, seed=9)


def world_loopback(rank: int, world_size: int, *, port: int, url: str) -> bytes:
    _quiet()
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.sources import FSDPSource

    model, _ = lora_model("qwen3-tied-rslora", seed=1)
    ids = torch.randint(0, 127, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        merged_logits = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
    shard(model, init_device_mesh("cpu", (world_size,)), layers=peft_layers(model))
    source = FSDPSource(model)
    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=60)
    client = ReceiverClient(url) if rank == 0 else Untouchable()
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights()
    facts: dict[str, Any] = {"tensors": source.last_pass.tensors, "names": [m.name for m in source.metadata]}
    if rank == 0:
        got, _ = ReceiverClient(url).logits(ids.tolist())
        facts["logits_equal"] = torch.equal(got, merged_logits)
        facts["logits_maxdiff"] = float((got - merged_logits).abs().max())
    dist.barrier()
    return pack(facts)


# ---- tests --------------------------------------------------------------------------------------


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (
        f"{what}: names differ: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
    )
    for n, w in want.items():
        g = got[n]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}: {n} {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}"
        )
        same = torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        assert same, f"{what}: {n} bytes differ"


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_lora")
    return unpack(run_world(world_merge, 2, timeout=480, oracle_dir=str(d))), d


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fsdp2_lora_stream_equals_peft_merge_and_unload(merged, scenario):
    results, d = merged
    oracle = load_oracle(os.path.join(d, scenario))
    oracle_bf16 = load_oracle(os.path.join(d, scenario + "-bf16"))
    base = load_oracle(os.path.join(d, scenario + "-base"))
    # The oracle, for the reader: base names only, and the merge is visible (B and copies non-zero).
    assert not any(k in n for n in oracle for k in ("lora_", "base_layer", "modules_to_save", "base_model"))
    changed = {n for n in oracle if not torch.equal(oracle[n], base[n])}
    assert {n for n in oracle if n.endswith(MERGED[scenario])} <= changed
    assert ("lm_head.weight" in oracle) is scenario.endswith("mts")  # tied: written once
    if scenario.endswith("mts"):
        assert {"lm_head.weight", "model.norm.weight"} <= changed  # trained modules_to_save copies
        assert "model.layers.0.self_attn.q_proj.bias" in oracle  # Qwen2's base bias, untouched by LoRA
    for rank, f in results.items():
        f = f[scenario]
        assert_same_tensors(f["fp32"], oracle, f"rank {rank} {scenario} fp32")
        assert_same_tensors(f["bf16"], oracle_bf16, f"rank {rank} {scenario} bf16 wire")
        assert f["bf16_meta_dtypes"] == ["torch.bfloat16"]
        assert f["second_equal"]
        # metadata: base names and shapes, in stream order
        assert [m[0] for m in f["meta"]] == list(f["fp32"])
        # the plain (unsharded) path and a one-rank shard mesh give the same bytes
        assert_same_tensors(f["unsharded"], oracle, f"rank {rank} {scenario} unsharded")
        assert f["unsharded_changed"] == []
        assert_same_tensors(f["one_rank_mesh"], oracle_bf16, f"rank {rank} {scenario} one-rank mesh")
        # the PEFT forward (unmerged, sharded) computes what the merged weights compute
        torch.testing.assert_close(f["trainer_logits"], f["merged_logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_iter_local_and_metadata_without_collectives(merged, scenario):
    results, d = merged
    oracle = load_oracle(os.path.join(d, scenario))
    metas = [results[r][scenario]["meta"] for r in sorted(results)]
    assert all(m == metas[0] for m in metas[1:])
    for rank, f in results.items():
        f = f[scenario]
        replicated = {n for n, none in f["local_meta"] if none}
        # merged weights exist in full only: placements None, iter_local yields them whole
        want_merged = {n for n in oracle if n.endswith(MERGED[scenario])}
        assert want_merged and want_merged == replicated, sorted(want_merged ^ replicated)
        for n in replicated:
            assert torch.equal(f["local"][n], oracle[n]), n
        # every other tensor is this rank's Shard(0) rows of the oracle (torch.chunk rule)
        for n in set(oracle) - replicated:
            want = torch.chunk(oracle[n], 2, dim=0)
            want = want[rank] if rank < len(want) else oracle[n][:0]
            assert torch.equal(f["local"][n], want), n


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lora_gathered_with_its_unit_and_model_untouched(merged, scenario):
    results, _ = merged
    for rank, f in results.items():
        f = f[scenario]
        # A/B join their base weight's batched gather: collectives as for the plain model
        assert f["calls"] == f["ops"] == f["stats"]["collectives"], f["stats"]
        assert f["calls"] <= f["units"] + EXTRA_RUNS
        assert any("lora_A" in n for n in f["trainable"])
        assert f["module_changed"] == [], f["module_changed"][:3]
        assert f["adapter_state_equal"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_disabled_adapters_export_base_weights(merged, scenario):
    results, d = merged
    base = load_oracle(os.path.join(d, scenario + "-base"))
    for rank, f in results.items():
        f = f[scenario]
        assert_same_tensors(f["disabled"], base, f"rank {rank} {scenario} disabled")
        assert "AdapterStateError" in f["err_state"] and "adapter state changed" in f["err_state"], f["err_state"]
        assert f"rank {rank}" in f["err_state"]


def test_lora_in_other_units_wrappers_and_moe(merged):
    results, d = merged
    oracle = load_oracle(os.path.join(d, "qwen3-tied-rslora"))
    moe = load_oracle(os.path.join(d, "moe"))
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in moe)  # per expert, as saved
    for rank, facts in results.items():
        f = facts["split_units"]
        assert_same_tensors(f["full"], oracle, f"rank {rank} A/B in other units")
        assert f["units"] == results[rank]["qwen3-tied-rslora"]["units"] + 6
        assert f["collectives"] > results[rank]["qwen3-tied-rslora"]["stats"]["collectives"]
        assert_same_tensors(facts["moe"], moe, f"rank {rank} MoE + LoRA")
        wrapped = load_oracle(os.path.join(d, "qwen2-untied-mts"))
        assert "_orig_mod." in facts["wrapped_inmemory"] and "_checkpoint_wrapped_module" in facts["wrapped_inmemory"]
        assert_same_tensors(facts["wrapped"], wrapped, f"rank {rank} AC + FSDP2 + torch.compile")


def test_bf16_parameters_merge_in_fp32_and_round_once(merged):
    results, _ = merged
    for rank, facts in results.items():
        f = facts["bf16_params"]
        assert f["dtypes"] == ["torch.bfloat16"]
        assert f["not_fp32_merge_rounded"] == []  # == peft's fp32 merge, rounded to bf16 once
        # peft's own bf16 merge rounds twice: ours is never farther from the fp32 merge, and closer overall
        assert f["farther_than_peft_bf16"] == []
        assert f["ours_total_err"] < f["peft_bf16_total_err"], f


def test_vllm_nccl_engine_non_sender(merged):
    results, d = merged
    oracle_bf16 = load_oracle(os.path.join(d, "qwen3-tied-rslora-bf16"))
    assert_same_tensors(results[0]["nccl_sender"], oracle_bf16, "vLLM _checked_iter (sender)")
    assert results[1]["nccl_is_sender"] is False
    assert results[1]["nccl_nonsender_tensors"] == len(oracle_bf16)


def test_unsupported_adapters_raise_on_every_rank():
    out = unpack(run_world(world_bad, 2, timeout=300))
    want = {
        "dora": ("model.layers.0.self_attn.q_proj", "DoRA"),
        "embedding": ("model.embed_tokens", "LoRA on an embedding"),
        "ia3": ("IA3Model", "not LoRA"),
        "lora_bias": ("model.layers.0.self_attn.k_proj", "lora_bias=True"),
        "tied_lm_head": ("lm_head", "tied weight"),
    }
    for rank, errs in out.items():
        # different adapters per rank: identical metadata, but the first pass raises on both ranks
        assert errs["diverging_meta_equal_local"] == out[0]["diverging_meta_equal_local"]
        assert errs["diverging"].startswith("CrossRankMismatchError"), errs["diverging"]
        assert "lora_A" in errs["diverging"], errs["diverging"]
        assert errs["diverging_collectives"] == 0
        for key, words in want.items():
            msg = errs[key]
            assert msg is not None and msg.startswith("UnsupportedAdapterError"), (rank, key, msg)
            assert f"rank {rank}" in msg and all(w in msg for w in words), (rank, key, msg)


def test_loopback_end_to_end_logits_equal_peft_merged_model():
    from weightsync.plugins.loopback.receiver import start_receiver_process

    client, handle = start_receiver_process(functools.partial(receiver_model), mp_context=CONTEXT)
    with handle:
        before = client.weight_digests()
        res = unpack(run_world(world_loopback, 2, timeout=420, port=0, url=handle.url))
        after = client.weight_digests()
    assert before != after
    assert res[0]["logits_equal"], res[0]["logits_maxdiff"]
    assert res[0]["tensors"] == res[1]["tensors"] == len(res[0]["names"])
    assert not any("lora" in n or "base_layer" in n for n in res[0]["names"])
