"""FSDPSource applies transformers' own save-time conversions (issue 33), against ``save_pretrained``.

* ``test_registry_*``: every causal-LM and image-text-to-text class transformers registers (plus
  Qwen3-Omni's thinker), built on the meta device from its default config (at most 4 layers per
  stack): ``FSDPSource.metadata`` -- of the plain model and of the model whose classes are renamed
  the way ``fully_shard`` renames them -- must equal the names, shapes and dtypes ``save_pretrained``
  itself writes (its writer replaced by a recorder). Every mismatch fails; every refusal and every
  config transformers cannot build is listed with its reason.
* ``test_fsdp2_*``: tiny real models of the architectures issue 33 names, on 2 gloo ranks, FSDP2
  per block and at the root, fp32 and bf16 wire, built with ``from_config`` and loaded with
  ``from_pretrained``: names, shapes and bytes equal ``save_pretrained``'s files.
* FSDP+TP: a column-parallel fused tensor the checkpoint splits streams as saved.
* A conversion that cannot be reverted is refused at metadata time, naming the operation; PEFT LoRA
  on a converted model goes out merged, LoRA on a converted tensor is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
from worlds import run_world

#: Architectures whose streams must stay exact (the ones issue 33 names, and those it lists as
#: already exact): a refusal or a build failure of one of them fails the walk.
MUST_MATCH = (
    "kimi_linear", "olmo_hybrid", "glm5_next", "qwen4_exp_text", "minimax_m3_vl", "kimi_k25", "nemotron_h",
    "step3p7", "llama4_text", "llama4", "qwen3_omni_moe", "deepseek_v4", "gemma4", "glm4_moe_lite", "olmo3",
    "hunyuan_v1_moe", "ernie4_5_moe", "qwen3_vl_moe", "glm46v", "qwen3_moe", "mixtral", "qwen2_5_vl",
    "ernie4_5_vl_moe", "gpt_oss", "deepseek_v3", "qwen3_5_moe",
)


def _fsdp_renamed(model: torch.nn.Module) -> None:
    """Rename every transformers sub-model's class as ``fully_shard`` does (``FSDP<cls>``, a dynamic
    subclass defined in torch), without a process group: what transformers' conversion lookup sees."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    for m in list(model.modules()):
        if isinstance(m, PreTrainedModel):
            cls = type(m)
            m.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": FSDPModule.__module__})


def _facts(meta) -> dict:
    return {m.name: (tuple(m.shape), m.dtype) for m in meta}


def _walk() -> dict[str, tuple[str, str]]:
    import logging

    from conversion_models import meta_model_and_layout, registry

    from weightsync.sources import FSDPSource
    from weightsync.sources.core.ground.errors import UnmappedParameterError

    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, tuple[str, str]] = {}
    for model_type, kind in registry():
        try:
            model, saved = meta_model_and_layout(model_type, kind)
        except Exception as e:  # noqa: BLE001 - transformers' own default config does not build
            out[model_type] = ("unbuildable", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        try:
            plain = _facts(FSDPSource(model).metadata)
            _fsdp_renamed(model)
            wrapped = _facts(FSDPSource(model).metadata)
        except UnmappedParameterError as e:
            out[model_type] = ("refused", str(e)[:300])
            continue
        bad = []
        for what, got in (("plain", plain), ("fsdp-renamed", wrapped)):
            if got != saved:
                diff = sorted(set(got.items()) ^ set(saved.items()), key=str)[:3]
                bad.append(f"{what}: {len(set(got) ^ set(saved))} names differ; e.g. {diff}")
        out[model_type] = ("mismatch", "; ".join(bad)) if bad else ("exact", f"{len(saved)} tensors")
    return out


@pytest.fixture(scope="module")
def walk():
    return _walk()


def test_registry_metadata_equals_save_pretrained(walk, capsys):
    """No architecture transformers registers declares a name, shape or dtype save_pretrained would
    not write; refusals and unbuildable configs are listed with their reasons."""
    mismatches = {k: v for k, (s, v) in walk.items() if s == "mismatch"}
    with capsys.disabled():
        counts = {s: sum(1 for x, _ in walk.values() if x == s) for s in ("exact", "refused", "unbuildable")}
        print(f"\nregistry walk: {counts}")
        for k, (s, v) in sorted(walk.items()):
            if s in ("refused", "unbuildable"):
                print(f"  {s:11s} {k}: {v}")
    assert not mismatches, mismatches
    for k in MUST_MATCH:
        assert walk[k][0] == "exact", (k, walk[k])
    assert counts["exact"] >= 230, counts


def test_unrevertable_conversion_is_refused_at_metadata():
    """A conversion whose reversal fails on the global shapes is refused before any gather, naming
    the operation and the tensors (here: a from_pretrained-style ``_weight_conversions`` with an
    operation transformers cannot apply to these shapes)."""
    from conversion_models import tiny_model
    from transformers.core_model_loading import Chunk, WeightConverter

    from weightsync.sources import FSDPSource
    from weightsync.sources.core.ground.errors import UnmappedParameterError

    model = tiny_model("llama4_text")
    # load: split a checkpoint's fused "qk" along dim 2 into q_proj / k_proj, so save concatenates
    # q_proj and k_proj along dim 2 -- which their 2-D weights do not have.
    model._weight_conversions = [
        WeightConverter(
            "self_attn.qk.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight"], operations=[Chunk(dim=2)]
        )
    ]
    with pytest.raises(UnmappedParameterError, match=r"Concatenate.*self_attn\.(q|k)_proj\.weight"):
        FSDPSource(model).metadata


