"""The speculative-decoding draft (multi-token prediction) follows the policy: ``MegatronSource(part="mtp")``
and ``WeightSync(draft=...)``, on 2 gloo ranks (one world, many checks).

Oracles, none of them ``MegatronSource``'s own mapping of the MTP block:

* **Values**: the tests' own importer (``_import_mtp``): random checkpoint tensors under the names a
  released DeepSeek-V3 / GLM-4.5 checkpoint gives MTP layer 0 (``model.layers.{N}.``: the decoder
  block from transformers' ``save_pretrained`` table of the last layer -- MLA or GQA attention, MoE
  experts, shared expert, router and its bias --, ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm``, the ``embed_tokens`` / ``shared_head.head`` copies) are cut by the test into
  megatron-core's MTP block under TP2 / PP2 / EP2 (column / row shards, ``linear_fc1`` as
  ``[gate_r; up_r]``, this EP rank's experts, megatron's fused ``linear_qkv`` rows, the padded vocab);
  the export must be those tensors, byte for byte.
* **Names**: vLLM 0.34's own MTP loaders (``DeepSeekMTP.load_weights``, ``Glm4MoeMTP.load_weights``)
  run on the rank-0 export over a stand-in module whose parameters are the draft model's: every
  exported tensor must reach a parameter's ``weight_loader`` (none skipped) and every draft parameter
  must be loaded.
* **The draft round**: ``WeightSync(draft=...)`` (a) against vLLM's own RL HTTP router
  (``VLLMRouterServer``) through ``VLLMHTTPClient``: the route order, one ``weight_version`` for both
  rounds, and the bytes that arrived; (b) into a loopback receiver (a transformers DeepSeek-V3 and a
  ``TensorsModel`` draft, fused experts) over the loopback transport: the receiver's draft holds the
  imported checkpoint tensors; a receiver without a draft refuses, and the sync raises on both ranks;
  (c) through ``RayDraftWeightSyncClient`` over two Ray actor doubles: every call is a method vLLM's
  ``AsyncLLM`` and ``RLOfflineMixin`` define (read from vLLM's source).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from fsdp_worlds import unpack
from mtp_cli import export_and_check
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

    from weightsync.plugins.testbed.megatron import MegatronParallel

    tp, pp, ep = PAR[layout]
    return build_megatron(hf, MegatronParallel(tp, pp, None, ep), seed=5, overrides={"mtp_num_layers": 1})


def _hf_mtp(kind: str, hf: Any) -> dict[str, torch.Tensor]:
    """MTP layer 0 as a released checkpoint holds it, random (seeded by name): the decoder block is
    transformers' own table of the last decoder layer (``save_pretrained`` names and shapes) under
    ``model.layers.{N}.``, plus ``enorm`` / ``hnorm`` ``[h]``, ``eh_proj`` ``[h, 2h]``,
    ``shared_head.norm`` ``[h]`` and the ``embed_tokens`` / ``shared_head.head`` copies ``[vocab, h]``."""
    from family_worlds import saved_pretrained

    n, h, v = hf.num_hidden_layers, hf.hidden_size, hf.vocab_size
    pre, last = f"model.layers.{n}.", f"model.layers.{n - 1}."
    shapes = {pre + k[len(last):]: s for k, (s, _) in saved_pretrained(hf).items() if k.startswith(last)}
    shapes.update({pre + "enorm.weight": (h,), pre + "hnorm.weight": (h,), pre + "eh_proj.weight": (h, 2 * h),
                   pre + "shared_head.norm.weight": (h,), pre + "embed_tokens.weight": (v, h),
                   pre + "shared_head.head.weight": (v, h)})
    return {k: torch.randn(s, generator=torch.Generator().manual_seed(zlib.crc32(k.encode()))) for k, s in shapes.items()}


def _qkv_rows(hf: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` rows (weight or bias): per query group, its q heads, then k, then v."""
    g = hf.num_key_value_heads
    return torch.cat([torch.cat(x) for x in zip(q.chunk(g), k.chunk(g), v.chunk(g))])


