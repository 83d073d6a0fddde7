"""The real passes ``tests/test_plan.py`` holds ``weightsync plan``'s predictions against.

One 4-rank gloo world runs every scenario in turn, each the way a trainer would build it (FSDP2
over each decoder layer then the root, HSDP 2 x 2, ``FP8Source`` over it, ``senders="owners"``,
Megatron TP2 x PP2, PP2 x VPP2 (DP2), TP2 x EP2 and PP2 x EP2 with MoE, ``DeltaSource`` over HSDP), and returns each
rank's ``PassStats`` of the second pass (steady state: the first pass also runs the cross-rank
agreement and, for MoE, the placement exchange) plus what the stream actually carried.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

SMALL_GROUP_BYTES = 16 << 10  # FSDP gather groups split inside a unit, as 64 MiB does at real sizes


def _stats(src: Any) -> dict:
    d = src.last_pass.as_dict()
    return {k: d[k] for k in ("tensors", "bytes", "collectives", "bytes_received", "peak_extra_bytes")}


def _drain(src: Any) -> tuple[int, int]:
    n = b = 0
    for _, t in src.iter_full():
        n += 1
        b += t.numel() * t.element_size()
    return n, b


def _fsdp(config: Any, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from weightsync.plugins.testbed.presets import build_model

    model = build_model(config, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def world_plan(rank: int, world_size: int, *, dense_dir: str, moe_dir: str) -> dict:
    from many_senders_worlds import skip_reason
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.plugins.testbed.megatron import MegatronParallel, build_megatron_gpt
    from weightsync.plugins.testbed.presets import load_config
    from weightsync.sources import DeltaSource, FP8Source, FSDPSource, MegatronSource

    dense, moe = load_config(None, dense_dir), load_config(None, moe_dir)
    out: dict[str, Any] = {}

    # FSDP2 over 4 ranks, MoE (fused experts -> per-expert names), small gather groups
    model = _fsdp(moe, init_device_mesh("cpu", (world_size,)))
    src = FSDPSource(model, dtype=torch.bfloat16, group_bytes=SMALL_GROUP_BYTES)
    _drain(src)
    _drain(src)
    out["fsdp"] = _stats(src)

    del src, model

    # HSDP 2 x 2: one sender, then FP8Source over it, then senders="owners"
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = _fsdp(dense, mesh)
    src = FSDPSource(model, dtype=torch.bfloat16)
    _drain(src)
    _drain(src)
    out["hsdp"] = _stats(src)
    fp8 = FP8Source(src)
    _drain(fp8)
    n, b = _drain(fp8)
    out["hsdp_fp8"] = {**_stats(src), "tensors": n, "bytes": b}
    if skip_reason() is None:  # many senders: vLLM 0.34+
        owners = FSDPSource(model, dtype=torch.bfloat16, senders="owners")
        _drain(owners)
        _drain(owners)
        out["hsdp_owners"] = _stats(owners)
        del owners
    # DeltaSource over it (one wire dtype, bf16): an anchor, then every 7th element of every shard moved by 1.0
    delta = DeltaSource(src)
    list(delta.iter_patches())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.view(-1)[::7] += 1.0
    list(delta.iter_patches())
    r = delta.last_round
    out["delta"] = {"anchor": r.anchor, "changed": r.changed, "elements": r.elements, "tensors": r.tensors,
                    "wire_bytes": r.wire_bytes}
    del src, fp8, model, delta
    dist.barrier()

    # Megatron: dense TP2 x PP2 and PP2 x VPP2 (two data-parallel replicas); MoE TP2 x EP2 (ETP 2), PP2 x EP2
    from megatron.core import parallel_state as ps

    for key, cfg, par in (("megatron_tp2_pp2", dense, MegatronParallel(tp=2, pp=2)),
                          ("megatron_tp2_ep2", moe, MegatronParallel(tp=2, ep=2)),
                          ("megatron_pp2_ep2", moe, MegatronParallel(pp=2, ep=2)),
                          ("megatron_pp2_vpp2", dense, MegatronParallel(pp=2, vpp=2))):
        chunks = build_megatron_gpt(cfg, par, seed=0)
        msrc = MegatronSource(chunks if par.vpp else chunks[0], hf_config=cfg, dtype=torch.bfloat16, mode="full")
        _drain(msrc)
        _drain(msrc)
        out[key] = _stats(msrc)
        del msrc, chunks
        ps.destroy_model_parallel()
        dist.barrier()
    return out
