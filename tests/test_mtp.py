"""The speculative-decoding draft (multi-token prediction) follows the policy: ``MegatronSource(part="mtp")``
and ``WeightSync(draft=...)``, on 2 gloo ranks (one world, many checks).

Oracles, none of them ``MegatronSource``'s own mapping of the MTP block:

* **Names**: vLLM 0.34's own MTP loaders (``DeepSeekMTP.load_weights``, ``Glm4MoeMTP.load_weights``)
  run on the rank-0 export over a stand-in module whose parameters are the draft model's: every
  exported tensor must reach a parameter's ``weight_loader`` (none skipped) and every draft parameter
  must be loaded.
* **Values**: in the world, the MTP block's decoder layer is megatron's last decoder layer times 2
  (copied module to module, shard by shard, experts and expert bias included), so its export must be
  exactly 2x the policy export of that layer (the policy export is checked against transformers
  elsewhere); the MTP layer's own norms and ``eh_proj`` are compared with megatron-core's parameters
  gathered by the test (``eh_proj``: column shards in TP order); the embedding / head copies with the
  policy's ``model.embed_tokens.weight`` / ``lm_head.weight``. Byte for byte.
* **The draft round**: ``WeightSync(draft=...)`` against vLLM's own RL HTTP router (``VLLMRouterServer``)
  through ``VLLMHTTPClient``: the route order, one ``weight_version`` for both rounds, and the bytes
  that arrived.
"""

from __future__ import annotations

import base64
import dataclasses
import re
from typing import Any, ClassVar

import pytest
import torch
from fsdp_worlds import unpack
from worlds import run_world as _run_world

LAYOUTS = [("dsv3", "tp2"), ("dsv3", "pp2"), ("dsv3", "ep2"), ("glm", "tp2")]
PAR = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


def _hf(kind: str) -> Any:
    if kind == "dsv3":
        from mla_models import hf_config

        return hf_config(num_nextn_predict_layers=1)
    from family_worlds import preset_config

    return preset_config("tiny-glm4-moe", "Glm4MoeForCausalLM", num_nextn_predict_layers=1)


def _build(hf: Any, layout: str) -> list[torch.nn.Module]:
    from mla_models import build_megatron

    from weightsync.plugins.megatron_build import MegatronParallel

    tp, pp, ep = PAR[layout]
    return build_megatron(hf, MegatronParallel(tp, pp, None, ep), seed=5, overrides={"mtp_num_layers": 1})


def _mtp_from_last_layer(chunks: list[torch.nn.Module]) -> None:
    """On the stage holding the MTP block: its decoder layer := 2 x the decoder's last layer (module to
    module, this rank's shard), its own norms / eh_proj := distinct seeded values."""
    chunk = chunks[-1]
    mtp = getattr(chunk, "mtp", None)
    if mtp is None:
        return
    last = chunk.decoder.layers[-1]
    block = mtp.layers[0].transformer_layer
    src = dict(last.named_parameters())
    src.update({n: b for n, b in last.named_buffers() if n.endswith("router.expert_bias")})
    with torch.no_grad():
        for n, t in [*block.named_parameters(), *((n, b) for n, b in block.named_buffers() if n.endswith("router.expert_bias"))]:
            t.copy_(2 * src[n])
        from megatron.core import parallel_state as ps

        g = torch.Generator().manual_seed(100 + ps.get_tensor_model_parallel_rank())
        for name in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            w = getattr(mtp.layers[0], name).weight
            w.copy_(torch.randn(w.shape, generator=g) if name == "eh_proj" else 1 + 0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(hash(name) % 1000)))