def _import_mtp(chunks: list[torch.nn.Module], hf: Any, ck: dict[str, torch.Tensor]) -> list[str]:
    """The tests' own importer (no MegatronSource code): copy the checkpoint's MTP tensors ``ck`` into
    this rank's megatron-core MTP block -- TP shards (column-parallel: row chunks, row-parallel: column
    chunks, gated ``linear_fc1``: ``[gate_r; up_r]``), this EP rank's experts, the expert-TP shard --
    and the embedding / head copies into the (vocab-parallel) embedding and output layer megatron
    shares with the MTP block. Raises on any MTP parameter it has no rule for; returns the names used."""
    from megatron.core import parallel_state as ps

    n = hf.num_hidden_layers
    pre = f"model.layers.{n}."
    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etpr = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    local = hf.n_routed_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * local
    mla = hasattr(hf, "kv_lora_rank")
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(pre + name)
        return ck[pre + name]

    def vocab(name: str, p: torch.Tensor) -> torch.Tensor:
        full = torch.full((p.shape[0] * tp, p.shape[1]), 7.0)  # megatron's padded vocab; padding must not leak
        full[: hf.vocab_size] = get(name)
        return full.chunk(tp)[tpr]

    same = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "final_layernorm.weight": "shared_head.norm.weight",
            "transformer_layer.input_layernorm.weight": "input_layernorm.weight",
            "transformer_layer.pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "transformer_layer.self_attention.q_layernorm.weight": f"self_attn.{'q_a_layernorm' if mla else 'q_norm'}.weight",
            "transformer_layer.self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
            "transformer_layer.self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "transformer_layer.mlp.router.weight": "mlp.gate.weight",
            "transformer_layer.mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
    column = {"eh_proj.weight": "eh_proj.weight",
              "transformer_layer.self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
              "transformer_layer.self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
              "transformer_layer.self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "transformer_layer.self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight"}

    def mtp_value(suffix: str) -> torch.Tensor:
        if suffix in same:
            return get(same[suffix])
        if suffix in column:
            return get(column[suffix]).chunk(tp)[tpr]
        if suffix == "transformer_layer.self_attention.linear_proj.weight":
            return get("self_attn.o_proj.weight").chunk(tp, 1)[tpr]
        if suffix.startswith("transformer_layer.self_attention.linear_qkv."):
            leaf = suffix.rsplit(".", 1)[1]
            return _qkv_rows(hf, *(get(f"self_attn.{x}_proj.{leaf}") for x in "qkv")).chunk(tp)[tpr]
        m = re.fullmatch(r"transformer_layer\.mlp\.(?:experts\.local_experts\.(\d+)|shared_experts)\.linear_fc([12])\.weight", suffix)
        if m is None:
            raise KeyError(f"the test importer has no rule for mtp.layers.0.{suffix}")
        base, k, r = ("mlp.shared_experts.", tp, tpr) if m[1] is None else (f"mlp.experts.{first + int(m[1])}.", etp, etpr)
        if m[2] == "1":
            return torch.cat([get(base + "gate_proj.weight").chunk(k)[r], get(base + "up_proj.weight").chunk(k)[r]])
        return get(base + "down_proj.weight").chunk(k, 1)[r]

    for chunk in chunks:
        tensors = dict(chunk.named_parameters())
        tensors.update({k: b for k, b in chunk.named_buffers() if k.endswith("router.expert_bias")})
        for name, p in tensors.items():
            if name == "embedding.word_embeddings.weight":
                val = vocab("embed_tokens.weight", p)
            elif name == "output_layer.weight":
                val = vocab("shared_head.head.weight", p)
            elif name.startswith("mtp."):
                val = mtp_value(name.removeprefix("mtp.layers.0."))
            else:
                continue
            assert tuple(val.shape) == tuple(p.shape), (name, tuple(val.shape), tuple(p.shape))
            with torch.no_grad():
                p.copy_(val)
    return sorted(used)


def _fused(tensors: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """Per-expert names -> transformers' in-memory fused experts (``experts.gate_up_proj`` ``[E, 2I, H]``:
    each expert's ``[gate; up]``, ``experts.down_proj`` ``[E, H, I]``); other names as they are."""
    out, experts = {}, {}
    for k, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", k)
        if m is None:
            out[k] = t
        else:
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for base, w in experts.items():
        e = range(hf.n_routed_experts)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([w[(i, "gate")], w[(i, "up")]]) for i in e])
        out[base + ".down_proj"] = torch.stack([w[(i, "down")] for i in e])
    return out


