"""FSDP2 MoE export through ``FSDPSource(model)`` (default: the checkpoint's per-expert layout),
``FSDPSource(transforms=[ExpertTransform.for_module(model)])`` and ``expert_layout="fused"``, 2 gloo
ranks, against ``save_pretrained`` of the same weights (per_expert: names, shapes, bytes of every
tensor, experts included -- Mixtral's ``block_sparse_moe`` renames too) and transformers' in-memory
fused tensors (fused).

Two shardings of the fused experts: FSDP2's default ``Shard(0)`` (each rank holds E/2 whole
experts: the expert dimension sharded over the mesh, as expert-parallel meshes do) and
``Shard(1)`` (every rank holds a slice of every expert).
"""

from __future__ import annotations

import pytest
import torch
from worlds import run_world

pytestmark = pytest.mark.slow


def _world(rank, world_size, *, families):
    from moe_models import tiny_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from weightsync.sources import FSDPSource
    from weightsync.sources.core.hf.experts import ExpertTransform

    mesh = init_device_mesh("cpu", (world_size,))
    facts = {}
    for family in families:
        for placement in ("shard0", "shard1"):
            model = tiny_model(family, seed=1)

            def place(p, placement=placement):
                return Shard(1) if placement == "shard1" and p.dim() == 3 else Shard(0)

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, shard_placement_fn=place)
            fully_shard(model, mesh=mesh, shard_placement_fn=place)
            experts_placements = {
                str(p.placements) for n, p in model.named_parameters() if n.endswith("gate_up_proj")
            }
            for layout in ("default", "per_expert", "fused"):
                if layout == "default":  # no option: the checkpoint's own (per-expert) layout
                    src = FSDPSource(model)
                elif layout == "per_expert":  # the hook, explicitly
                    src = FSDPSource(model, transforms=[ExpertTransform.for_module(model, expert_layout=layout)])
                else:  # the constructor option
                    src = FSDPSource(model, expert_layout=layout)
                tr = src.transforms[-1]
                meta = [m.name for m in src.metadata]
                got = {n: t.detach().clone() for n, t in src.iter_full()}
                fused_names = {
                    n: (s.fused_gate_up if n.endswith("gate_up_proj") else s.fused_down)
                    for s_mod, s in tr.specs.items()
                    for n in (f"{s_mod}.gate_up_proj", f"{s_mod}.down_proj")
                }
                facts[(family, placement, layout)] = dict(
                    got=got, meta_order=meta == list(got), placements=experts_placements,
                    tensors=src.last_pass.tensors, fused_names=fused_names, layout=tr.layout,
                )
    from fsdp_worlds import pack

    return pack(facts)


def test_fsdp2_moe_export_matches_save_pretrained():
    from moe_models import saved_state_dict, tiny_model

    families = ("qwen3_moe", "deepseek_v3", "mixtral", "glm4_moe")
    from fsdp_worlds import unpack

    res = unpack(run_world(_world, 2, families=families, timeout=400))
    for fam in families:
        ref = tiny_model(fam, seed=1)  # same seed, same weights as every rank's copy
        saved = saved_state_dict(ref)
        fused_ref = {n: p.detach() for n, p in ref.named_parameters() if p.dim() == 3}
        assert fused_ref
        for rank, facts in res.items():
            for placement in ("shard0", "shard1"):
                for layout in ("default", "per_expert"):
                    per = facts[(fam, placement, layout)]
                    assert per["layout"] == "per_expert"
                    assert sorted(per["got"]) == sorted(saved), (rank, fam, placement, layout)
                    for n, t in saved.items():
                        assert per["got"][n].dtype == t.dtype and torch.equal(per["got"][n], t), (rank, n)
                    assert per["meta_order"]
                fz = facts[(fam, placement, "fused")]
                assert fz["meta_order"]
                for n, t in fused_ref.items():
                    assert torch.equal(fz["got"][fz["fused_names"][n]], t), (rank, n)
                for n, t in saved.items():
                    if ".experts." not in n:
                        assert torch.equal(fz["got"][n], t), (rank, n)
                assert not any(".experts.0." in n for n in fz["got"])
                # fused: 2 tensors per MoE layer instead of 3E -> fewer, larger tensors
                assert fz["tensors"] < per["tensors"]
            assert facts[(fam, "shard0", "per_expert")]["placements"] == {"(Shard(dim=0),)"}
            assert facts[(fam, "shard1", "per_expert")]["placements"] == {"(Shard(dim=1),)"}