def _own_params(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """Every rank: (tp rank, this rank's MTP-layer own tensors) or None off the MTP stage."""
    from megatron.core import parallel_state as ps

    mtp = getattr(chunks[-1], "mtp", None)
    if mtp is None:
        return None
    layer = mtp.layers[0]
    return {"tp": ps.get_tensor_model_parallel_rank(),
            **{n: getattr(layer, n).weight.detach().clone() for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")}}


def _world(rank: int, world_size: int) -> bytes:
    import torch.distributed as dist
    from fsdp_worlds import pack
    from megatron.core import parallel_state as ps
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    out: dict[str, Any] = {}
    for kind, layout in LAYOUTS:
        hf = _hf(kind)
        chunks = _build(hf, layout)
        _mtp_from_last_layer(chunks)
        model = chunks if len(chunks) > 1 else chunks[0]
        policy = MegatronSource(model, hf_config=hf)
        draft = MegatronSource(model, hf_config=hf, part="mtp")
        got_policy = {n: t.clone() for n, t in policy.iter_full()}
        got_draft = {n: t.clone() for n, t in draft.iter_full()}
        own: list[Any] = [None] * world_size
        dist.all_gather_object(own, _own_params(chunks))
        out[f"{kind}/{layout}"] = {
            "policy": got_policy, "draft": got_draft, "own": own,
            "policy_meta": [m.name for m in policy.metadata],
            "draft_meta": [(m.name, tuple(m.shape), m.owners) for m in draft.metadata],
        }
        if (kind, layout) == ("dsv3", "tp2"):
            out["round"] = _draft_round(rank, model, hf)
            q = _hf(kind)
            q.architectures = ["Qwen3MoeForCausalLM"]
            out["refuse_family"] = errors_of(MegatronSource, model, hf_config=q, part="mtp")
            out["refuse_engines"] = {b: errors_of(_weight_sync_with, b, rank, policy, draft) for b in
                                     ("sparse_nccl", "nccl_m2n", "sharded_rdt")}
            out["refuse_part"] = errors_of(MegatronSource, model, hf_config=hf, part="draft")
        ps.destroy_model_parallel()
    return pack(out if rank == 0 else {k: v for k, v in out.items() if k.startswith("refuse")})


def _weight_sync_with(name: str, rank: int, policy: Any, draft: Any) -> None:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo

    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync

    @dataclasses.dataclass
    class Info(TrainerInitInfo):
        backend: ClassVar[str] = name

    WeightSync(policy, Info(rank=rank), VLLMHTTPClient("http://127.0.0.1:9"), draft=draft, check=False)


def _draft_round(rank: int, model: Any, hf: Any) -> dict[str, Any]:
    """``WeightSync(draft=...)`` through vLLM's own RL router (rank 0 serves it) with the test_json
    engine (tensors ride the ``update_weights`` bodies): the recorded engine calls."""
    import json_engine  # noqa: F401  (registers backend "test_json")
    import torch.distributed as dist
    from vllm_devserver import RecordingEngineClient, VLLMRouterServer

    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.sources import MegatronSource

    class DraftEngine(RecordingEngineClient):
        async def start_draft_weight_update(self) -> None:
            await self._call("start_draft_weight_update")

    server = VLLMRouterServer() if rank == 0 else None
    if server is not None:
        server.engine = server.server.config.app.state.engine_client = DraftEngine()
        server.__enter__()
    url = [server.url if server else None]
    dist.broadcast_object_list(url, src=0)
    try:
        sync = WeightSync(MegatronSource(model, hf_config=hf), json_engine.JSONTrainerInitInfo(rank=rank, chunk=8),
                          VLLMHTTPClient(url[0]), draft=MegatronSource(model, hf_config=hf, part="mtp"), pause="keep")
        report = sync.sync(7)
        sync.shutdown()
        return {"calls": list(server.engine.calls) if server else None, "version": report.weight_version}
    finally:
        if server is not None:
            server.__exit__()


@pytest.fixture(scope="module")
def world() -> dict[int, Any]:
    return unpack(_run_world(_world, 2, timeout=600))


def _decode(calls: list) -> list[tuple[str, Any]]:
    from safetensors.torch import load

    out = []
    for name, arg in calls:
        if name == "update_weights":
            arg = load(base64.b64decode(arg["safetensors_b64"]))
        out.append((name, arg))
    return out


# ---- values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [f"{k}/{lay}" for k, lay in LAYOUTS])
def test_mtp_export_is_megatrons_mtp_block_byte_for_byte(world, case):
    """Under TP2 / PP2 / EP2: the draft's decoder block is exactly 2x the policy's last layer, its own
    norms and eh_proj are megatron's parameters, the embedding / head copies are the policy's (vocab
    padding trimmed); the policy export of a model with an MTP block has no MTP tensor."""
    r = world[0][case]
    pol, dr = r["policy"], r["draft"]
    n = len({int(m.split(".")[2]) for m in pol if m.startswith("model.layers.")})  # num_hidden_layers
    own = [o for o in r["own"] if o is not None]
    assert own, "no rank reported the MTP block"
    pre = f"model.layers.{n}."
    assert list(dr) == [m[0] for m in r["draft_meta"]]
    assert all(m.startswith(pre) for m in dr), sorted(dr)[:3]
    assert not any(m.startswith(pre) for m in pol) and r["policy_meta"] == list(pol)
    block = {m for m in dr if not re.search(r"\.(enorm|hnorm|eh_proj|embed_tokens|shared_head\.\w+)\.weight$", m)}
    assert len(block) > 10
    for m in block:
        want = pol[f"model.layers.{n - 1}." + m[len(pre):]]
        assert torch.equal(dr[m], 2 * want), m
    by_tp = list({o["tp"]: o for o in reversed(own)}.values())  # one per TP rank (EP2: two DP replicas)
    by_tp.sort(key=lambda o: o["tp"])
    assert torch.equal(dr[pre + "eh_proj.weight"], torch.cat([o["eh_proj"] for o in by_tp], 0))
    for hf_name, mg in (("enorm", "enorm"), ("hnorm", "hnorm"), ("shared_head.norm", "final_layernorm")):
        assert torch.equal(dr[f"{pre}{hf_name}.weight"], own[0][mg]), hf_name
    assert not torch.equal(own[0]["enorm"], own[0]["hnorm"])
    assert torch.equal(dr[pre + "embed_tokens.weight"], pol["model.embed_tokens.weight"])
    assert torch.equal(dr[pre + "shared_head.head.weight"], pol["lm_head.weight"])
    assert all(o == (0,) for _, _, o in r["draft_meta"])


# ---- names: vLLM's own MTP loaders ------------------------------------------------------------------


def _vllm_names(kind: str, hf: Any, n: int) -> list[str]:
    """The draft model's parameters (vLLM 0.34 module tree of DeepSeekMTP / Glm4MoeMTP, one MTP layer)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    b = f"model.layers.{n}."
    blk = b + "mtp_block."
    names = ["model.embed_tokens.weight"] + [b + s for s in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")]
    names += [blk + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                                "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_up_proj.weight",
                                "mlp.shared_experts.down_proj.weight", "self_attn.o_proj.weight")]
    if kind == "dsv3":
        names += [blk + "self_attn." + s for s in ("fused_qkv_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                                   "kv_a_layernorm.weight", "kv_b_proj.weight")]
    else:
        names += [blk + "self_attn.qkv_proj.weight"]
        if getattr(hf, "attention_bias", False):
            names += [blk + "self_attn.qkv_proj.bias"]
        if getattr(hf, "use_qk_norm", False):
            names += [blk + "self_attn.q_norm.weight", blk + "self_attn.k_norm.weight"]
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", hf.n_routed_experts)
    names += sorted({(blk + "mlp." + w + "weight").replace(w, p) for p, w, _, _ in mapping})
    return names


def _run_vllm_loader(kind: str, hf: Any, exported: dict[str, torch.Tensor]) -> tuple[set[str], list, set[str]]:
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
    from vllm.model_executor.models.glm4_moe_mtp import Glm4MoeMTP

    n = hf.num_hidden_layers
    calls: list[tuple[str, tuple, dict]] = []

    class Param(torch.nn.Parameter):
        pass

    class Stub(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = hf
            self.fused_shared_expert_layers = set()
            self.model = type("M", (), {"mtp_start_layer_idx": n})()
            self._names = _vllm_names(kind, hf, n)

        def named_parameters(self, *a: Any, **k: Any):  # type: ignore[override]
            for name in self._names:
                p = Param(torch.empty(0), requires_grad=False)

                def loader(param, weight, *args, _name=name, **kw):
                    calls.append((_name, tuple(weight.shape), {**kw, "args": args}))
                    return True

                p.weight_loader = loader
                yield name, p

    cls = DeepSeekMTP if kind == "dsv3" else Glm4MoeMTP
    stub = Stub()
    stub._rewrite_spec_layer_name = cls._rewrite_spec_layer_name.__get__(stub)
    loaded = cls.load_weights(stub, list(exported.items()))
    return loaded, calls, set(_vllm_names(kind, hf, n))


@pytest.mark.parametrize("kind", ["dsv3", "glm"])
def test_mtp_names_are_what_vllms_mtp_loader_consumes(world, kind):
    """vLLM's own DeepSeekMTP / Glm4MoeMTP ``load_weights``: every exported tensor lands in a draft
    parameter's loader (none skipped), every draft parameter is loaded, experts by expert id."""
    hf = _hf(kind)
    exported = world[0][f"{kind}/tp2"]["draft"]
    loaded, calls, params = _run_vllm_loader(kind, hf, exported)
    assert len(calls) == len(exported), (len(calls), len(exported))
    assert loaded == params, (sorted(params - loaded)[:5], sorted(loaded - params)[:5])
    experts = [c for c in calls if "expert_id" in c[2]]
    assert sorted({c[2]["expert_id"] for c in experts}) == list(range(hf.n_routed_experts))
    assert len(experts) == 3 * hf.n_routed_experts


# ---- the draft round and the refusals ------------------------------------------------------------------


def test_draft_round_follows_the_policy_in_the_same_pause_with_the_same_version(world):
    """Through vLLM's RL router: pause, the policy round, ``start_draft_weight_update``, the draft round,
    both finished with weight_version "7", resume; the bytes that arrived are the two exports."""
    r = world[0]["round"]
    calls = _decode(r["calls"])
    names = [c for c, _ in calls if c != "update_weights"]
    assert names == ["init_weight_transfer_engine", "pause_generation", "start_weight_update", "finish_weight_update",
                     "start_draft_weight_update", "finish_weight_update", "resume_generation"], names
    assert [a for c, a in calls if c == "finish_weight_update"] == ["7", "7"] and r["version"] == "7"
    cut = [c for c, _ in calls].index("start_draft_weight_update")
    got_policy = {k: v for c, a in calls[:cut] if c == "update_weights" for k, v in a.items()}
    got_draft = {k: v for c, a in calls[cut:] if c == "update_weights" for k, v in a.items()}
    want = world[0]["dsv3/tp2"]
    assert set(got_policy) == set(want["policy"]) and set(got_draft) == set(want["draft"])
    assert all(torch.equal(got_draft[k], want["draft"][k]) for k in got_draft)
    assert all(torch.equal(got_policy[k], want["policy"][k]) for k in got_policy)


def test_refusals_are_named_on_every_rank(world):
    """A family without MTP names, an engine without draft support (each of vLLM's three), a bad part:
    refused on both ranks, naming the rank and what is wrong."""
    for rank, r in world.items():
        assert r["refuse_family"] and f"rank {rank}" in r["refuse_family"] and "qwen3_moe" in r["refuse_family"]
        assert "no multi-token-prediction names" in r["refuse_family"]
        for backend, err in r["refuse_engines"].items():
            assert err and f"rank {rank}" in err and backend in err and "supports_draft_weight_update" in err, err
        assert r["refuse_part"] and "'policy' or 'mtp'" in r["refuse_part"]


def test_draftless_backends_are_vllms():
    """``DRAFTLESS_BACKENDS`` is exactly vLLM's engines that declare ``supports_draft_weight_update = False``."""
    from vllm.distributed.weight_transfer import ipc_engine, m2n_engine, nccl_engine, sharded_rdt_engine
    from vllm.distributed.weight_transfer import sparse_nccl_engine

    from weightsync.plugins.sync.driver import DRAFTLESS_BACKENDS

    assert not m2n_engine.M2NWeightTransferEngine.supports_draft_weight_update
    assert not sharded_rdt_engine.ShardedRDTWeightTransferEngine.supports_draft_weight_update
    assert not sparse_nccl_engine.SparseNCCLWeightTransferEngine.supports_draft_weight_update
    assert nccl_engine.NCCLWeightTransferEngine.supports_draft_weight_update
    assert ipc_engine.IPCWeightTransferEngine.supports_draft_weight_update
    assert DRAFTLESS_BACKENDS == {"sparse_nccl", "nccl_m2n", "sharded_rdt"}