def _world(rank: int, world_size: int, urls: dict[str, str]) -> bytes:
    import torch.distributed as dist
    from fsdp_worlds import pack
    from megatron.core import parallel_state as ps
    from worlds import errors_of

    from weightsync.sources import MegatronSource

    out: dict[str, Any] = {}
    # transformers' save_pretrained in a process group writes each rank's share: rank 0 builds the tables
    tables = [{kind: _hf_mtp(kind, _hf(kind)) for kind in ("dsv3", "glm")} if rank == 0 else None]
    dist.broadcast_object_list(tables, src=0)
    tables = tables[0]
    for kind, layout in LAYOUTS:
        hf = _hf(kind)
        chunks = _build(hf, layout)
        used: list[Any] = [None] * world_size
        dist.all_gather_object(used, _import_mtp(chunks, hf, tables[kind]))
        model = chunks if len(chunks) > 1 else chunks[0]
        policy = MegatronSource(model, hf_config=hf)
        draft = MegatronSource(model, hf_config=hf, part="mtp")
        got_policy = {n: t.clone() for n, t in policy.iter_full()}
        got_draft = {n: t.clone() for n, t in draft.iter_full()}
        out[f"{kind}/{layout}"] = {
            "policy": got_policy, "draft": got_draft, "imported": sorted({n for u in used for n in u}),
            "policy_meta": [m.name for m in policy.metadata],
            "draft_meta": [(m.name, tuple(m.shape), m.owners) for m in draft.metadata],
        }
        if (kind, layout) == ("dsv3", "tp2"):
            out["round"] = _draft_round(rank, model, hf)
            out["ray"] = _ray_round(rank, model, hf)
            out["loopback"] = _loopback_round(rank, model, hf, urls["draft"])
            out["refuse_no_draft"] = _loopback_round(rank, model, hf, urls["no_draft"])
            q = _hf(kind)
            q.architectures = ["Qwen3MoeForCausalLM"]
            out["refuse_family"] = errors_of(MegatronSource, model, hf_config=q, part="mtp")
            out["refuse_engines"] = {b: errors_of(_weight_sync_with, b, rank, policy, draft) for b in
                                     ("sparse_nccl", "nccl_m2n", "sharded_rdt")}
            out["refuse_part"] = errors_of(MegatronSource, model, hf_config=hf, part="draft")
        ps.destroy_model_parallel()
    out["cli"] = export_and_check(
        rank, urls["cli_out"], ["--model", "tiny-deepseek-v3", "--layout", "megatron", "--ep", "2", "--nproc", "2", "--mtp"],
        "model.layers.2.eh_proj.weight")
    if rank == 0:
        out["tables"] = tables
    return pack(out if rank == 0 else {k: v for k, v in out.items() if k.startswith("refuse") or k == "cli"})


def _loopback_round(rank: int, model: Any, hf: Any, url: str) -> dict[str, Any]:
    """One ``WeightSync(draft=...)`` sync (version "3") into a loopback receiver over vLLM's HTTP routes,
    policy and draft with fused experts (what a transformers receiver holds): the report's version, or
    the error this rank raised (with its notes)."""
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.sources import MegatronSource

    info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
    sync = WeightSync(MegatronSource(model, hf_config=hf, expert_layout="fused"), info, VLLMHTTPClient(url),
                      draft=MegatronSource(model, hf_config=hf, part="mtp", expert_layout="fused"))
    try:
        return {"version": sync.sync(3).weight_version}
    except Exception as e:  # noqa: BLE001 - the refusal under test
        return {"error": " ".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])}
    finally:
        sync.shutdown()


