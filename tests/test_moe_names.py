"""Expert names/shapes/bytes against the oracles: transformers' ``save_pretrained`` (per_expert)
and its in-memory fused tensors + vLLM's own fused-expert mapping (fused).

Single-process: these are the pure transforms both sources share; the multi-rank paths are in
test_moe_megatron.py / test_moe_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from moe_models import FAMILIES, fused_params, saved_state_dict, tiny_model

from weightsync.sources.core.ground.errors import UnmappedParameterError
from weightsync.sources.core.hf.experts import (
    ExpertLayerSpec,
    ExpertTransform,
    FusedExpertBuffer,
    expert_batches,
    split_fused,
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_per_expert_equals_save_pretrained(family):
    model = tiny_model(family)
    saved = saved_state_dict(model)
    fused = fused_params(model)
    assert fused, f"{family}: tiny model has no fused experts (transformers changed?)"
    params = dict(model.named_parameters())
    before = {n: params[n].detach().clone() for n in fused}
    tr = ExpertTransform(model, fused, expert_layout="per_expert")
    exported: dict[str, torch.Tensor] = {}
    declared: list[tuple[str, tuple]] = []
    for name in fused:
        declared += tr.entries(name)
        for k, t in tr.apply(name, params[name].detach()):
            assert k not in exported, k
            assert t.is_contiguous(), k
            assert t.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr(), (
                f"{k}: per_expert export copied instead of viewing the fused tensor"
            )
            exported[k] = t
    saved_experts = {k: v for k, v in saved.items() if ".experts." in k}
    assert sorted(exported) == sorted(saved_experts)
    assert [n for n, _ in declared] == list(exported)  # metadata order == stream order
    for k, t in exported.items():
        assert dict(declared)[k] == tuple(t.shape) == tuple(saved[k].shape), k
        assert t.dtype == saved[k].dtype and torch.equal(t, saved[k]), k
    for n in fused:  # never mutate what the user passed
        assert torch.equal(params[n], before[n])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_equals_in_memory_and_vllm_mapping(family):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    model = tiny_model(family)
    saved = saved_state_dict(model)
    fused = fused_params(model)
    params = dict(model.named_parameters())
    tr = ExpertTransform(model, fused, expert_layout="fused")
    for name in fused:
        out = list(tr.apply(name, params[name].detach()))
        assert len(out) == 1 and tr.entries(name) == [(out[0][0], tuple(out[0][1].shape))]
        wire_name, t = out[0]
        assert torch.equal(t, params[name])
        spec = tr.specs[name.rpartition(".")[0]]
        # vLLM's own mapping for this checkpoint's leaf names must claim the fused name.
        mapping = RoutedExperts.build_expert_params_mapping(
            spec.gate.removesuffix(".weight"), spec.down.removesuffix(".weight"),
            spec.up.removesuffix(".weight"), spec.num_experts, include_fused=True,
        )
        hits = [(p, w, eid, sid) for p, w, eid, sid in mapping if w in wire_name and "." not in w.split("experts.", 1)[1]]
        if name.endswith("gate_up_proj"):
            assert [(eid, sid) for _, _, eid, sid in hits] == [(0, "w1"), (1, "w3")], (wire_name, hits)
        else:
            assert [sid for *_, sid in hits] == ["w2"], (wire_name, hits)
        # vLLM chunks the fused gate_up in two along dim 1: chunk 0 must be every expert's gate.
        if name.endswith("gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            assert torch.equal(gate[1], saved[spec.expert_name(1, "gate")])
            assert torch.equal(up[1], saved[spec.expert_name(1, "up")])


def test_fused_buffer_and_batches():
    spec = ExpertLayerSpec("model.layers.0.mlp.experts", num_experts=5, hidden=6, intermediate=4)
    g = [torch.randn(4, 6) for _ in range(5)]
    u = [torch.randn(4, 6) for _ in range(5)]
    d = [torch.randn(6, 4) for _ in range(5)]
    buf = FusedExpertBuffer(spec, torch.float32)
    for e in (3, 0, 4, 1):
        buf.put(e, g[e], u[e], d[e])
    with pytest.raises(ValueError, match=r"experts \[2\] never arrived"):
        buf.take()
    buf.put(2, g[2], u[2], d[2])
    with pytest.raises(ValueError, match="expert 2 was put twice"):
        buf.put(2, g[2], u[2], d[2])
    with pytest.raises(ValueError, match="expert 0 up has shape"):
        FusedExpertBuffer(spec, torch.float32).put(0, g[0], d[0], d[0])
    (n1, gu), (n2, dn) = buf.take()
    assert (n1, n2) == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    assert torch.equal(gu, torch.stack([torch.cat([g[e], u[e]]) for e in range(5)]))
    assert torch.equal(dn, torch.stack(d))
    # and back: split_fused recovers every piece
    back = dict(split_fused(spec, "gate_up", gu)) | dict(split_fused(spec, "down", dn))
    assert torch.equal(back["model.layers.0.mlp.experts.3.up_proj.weight"], u[3])
    per = spec.expert_bytes(torch.float32)
    assert expert_batches(5, per, 2 * per) == [range(0, 2), range(2, 4), range(4, 5)]
    assert expert_batches(5, per, 1) == [range(e, e + 1) for e in range(5)]


def test_bad_input_names_the_parameter():
    model = tiny_model("qwen3_moe")
    fused = fused_params(model)
    name = next(iter(fused))
    with pytest.raises(ValueError, match="expert_layout='stacked'"):
        ExpertTransform(model, fused, expert_layout="stacked")
    with pytest.raises(UnmappedParameterError, match="needs both gate_up_proj and down_proj"):
        ExpertTransform(model, {name: fused[name]})
    bad = dict(fused)
    bad[name] = (fused[name][0], fused[name][1] + 2, fused[name][2])
    with pytest.raises(UnmappedParameterError, match=name.rpartition(".")[0]):
        ExpertTransform(model, bad)
    tr = ExpertTransform(model, fused)
    with pytest.raises(ValueError, match="expected a"):
        list(tr.apply(name, torch.zeros(1, 2, 3)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_megatron_side_names_equal_save_pretrained(family):
    """HFMoENames (used by the Megatron exporter, built from hf_config alone on a meta model) names
    every MLP tensor save_pretrained writes for each MoE layer -- no more, no fewer, same shapes."""
    from weightsync.sources.megatron.moe_names import HFMoENames

    model = tiny_model(family)
    saved = saved_state_dict(model)
    names = HFMoENames(model.config)
    assert names.moe_layers() == sorted({int(k.split(".")[2]) for k in saved if ".experts." in k})
    for layer in names.moe_layers():
        L = names.layer(layer)
        ours = {L.router[0]: L.router[1], **dict(L.experts.entries("per_expert"))}
        for extra in (L.router_bias, L.shared_gate, *(L.shared or ())):
            if extra is not None:
                ours[extra[0]] = extra[1]
        pre = f"model.layers.{layer}."
        theirs = {
            k: tuple(v.shape)
            for k, v in saved.items()
            if k.startswith(pre) and not k.startswith(pre + "self_attn") and "layernorm" not in k
        }
        assert ours == theirs
    with pytest.raises(UnmappedParameterError, match="no routed experts there"):
        names.layer(10_000)
