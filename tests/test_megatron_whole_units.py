"""MegatronSource at TP1: units rank 0 holds whole and whose HF tensors are views of the parameter
are split once, at construction (``sources/megatron/whole_units.py``). A pass must still yield
the parameter's current values and storage: after an in-place update (the optimizer step), and
after the parameter's storage is replaced (``param.data = ...``: an offload, a resharding).
"""

from __future__ import annotations

import torch
from worlds import run_world


def _rank(rank, world_size):
    import megatron_worlds as mw

    from weightsync.sources import MegatronSource

    cfg = mw.hf_config("qwen3", layers=2)
    mw.init_parallel(1, 1)
    model = mw.megatron_model(cfg)
    src = MegatronSource(model, hf_config=cfg)
    steps = [s for _u, s, _m in src._steps if s is not None]
    facts = {"with_views": sum(s.views is not None for s in steps), "steps": len(steps)}
    params = dict(model.named_parameters())
    fc2 = params["decoder.layers.0.mlp.linear_fc2.weight"]
    fc1 = params["decoder.layers.1.mlp.linear_fc1.weight"]
    name2, name1 = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def export():
        return {n: t.clone() for n, t in src.iter_full()}

    first = export()
    facts["first_equal"] = torch.equal(first[name2], fc2.detach())
    with torch.no_grad():
        fc2.add_(1.0)  # in place: the views see it
    second = export()
    facts["inplace_seen"] = torch.equal(second[name2], fc2.detach()) and not torch.equal(second[name2], first[name2])
    fc2.data = fc2.detach().clone() * 3  # new storage: the views made at construction are stale
    fc1.data = fc1.detach().clone() - 1
    third = export()
    facts["replaced_seen"] = torch.equal(third[name2], fc2.detach())
    half = fc1.shape[0] // 2
    facts["replaced_glu_seen"] = torch.equal(third[name1], fc1.detach()[half:])
    with torch.no_grad():
        fc2.mul_(0.5)  # and in-place updates of the new storage are seen too
    pairs = list(src.iter_full())
    got = dict(pairs)[name2]
    facts["new_storage_aliased"] = got.data_ptr() == fc2.data_ptr() and torch.equal(got, fc2.detach())
    facts["tensors"] = len(pairs) == len(src.metadata)
    # a bf16 wire from this fp32 model: small tensors go through the batched cast; those whose
    # split is the tensor itself (norms, row/column matrices) are yielded as their cast piece
    bf = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16)
    facts["identity_steps"] = sum(s.identity for _u, s, _m in bf._steps if s is not None)
    got = {n: t.clone() for n, t in bf.iter_full()}
    norm = params["decoder.final_layernorm.weight"]
    facts["bf16_equal"] = (
        torch.equal(got[name2], fc2.detach().to(torch.bfloat16))
        and torch.equal(got["model.norm.weight"], norm.detach().to(torch.bfloat16))
        and torch.equal(got[name1], fc1.detach()[half:].to(torch.bfloat16))
        and len(got) == len(bf.metadata)
    )
    return facts


def test_views_split_once_follow_the_parameter():
    f = run_world(_rank, 1, timeout=300)[0]
    assert f["with_views"] > 0 and f["with_views"] < f["steps"], f  # QKV copies; the rest are views
    assert f["first_equal"] and f["inplace_seen"], f
    assert f["replaced_seen"] and f["replaced_glu_seen"] and f["new_storage_aliased"], f
    assert f["tensors"], f
    assert f["identity_steps"] > 0 and f["bf16_equal"], f