def _ray_round(rank: int, model: Any, hf: Any) -> dict[str, Any] | None:
    """``WeightSync(draft=...)`` through ``RayDraftWeightSyncClient`` over two actor handles (test
    doubles: ``handle.m.remote(*a)`` records ``m`` and its arguments on the actor -- ``update_weights``:
    the tensors of ``request.update_info`` decoded -- and ``ray.get`` returns the results). Rank 0's
    recorded calls per actor; the test checks each is a method vLLM's actors define."""
    import sys
    import types

    import json_engine
    from safetensors.torch import load

    from weightsync.plugins import RayDraftWeightSyncClient
    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import MegatronSource

    class Handle:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []

        def __getattr__(self, name: str) -> Any:
            def remote(*args: Any) -> tuple[str, None]:
                arg = args[0] if args else None
                if name == "update_weights":
                    arg = load(base64.b64decode(arg.update_info["safetensors_b64"]))
                elif name == "init_weight_transfer_engine":
                    arg = arg.init_info
                self.calls.append((name, arg))
                return ("ref", None)

            return types.SimpleNamespace(remote=remote)

    fake = types.ModuleType("ray")
    fake.get = lambda refs: [r[1] for r in refs]
    saved = sys.modules.get("ray")
    sys.modules["ray"] = fake
    handles = [Handle(), Handle()]
    try:
        sync = WeightSync(MegatronSource(model, hf_config=hf), json_engine.JSONTrainerInitInfo(rank=rank, chunk=64),
                          RayDraftWeightSyncClient(handles), draft=MegatronSource(model, hf_config=hf, part="mtp"),
                          pause=None)
        version = sync.sync(9).weight_version
        sync.shutdown()
    finally:
        if saved is None:
            del sys.modules["ray"]
        else:
            sys.modules["ray"] = saved
    return {"version": version, "calls": [h.calls for h in handles]} if rank == 0 else None


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
def world() -> Iterator[dict[int, Any]]:
    """The 2-rank world, with two loopback receivers served from here: a DeepSeek-V3-like transformers
    model with a draft (a ``TensorsModel`` of the checkpoint's MTP names, fused experts as transformers
    holds them) and one without. Rank 0's facts carry the receivers' models, state and POST calls."""
    from transformers import AutoModelForCausalLM

    from weightsync.plugins.loopback.receiver import LoopbackReceiver, ReceiverServer, TensorsModel

    hf = _hf("dsv3")
    table = {k: torch.zeros_like(t) for k, t in _fused(_hf_mtp("dsv3", hf), hf).items()}
    policy = AutoModelForCausalLM.from_config(hf)
    servers = {"draft": ReceiverServer(LoopbackReceiver(policy, draft=TensorsModel(table))).start(),
               "no_draft": ReceiverServer(LoopbackReceiver(copy.deepcopy(policy))).start()}
    out = tempfile.mkdtemp(prefix="ws-mtp-cli-")
    try:
        urls = {k: s.url for k, s in servers.items()}
        res = unpack(_run_world(_world, 2, timeout=600, urls={**urls, "cli_out": os.path.join(out, "ckpt")}))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        for s in servers.values():
            s.stop()
    res[0]["cli_dir"] = os.path.join(out, "ckpt")
    res[0]["receivers"] = {k: {"policy": s.receiver.model.state_dict(), "draft": s.receiver.draft and s.receiver.draft.state_dict(),
                               "state": s.receiver.state(), "calls": [(c["path"], c["status"]) for c in s.calls if c["method"] == "POST"]}
                           for k, s in servers.items()}
    try:
        yield res
    finally:
        shutil.rmtree(out, ignore_errors=True)


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
def test_mtp_export_is_the_imported_checkpoint_tensors_byte_for_byte(world, case):
    """Under TP2 / PP2 / EP2: ``MegatronSource(part="mtp")`` streams exactly the checkpoint's MTP
    tensors the tests' importer put into megatron-core (names, shapes, dtypes, bytes; vocab padding
    trimmed), in metadata order, every tensor owned by rank 0; the policy export of the same model has
    no MTP tensor, and its embedding / head are the copies megatron shares with the MTP block."""
    from family_worlds import same_bytes

    r = world[0][case]
    kind = case.split("/")[0]
    want = world[0]["tables"][kind]
    pre = f"model.layers.{_hf(kind).num_hidden_layers}."
    pol, dr = r["policy"], r["draft"]
    assert r["imported"] == sorted(want), "the importer left checkpoint tensors out"
    assert list(dr) == [m[0] for m in r["draft_meta"]]
    assert sorted(dr) == sorted(want), (sorted(set(dr) ^ set(want)))[:10]
    bad = [n for n in want if not same_bytes(dr[n], want[n])]
    assert bad == [], f"not the imported checkpoint tensor: {bad[:10]}"
    assert not any(m.startswith(pre) for m in pol) and r["policy_meta"] == list(pol)
    assert same_bytes(pol["model.embed_tokens.weight"], want[pre + "embed_tokens.weight"])
    assert same_bytes(pol["lm_head.weight"], want[pre + "shared_head.head.weight"])
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