# ---- 2 ranks, FSDP2 ---------------------------------------------------------------------------------

#: Architectures streamed multi-rank (conversion_models.TINY).
ARCHS = (
    "kimi_linear", "olmo_hybrid", "glm5_next", "qwen4_exp_text", "minimax_m3_vl", "kimi_k25",
    "nemotron_h", "step3p7", "llama4_text", "qwen3_omni_moe",
)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP units the torchtitan way, innermost first: every block of a ``layers`` / ``blocks``
    ModuleList (text and vision towers alike), then the caller shards the root (which keeps tied
    embeddings and lm_head in one unit)."""
    units = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks", "layer"):
            units += [(name.count("."), b) for b in m]
    return [m for _, m in sorted(units, key=lambda x: -x[0])]


def _world(rank: int, world_size: int, *, oracle_dir: str, archs: tuple[str, ...]) -> bytes:
    import torch.distributed as dist
    from conversion_models import tiny_model
    from fsdp_worlds import no_collectives, pack, save_oracle
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts = {}
    for arch in archs:
        d = os.path.join(oracle_dir, arch)
        if rank == 0:
            ref = tiny_model(arch, seed=3)
            save_oracle(ref, d)
            save_oracle(ref, d + "-bf16", torch.bfloat16)
        dist.barrier()
        for origin in ("config", "pretrained"):
            for sharding in ("blocks", "root"):
                if origin == "pretrained" and sharding == "root":
                    continue
                model = tiny_model(arch, seed=3) if origin == "config" else _load(arch, d)
                for unit in _blocks(model) if sharding == "blocks" else []:
                    fully_shard(unit, mesh=mesh)
                fully_shard(model, mesh=mesh)
                for dtype in (torch.float32, torch.bfloat16):
                    if origin == "pretrained" and dtype is torch.bfloat16:
                        continue
                    src = FSDPSource(model, dtype=dtype)
                    with no_collectives():
                        meta = [(m.name, tuple(m.shape), m.dtype) for m in src.metadata]
                    got = {n: t.detach().clone() for n, t in src.iter_full()}
                    f = facts[(arch, origin, sharding, str(dtype))] = dict(
                        meta=meta, got=got, cls=type(model).__name__, held=_held(src),
                    )
                    if (origin, sharding, dtype) == ("config", "blocks", torch.float32):
                        # iter_local: converted entries go out whole; iter_pieces (delta sync): the
                        # converted entries whole from rank 0, the rest as this rank's boxes.
                        f["local_names"] = [n for n, _ in src.iter_local()]
                        f["pieces"] = [
                            (p.name, p.offsets, p.tensor.detach().to(dtype).clone())
                            for p in src.iter_pieces() if p.tensor is not None
                        ]
                        f["held_after"] = _held(src)
                        # one gather group per tensor: a concatenation's members span groups
                        tiny = FSDPSource(model, dtype=dtype, group_bytes=1)
                        f["one_per_group"] = {n: t.detach().clone() for n, t in tiny.iter_full()}
                    if (origin, sharding, dtype) == ("config", "blocks", torch.bfloat16):
                        # the converted stream through save_safetensors and FP8Source, unchanged
                        from weightsync.plugins.checkpoint import save_safetensors
                        from weightsync.sources import FP8Source

                        save_safetensors(src, os.path.join(oracle_dir, f"{arch}-written"))
                        fp8 = FP8Source(src)
                        f["fp8"] = ([m.name for m in fp8.metadata], [n for n, _ in fp8.iter_full()])
    return pack(facts)


def _held(src) -> int:
    return sum(e.transform.held_bytes() for e in src.entries if hasattr(e.transform, "held_bytes"))


def _load(arch: str, directory: str) -> torch.nn.Module:
    from conversion_models import TINY

    import transformers

    kind = TINY[arch][0]
    auto = {"causal": transformers.AutoModelForCausalLM, "vlm": transformers.AutoModelForImageTextToText}
    cls = auto[kind] if kind in auto else getattr(transformers, kind)
    return cls.from_pretrained(directory)


@pytest.mark.slow
def test_fsdp2_streams_save_pretrained_names_and_bytes(tmp_path):
    from fsdp_worlds import load_oracle, unpack

    res = unpack(run_world(_world, 2, oracle_dir=str(tmp_path), archs=ARCHS, timeout=400))
    for arch in ARCHS:
        oracles = {"torch.float32": load_oracle(str(tmp_path / arch)),
                   "torch.bfloat16": load_oracle(str(tmp_path / f"{arch}-bf16"))}
        for rank, facts in res.items():
            keys = [k for k in facts if k[0] == arch]
            assert len(keys) == 5, keys
            for key in keys:
                f = facts[key]
                ref = oracles[key[3]]
                assert f["cls"].startswith("FSDP"), key
                assert sorted(f["got"]) == sorted(ref), (rank, key, sorted(set(f["got"]) ^ set(ref))[:4])
                assert [m[0] for m in f["meta"]] == list(f["got"]), (rank, key)  # stream in metadata order
                for name, shape, dtype in f["meta"]:
                    t = f["got"][name]
                    assert tuple(t.shape) == shape == tuple(ref[name].shape) and t.dtype == dtype, (rank, key, name)
                    # the wire keeps routers in fp32 (dtype_policy): compare in the file's dtype
                    assert torch.equal(t.to(ref[name].dtype), ref[name]), (rank, key, name)
                assert f["held"] == 0, (rank, key)
                if "pieces" in f:
                    assert list(f["one_per_group"]) == list(f["got"]), (rank, key)
                    assert all(torch.equal(f["one_per_group"][n], t) for n, t in f["got"].items()), (rank, key)
                    assert sorted(set(f["local_names"])) == sorted(ref), (rank, key)
                    assert f["held_after"] == 0, (rank, key)
        written = load_oracle(str(tmp_path / f"{arch}-written"))
        ref16 = oracles["torch.bfloat16"]
        assert sorted(written) == sorted(ref16), arch
        assert all(torch.equal(t.to(ref16[n].dtype), ref16[n]) for n, t in written.items()), arch
        for facts in res.values():
            fp8_meta, fp8_names = facts[(arch, "config", "blocks", "torch.bfloat16")]["fp8"]
            assert fp8_names == fp8_meta and {n for n in fp8_names if not n.endswith("_scale_inv")} == set(ref16), arch
        pieces = [p for facts in res.values() for p in facts[(arch, "config", "blocks", "torch.float32")]["pieces"]]
        ref = oracles["torch.float32"]
        assert {p[0] for p in pieces} == set(ref), arch
        full = {n: torch.full(t.shape, float("nan"), dtype=t.dtype) for n, t in ref.items() if t.is_floating_point()}
        for name, offsets, t in pieces:
            if name in full:
                full[name][tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
        for name, t in full.items():
            assert torch.equal(t, ref[name]), (arch, "pieces", name)


def test_lora_on_a_converted_model(tmp_path):
    """PEFT LoRA (one process, plain model): adapters on tensors transformers does not convert go
    out merged under save_pretrained's names next to the converted tensors (what
    ``merge_and_unload().save_pretrained()`` writes); an adapter on a converted tensor is refused,
    naming the module."""
    import copy

    from conversion_models import tiny_model
    from fsdp_worlds import load_oracle
    from peft import LoraConfig, get_peft_model

    from weightsync.sources import FSDPSource
    from weightsync.sources.core.ground.errors import UnsupportedAdapterError

    model = get_peft_model(tiny_model("minimax_m3_vl", seed=1), LoraConfig(r=4, target_modules=["o_proj"],
                                                                          init_lora_weights=False))
    got = {n: t.clone() for n, t in FSDPSource(model).iter_full()}
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path)
    ref = load_oracle(str(tmp_path))
    assert sorted(got) == sorted(ref)
    assert any(".block_sparse_moe.shared_experts.gate_proj." in n for n in got)  # converted: split, renamed
    for n, t in ref.items():
        assert torch.allclose(got[n], t, rtol=0, atol=1e-6), n
    bad = get_peft_model(tiny_model("minimax_m3_vl", seed=1), LoraConfig(r=4, target_modules=["gate_up_proj"]))
    with pytest.raises(UnsupportedAdapterError, match=r"shared_experts\.gate_up_proj.*transform"):
        FSDPSource(bad).metadata


def test_a_pass_stopped_mid_group_leaves_the_next_pass_exact():
    """A consumer that stops while a concatenation holds some of its members (Kimi-K2.5's vision
    q/k/v -> wqkv) leaves nothing that changes the next pass: it restarts the group."""
    from conversion_models import saved_layout, tiny_model

    from weightsync.sources import FSDPSource

    model = tiny_model("kimi_k25", seed=2)
    src = FSDPSource(model)
    full = {n: t.clone() for n, t in src.iter_full()}
    held = [e for e in src.entries if hasattr(e.transform, "held_bytes")]
    it = src.iter_full()
    for name, _ in it:
        if held[0].transform.held_bytes():
            break
    else:
        raise AssertionError("no conversion group held a member")
    it.close()
    again = {n: t.clone() for n, t in src.iter_full()}
    assert list(again) == list(full) and all(torch.equal(again[n], t) for n, t in full.items())
    assert {n: tuple(t.shape) for n, t in full.items()} == {n: s for n, (s, _) in saved_layout(model).items()}


def _tp_world(rank: int, world_size: int, *, oracle_dir: str) -> bytes:
    """FSDP + TP (a (1, 2) dp x tp mesh): MiniMax-M3-VL's fused shared-expert ``gate_up_proj`` --
    which the checkpoint splits -- column-parallel, ``down_proj`` / ``o_proj`` row-parallel."""
    import torch.distributed as dist
    from conversion_models import tiny_model
    from fsdp_worlds import pack, save_oracle
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    model = tiny_model("minimax_m3_vl", seed=4)
    if rank == 0:
        save_oracle(model, oracle_dir, torch.bfloat16)
    dist.barrier()
    plan = {
        "mlp.shared_experts.gate_up_proj": ColwiseParallel(),
        "mlp.shared_experts.down_proj": RowwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    for layer in model.model.language_model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    src = FSDPSource(model, dtype=torch.bfloat16)
    placements = sorted({repr(p.placements) for n, p in model.named_parameters() if "shared_experts.gate_up" in n})
    return pack(dict(got={n: t.detach().clone() for n, t in src.iter_full()}, placements=placements))


@pytest.mark.slow
def test_fsdp_tp_converted_tensor_streams_save_pretrained(tmp_path):
    from fsdp_worlds import load_oracle, unpack

    res = unpack(run_world(_tp_world, 2, oracle_dir=str(tmp_path), timeout=300))
    ref = load_oracle(str(tmp_path))
    for rank, f in res.items():
        assert f["placements"] and all(p.count("Shard") == 2 for p in f["placements"]), f["placements"]  # dp x tp
        assert sorted(f["got"]) == sorted(ref), rank
        for n, t in ref.items():
            assert torch.equal(f["got"][n].to(t.dtype), t), (rank, n)