def test_draft_round_through_the_loopback_receiver(world):
    """A full ``WeightSync(policy, ..., draft=MegatronSource(part="mtp"))`` sync into a loopback receiver
    holding a transformers DeepSeek-V3 and a draft model: in one pause the policy round then
    ``/start_draft_weight_update`` and the draft round, both finished with version "3"; the receiver's
    draft holds the imported checkpoint tensors (the fused export's experts) and its policy the
    policy export, byte for byte."""
    from family_worlds import same_bytes

    r = world[0]
    assert r["loopback"] == {"version": "3"}, r["loopback"]
    rec = r["receivers"]["draft"]
    assert [p for p, _ in rec["calls"] if p not in ("/update_weights",)] == [
        "/init_weight_transfer_engine", "/pause", "/start_weight_update", "/finish_weight_update",
        "/start_draft_weight_update", "/finish_weight_update", "/resume"], rec["calls"]
    assert all(status == 200 for _, status in rec["calls"]), rec["calls"]
    st = rec["state"]
    assert (st["weight_version"], st["updates_finished"], st["draft_updates_finished"]) == ("3", 1, 1), st
    assert st["last_update"]["draft"] and st["last_update"]["checksums_verified"]
    hf = _hf("dsv3")
    want_draft = _fused(r["tables"]["dsv3"], hf)
    assert sorted(rec["draft"]) == sorted(want_draft)
    bad = [n for n, t in want_draft.items() if not same_bytes(rec["draft"][n], t)]
    assert bad == [], bad[:10]
    want_policy = _fused(r["dsv3/tp2"]["policy"], hf)
    assert sorted(rec["policy"]) == sorted(want_policy)
    bad = [n for n, t in want_policy.items() if not same_bytes(rec["policy"][n], t)]
    assert bad == [], bad[:10]


def test_a_receiver_without_a_draft_refuses_on_every_rank(world):
    """The loopback receiver without a draft answers ``/start_draft_weight_update`` with 500 and its
    reason; the sync raises on both ranks naming it; no draft byte moved, generation was resumed, and
    the version the policy's finish committed stays."""
    rec = world[0]["receivers"]["no_draft"]
    for rank, r in world.items():
        err = r["refuse_no_draft"].get("error")
        assert err and "holds no draft model" in err and "start_draft_weight_update" in err, (rank, err)
        assert ("failed on rank 0" if rank else "sync failed in send on rank(s) [0, 1]") in err, (rank, err)
    paths = [p for p, _ in rec["calls"]]
    cut = paths.index("/start_draft_weight_update")
    assert rec["calls"][cut][1] == 500 and "/update_weights" not in paths[cut:] and "/resume" in paths[cut:], rec["calls"]
    assert rec["state"]["draft_updates_finished"] == 0 and not rec["state"]["has_draft"]
    assert rec["state"]["weight_version"] == "3"  # the policy's finish committed it (docs/mtp.md)


def _actor_methods(module: str, cls: str) -> set[str]:
    """The methods ``cls`` defines in vLLM's ``module`` (read from its source, not imported)."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_draft_round_through_the_ray_client(world):
    """``RayDraftWeightSyncClient`` over two actor handles (a Ray double): each actor gets init, the
    policy round, ``start_draft_weight_update``, the draft round, each finish followed by
    ``update_weight_version("9")`` -- every call one that vLLM 0.34's ``AsyncLLM`` and ``LLM``
    (``RLOfflineMixin``) actors define; the draft bytes are the export."""
    from family_worlds import same_bytes

    r = world[0]["ray"]
    want = world[0]["dsv3/tp2"]
    assert r["version"] == "9"
    served = _actor_methods("vllm.v1.engine.async_llm", "AsyncLLM") & _actor_methods("vllm.entrypoints.rl.offline",
                                                                                     "RLOfflineMixin")
    for calls in r["calls"]:
        names = [c for c, _ in calls if c != "update_weights"]
        assert names == ["init_weight_transfer_engine", "start_weight_update", "finish_weight_update", "update_weight_version",
                         "start_draft_weight_update", "finish_weight_update", "update_weight_version"], names
        assert {c for c, _ in calls} <= served, {c for c, _ in calls} - served
        assert [a for c, a in calls if c == "update_weight_version"] == ["9", "9"]
        cut = [c for c, _ in calls].index("start_draft_weight_update")
        got = {k: v for c, a in calls[cut:] if c == "update_weights" for k, v in a.items()}
        assert sorted(got) == sorted(want["draft"]) and all(same_bytes(got[k], want["draft"][k]) for k in got)
        got = {k: v for c, a in calls[:cut] if c == "update_weights" for k, v in a.items()}
        assert sorted(got) == sorted(want["policy"])


def test_tensors_model_holds_exactly_the_declared_names(world):
    """``TensorsModel.from_metadata`` (what a receiver's draft is built from): state-dict names, shapes
    and dtypes are the draft source's metadata, in order; a name that is another's prefix is refused."""
    from weightsync.plugins.loopback.receiver import TensorsModel

    meta = world[0]["dsv3/tp2"]["draft_meta"]
    m = TensorsModel.from_metadata([type("M", (), {"name": n, "shape": s, "dtype": torch.float32}) for n, s, _ in meta])
    assert [(k, tuple(t.shape)) for k, t in m.state_dict().items()] == [(n, s) for n, s, _ in meta]
    with pytest.raises(ValueError, match="prefix"):
        TensorsModel({"a.weight": torch.zeros(1), "a.weight.b": torch.zeros(1)})


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


# ---- weightsync export --mtp / check --mtp (the CLI's rank code in this world) --------------------------


def test_export_mtp_writes_the_policy_and_the_draft_in_one_checkpoint(world):
    """``export --mtp`` (tiny DeepSeek-V3 preset, EP2): one folder holding save_pretrained's policy
    tensors byte for byte (transformers loads it with nothing missing) plus the MTP layer under the
    names vLLM's own ``DeepSeekMTP.load_weights`` consumes, every draft parameter loaded."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from weightsync.plugins.cli.build import checkpoint_state
    from weightsync.plugins.testbed.presets import build_model, load_config

    cli, folder = world[0]["cli"], world[0]["cli_dir"]
    code, text = cli["export"]
    assert code == 0 and "PASS" in text and "MTP" in text, text
    assert all(r["cli"]["export"][0] == 0 for r in world.values())
    got = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(folder, f)))
    cfg = load_config("tiny-deepseek-v3", None)
    n = cfg.num_hidden_layers
    policy = checkpoint_state(build_model(cfg, seed=0))
    mtp = {k: t for k, t in got.items() if k.startswith(f"model.layers.{n}.")}
    assert sorted(set(got) - set(mtp)) == sorted(policy)
    for k, t in policy.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    # the draft's copies of the shared embedding / output head are the policy's (vocab padding trimmed)
    assert torch.equal(mtp[f"model.layers.{n}.embed_tokens.weight"], policy["model.embed_tokens.weight"])
    assert torch.equal(mtp[f"model.layers.{n}.shared_head.head.weight"], policy["lm_head.weight"])
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert model.config.num_nextn_predict_layers == 1
    loaded, calls, params = _run_vllm_loader("dsv3", model.config, mtp)
    assert len(calls) == len(mtp) and loaded == params, (sorted(params - loaded)[:5], len(calls), len(mtp))


def test_check_mtp_compares_the_folders_draft_byte_for_byte(world):
    """``check --mtp --checkpoint`` passes on the exported folder with every tensor, MTP ones
    included, compared byte for byte; one changed MTP tensor fails it, named, on every rank's exit code."""
    cli = world[0]["cli"]
    code, text = cli["check"]
    assert code == 0 and text.rstrip().endswith("PASS"), text
    assert re.search(r"bytes: (\d+) of \1 tensors compared equal", text), text
    assert re.search(r"MTP \(draft\): 32 tensors", text), text
    code, text = cli["check_changed"]
    assert code == 1 and "model.layers.2.eh_proj.weight: bytes differ" in text and "FAIL" in text, text
    assert [r["cli"]["check_changed"][0] for r in world.values()] == [1, 1]


def test_mtp_cli_refuses_a_family_without_mtp_layers(capsys):
    """``--mtp`` for a family without MTP names (Qwen3), without --layout megatron, and check --mtp
    without a folder: usage errors (exit 2, one line naming what is wrong) before any rank starts."""
    from weightsync.plugins.cli.entry import main

    code = main(["export", "--model", "tiny-qwen3", "--layout", "megatron", "--mtp", "--out", "/nonexistent/x"])
    err = capsys.readouterr()
    assert code == 2 and "family 'qwen3' has no multi-token-prediction" in err.err, (code, err)
    assert "starting" not in err.out + err.err
    for argv, want in ((["check", "--model", "tiny-deepseek-v3", "--mtp"], "--mtp needs --layout megatron"),
                       (["check", "--model", "tiny-deepseek-v3", "--layout", "megatron", "--mtp"], "pass --checkpoint")):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and want in err and len(err.strip().splitlines()) == 1, (argv, code, err)
