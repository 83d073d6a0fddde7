"""Many senders (``senders="owners"``) through vLLM 0.34's real NCCL trainer and worker engines, on
gloo CPU ranks (``many_senders_worlds.py`` says what stands in: only the PyNccl communicator).

Oracles: transformers' ``save_pretrained`` of the HF model the Megatron / FSDP model was built from
(the Megatron weights are written by the tests' own importer, ``megatron_worlds.import_hf``, not by
weightsync); for the MoE EP2 case, Megatron's own ``dist_checkpointing`` for the experts and router.
What each sender sent is counted at the communicator (broadcasts it sourced) and at the worker
(each turn's ``update_info`` names and ``src``), against owners computed here from the layer
placement, not from the source's metadata.

Skips (named) when the installed vLLM has a single NCCL sender (0.33); one check runs there: asking
for many senders is refused, naming the version.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from fsdp_worlds import pack, unpack
from many_senders_worlds import skip_reason
from worlds import run_world as _run_world

SKIP = skip_reason()
needs_034 = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


def _bitwise_mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    for n in set(got) & set(want):
        a, b = got[n], want[n]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
            bad.append(n)
    return sorted(bad)


def _megatron_case(rank: int, *, tmp: str, case: str, tp: int, pp: int, vpp: int | None, fail: bool = False) -> dict:
    """One Megatron sync (and, with ``fail``, a failed sync then a good one) of a tiny Qwen3."""
    import torch.distributed as dist
    from many_senders_worlds import InProcessWorker, NoClient, sent_by_me, weight_sync
    from megatron_worlds import hf_config, hf_model, import_hf, init_parallel, megatron_model, saved_checkpoint

    from weightsync.sources import MegatronSource

    init_parallel(tp=tp, pp=pp, vpp=vpp)
    layers = 4
    cfg = hf_config("qwen3", layers=layers)
    hf = hf_model(cfg, seed=3)
    model = megatron_model(cfg)
    import_hf(model, dict(hf.state_dict()), cfg)
    oracle = saved_checkpoint(hf, f"{tmp}/{case}") if rank == 0 else None
    src = MegatronSource(model, hf_config=cfg, senders="owners")
    client = InProcessWorker() if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.model.expect(src.metadata)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}}
    sync.sync(1)
    facts["sent"], facts["sent_bytes"] = sent_by_me(sync)
    facts["stats"] = src.last_pass.as_dict()
    if rank == 0:
        facts["mismatch"] = _bitwise_mismatches(client.model.held, oracle)
        facts["updates"] = [(s, list(n)) for s, n in client.updates]
        facts["payload_rank_offset"] = client.init_payloads[0]["rank_offset"]
    if fail:
        orig = src._full_pass

        def failing():
            for i, pair in enumerate(orig()):
                if i == 3:
                    raise RuntimeError("injected: this sender fails mid-stream")
                yield pair

        if rank == 1:
            src._full_pass = failing
        try:
            sync.sync(2)
            facts["fail_outcome"] = "returned"
        except Exception as e:  # noqa: BLE001 - the fact under test
            facts["fail_outcome"] = f"{type(e).__name__}: {e}"
        facts["sent_in_failed"], _ = sent_by_me(sync)
        if rank == 1:
            del src._full_pass
        if rank == 0:
            facts["after_fail_mismatch"] = len(_bitwise_mismatches(client.model.held, oracle))
            client.model.expect(src.metadata)  # NaN again: the next sync must deliver everything
        sync.sync(3)
        facts["resent"], _ = sent_by_me(sync)
        if rank == 0:
            facts["next_mismatch"] = _bitwise_mismatches(client.model.held, oracle)
            facts["versions"] = client.versions
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    dist.barrier()
    return facts


def _moe_ep2_case(rank: int, *, tmp: str) -> dict:
    """Qwen3-MoE at EP2 (2 ranks, 4 experts, 2 per rank): owners vs rank 0 through the same engines."""
    import torch.distributed as dist
    from many_senders_worlds import InProcessWorker, NoClient, sent_by_me, weight_sync
    from moe_megatron import build_gpt, init_parallel, load_full_checkpoint, megatron_checkpoint, moe_config
    from transformers import AutoConfig

    from weightsync.sources import MegatronSource

    init_parallel(ep=2)
    hf = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2,
                              moe_intermediate_size=12, num_experts=4, intermediate_size=40, head_dim=4)
    model = build_gpt(hf, moe_config(hf, ep=2))
    import os

    os.makedirs(f"{tmp}/moe_ckpt", exist_ok=True)
    megatron_checkpoint(model, f"{tmp}/moe_ckpt")
    facts: dict = {}
    got: dict[str, dict[str, torch.Tensor]] = {}
    for senders in ("owners", "rank0"):
        src = MegatronSource(model, hf_config=hf, senders=senders)
        client = InProcessWorker() if rank == 0 else NoClient()
        sync = weight_sync(src, client)
        if rank == 0:
            client.model.expect(src.metadata)
        sync.sync(1)
        facts[senders] = {"sent": sent_by_me(sync)[0], "stats": src.last_pass.as_dict(),
                          "owners": {m.name: m.owners for m in src.metadata}}
        if rank == 0:
            got[senders] = {n: t.clone() for n, t in client.model.held.items()}
            facts[senders]["updates"] = [(s, sorted(n)) for s, n in client.updates]
        sync.shutdown()
        if rank == 0:
            client.engine.shutdown()
    if rank == 0:
        facts["vs_rank0"] = _bitwise_mismatches(got["owners"], got["rank0"])
        # Megatron's own checkpoint (dist_checkpointing, resharded by torch's DCP reader): experts and routers
        ck = load_full_checkpoint(f"{tmp}/moe_ckpt")
        bad = []
        for layer in range(2):
            def ck_of(suffix):
                key = f"decoder.layers.{layer}.{suffix}"
                return ck[key] if key in ck else ck[f"decoder.layers.{suffix}"][layer]
            fc1, fc2 = ck_of("mlp.experts.experts.linear_fc1.weight"), ck_of("mlp.experts.experts.linear_fc2.weight")
            F = fc2.shape[-1]
            pre = f"model.layers.{layer}.mlp."
            want = {pre + "gate.weight": ck_of("mlp.router.weight")}
            for e in range(4):
                want.update({f"{pre}experts.{e}.gate_proj.weight": fc1[e, :F], f"{pre}experts.{e}.up_proj.weight": fc1[e, F:],
                             f"{pre}experts.{e}.down_proj.weight": fc2[e]})
            bad += [n for n, t in want.items() if not torch.equal(got["owners"][n], t.to(got["owners"][n].dtype))]
        facts["vs_megatron_ckpt"] = bad
        facts["ckpt_names"] = 2 * (1 + 12)
    dist.barrier()
    return facts


def _fp8_and_refusals_case(rank: int, *, tmp: str) -> dict:
    """FP8Source over a PP2 MegatronSource(senders="owners") through the engines (weights and their
    scales sent by the weight's stage), and what is refused, on every rank: DeltaSource over many
    senders, mode="local" with owners, FSDPSource(senders="owners") under plain FSDP."""
    import torch.distributed as dist
    from fsdp_worlds import shard, tiny_model
    from many_senders_worlds import InProcessWorker, NoClient, sent_by_me, weight_sync
    from megatron_worlds import hf_config, hf_model, import_hf, init_parallel, megatron_model
    from torch.distributed.device_mesh import init_device_mesh
    from worlds import errors_of

    from weightsync.sources import DeltaSource, FP8Source, FSDPSource, MegatronSource, SafetensorsSource

    init_parallel(pp=2)
    cfg = hf_config("qwen3", layers=4, hidden_size=128, intermediate_size=256, vocab=256)
    hf = hf_model(cfg, seed=4)
    model = megatron_model(cfg)
    import_hf(model, dict(hf.state_dict()), cfg)
    if rank == 0:
        hf.save_pretrained(f"{tmp}/fp8")
    dist.barrier()
    src = FP8Source(MegatronSource(model, hf_config=cfg, senders="owners"))
    client = InProcessWorker() if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.model.expect(src.metadata)
    sync.sync(1)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}, "sent": sent_by_me(sync)[0]}
    # the oracle: the same quantizer over the save_pretrained folder, no engine (collective: every rank)
    want = dict(FP8Source(SafetensorsSource(f"{tmp}/fp8")).iter_full())
    if rank == 0:
        facts["mismatch"] = _bitwise_mismatches(client.model.held, want)
        facts["fp8"] = sum(1 for t in client.model.held.values() if t.dtype == torch.float8_e4m3fn)
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    facts["delta"] = errors_of(DeltaSource, MegatronSource(model, hf_config=cfg, senders="owners"))
    facts["local"] = errors_of(MegatronSource, model, hf_config=cfg, mode="local", senders="owners")
    facts["bad_value"] = errors_of(MegatronSource, model, hf_config=cfg, senders="all")
    plain = shard(tiny_model("qwen3", tied=False), init_device_mesh("cpu", (2,)))
    facts["plain_fsdp"] = errors_of(FSDPSource, plain, senders="owners")
    dist.barrier()
    return facts


def _world_megatron_2(rank: int, world_size: int, *, tmp: str) -> bytes:
    from many_senders_worlds import install_standins

    install_standins()
    facts = {
        "fp8": _fp8_and_refusals_case(rank, tmp=tmp),
        "pp2": _megatron_case(rank, tmp=tmp, case="pp2", tp=1, pp=2, vpp=None, fail=True),
        "vpp": _megatron_case(rank, tmp=tmp, case="vpp", tp=1, pp=2, vpp=2),
        "ep2": _moe_ep2_case(rank, tmp=tmp),
    }
    return pack(facts)


def _expected_sender(name: str, *, layers: int, pp: int, tp: int, vpp: int = 1) -> int:
    """The rank that must send ``name``: its stage's first rank (Megatron's default rank order puts
    stage s's first rank of replica 0 at s * tp * dp; dp = 1 here)."""
    if name.startswith("model.layers."):
        from many_senders_worlds import stage_of_layer

        stage = stage_of_layer(int(name.split(".")[2]), layers, pp, vpp)
    elif name.startswith("model.embed_tokens"):
        stage = 0
    else:  # final norm, lm_head
        stage = pp - 1
    return stage * tp


def _check_megatron(facts: dict, *, world: int, tp: int, pp: int, vpp: int = 1) -> None:
    r0 = facts[0]
    assert r0["mismatch"] == [], r0["mismatch"][:5]
    names = list(r0["owners"])
    want = {n: _expected_sender(n, layers=4, pp=pp, tp=tp, vpp=vpp) for n in names}
    assert {n: o[0] for n, o in r0["owners"].items()} == want
    senders = sorted(set(want.values()))
    # each sender broadcast exactly its own tensors (counted at the communicator) ...
    for r in range(world):
        assert facts[r]["sent"] == sum(1 for s in want.values() if s == r), (r, facts[r]["sent"])
    # ... and the worker got them in turns, each turn's src the sender's place in the group
    assert [(s, sorted(ns)) for s, ns in r0["updates"]] == [
        (senders.index(r), sorted(n for n in names if want[n] == r)) for r in senders
    ]
    assert r0["payload_rank_offset"] == len(senders)
    # rank 0 holds only its own stage: nothing from another stage moved to it
    own = [n for n in names if want[n] == 0]
    if tp == 1:
        assert r0["stats"]["bytes_received"] == 0
    else:
        assert 0 < r0["stats"]["bytes_received"] < sum(1 for _ in own) * 10**9
    assert r0["stats"]["tensors"] == len(own)


@pytest.fixture(scope="module")
def world2():
    if SKIP is not None:
        pytest.skip(SKIP)
    return run_world(_world_megatron_2, 2, tmp=tempfile.mkdtemp(), timeout=300)


@needs_034
def test_megatron_ep2_experts_leave_from_their_ep_rank(world2):
    f = {r: world2[r]["ep2"] for r in (0, 1)}
    r0 = f[0]
    assert r0["vs_megatron_ckpt"] == []  # experts and routers: Megatron's own checkpoint
    assert r0["vs_rank0"] == []  # everything: what the single sender delivers through the same engines
    owners = r0["owners"]["owners"]
    want = {n: (1 if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) >= 2 else 0) for n in owners}
    assert {n: o for n, (o,) in owners.items()} == want
    assert [f[r]["owners"]["sent"] for r in (0, 1)] == [sum(1 for s in want.values() if s == r) for r in (0, 1)]
    assert [s for s, _ in r0["owners"]["updates"]] == [0, 1]
    # rank 0 received nothing point to point (it used to receive EP rank 1's experts)
    assert r0["owners"]["stats"]["bytes_received"] == 0 < r0["rank0"]["stats"]["bytes_received"]
    assert f[1]["owners"]["stats"]["tensors"] == sum(1 for s in want.values() if s == 1)


@needs_034
def test_megatron_pp2_vpp_and_a_failed_sender(world2):
    res = world2
    pp2 = {r: f["pp2"] for r, f in res.items()}
    _check_megatron(pp2, world=2, tp=1, pp=2)
    _check_megatron({r: f["vpp"] for r, f in res.items()}, world=2, tp=1, pp=2, vpp=2)
    # a sender that fails mid-stream: every rank raises, naming it; nothing is committed; the next sync works
    for r in (0, 1):
        assert "injected: this sender fails mid-stream" in pp2[r]["fail_outcome"], (r, pp2[r]["fail_outcome"])
    assert pp2[0]["after_fail_mismatch"] > 0  # the failed turn was completed with zeros
    assert pp2[0]["next_mismatch"] == []
    assert pp2[0]["versions"] == ["1", None, "3"]
    assert pp2[1]["sent_in_failed"] == pp2[1]["sent"]  # its whole turn: 3 tensors, then zeros
    assert pp2[1]["resent"] == pp2[1]["sent"]


# ---- 4 ranks: Megatron PP2 x TP2, FSDP2 under HSDP (2 replicas x 2 shards) ---------------------------


def _hsdp_case(rank: int, mesh, *, tmp: str, kind: str) -> dict:
    """One HSDP sync of a tiny model: ``plain`` (Qwen3, tied), ``lora`` (PEFT LoRA, merged on the
    way out) or ``moe`` (Qwen3-MoE, transformers' fused experts sent per expert)."""
    import copy

    import torch.distributed as dist
    from fsdp_worlds import load_oracle, shard, tiny_model
    from many_senders_worlds import InProcessWorker, NoClient, sent_by_me, weight_sync

    from weightsync.sources import FSDPSource

    layers = None
    if kind == "plain":
        model = tiny_model("qwen3", tied=True, seed=5, layers=4)
        oracle_model = model
    elif kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(tiny_model("qwen3", tied=False, seed=6, layers=4),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_()  # B starts at zero: a merge that dropped it would still match
        oracle_model = copy.deepcopy(model).merge_and_unload()
        layers = model.base_model.model.model.layers
    else:
        from moe_models import tiny_model as moe_model

        model = moe_model("qwen3_moe", seed=7)
        oracle_model = model
    if rank == 0:
        oracle_model.save_pretrained(f"{tmp}/{kind}")
    oracle = load_oracle(f"{tmp}/{kind}") if rank == 0 else None
    shard(model, mesh, layers=layers)
    src = FSDPSource(model, senders="owners")
    client = InProcessWorker() if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.model.expect(src.metadata)
    sync.sync(1)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}, "replicas": src.replicas}
    facts["sent"], facts["sent_bytes"] = sent_by_me(sync)
    facts["stats"] = src.last_pass.as_dict()
    facts["sizes"] = {m.name: m.dtype.itemsize * m.shape.numel() if hasattr(m.shape, "numel")
                      else m.dtype.itemsize * int(torch.Size(m.shape).numel()) for m in src.metadata}
    if rank == 0:
        facts["mismatch"] = _bitwise_mismatches(client.model.held, oracle)
        facts["updates"] = [(s, sorted(n)) for s, n in client.updates]
        facts["versions"] = client.versions
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    dist.barrier()
    return facts


def _world_4(rank: int, world_size: int, *, tmp: str) -> bytes:
    from many_senders_worlds import install_standins
    from torch.distributed.device_mesh import init_device_mesh

    install_standins()
    facts = {"pp2tp2": _megatron_case(rank, tmp=tmp, case="pp2tp2", tp=2, pp=2, vpp=None)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for kind in ("plain", "lora", "moe"):
        facts[f"hsdp_{kind}"] = _hsdp_case(rank, mesh, tmp=tmp, kind=kind)
    return pack(facts)


@pytest.fixture(scope="module")
def world4():
    if SKIP is not None:
        pytest.skip(SKIP)
    return run_world(_world_4, 4, tmp=tempfile.mkdtemp(), timeout=400)


@needs_034
def test_megatron_pp2_tp2(world4):
    _check_megatron({r: f["pp2tp2"] for r, f in world4.items()}, world=4, tp=2, pp=2)


@needs_034
@pytest.mark.parametrize("kind", ["plain", "lora", "moe"])
def test_fsdp_hsdp_each_replica_sends_its_share(world4, kind):
    f = {r: world4[r][f"hsdp_{kind}"] for r in range(4)}
    r0 = f[0]
    assert r0["mismatch"] == [], r0["mismatch"][:5]  # byte for byte what save_pretrained wrote
    assert r0["versions"] == ["1"]
    replicas = [tuple(row) for row in r0["replicas"]]
    assert replicas == [(0, 1), (2, 3)]  # init_device_mesh's (2, 2) grid, rows = replicas
    owners = r0["owners"]
    # every tensor is owned by one replica's shard group, sent by that replica's first rank
    assert {o for o in owners.values()} == {(0, 1), (2, 3)}
    first = {n: o[0] for n, o in owners.items()}
    assert [f[r]["sent"] for r in range(4)] == [
        sum(1 for s in first.values() if s == 0), 0, sum(1 for s in first.values() if s == 2), 0
    ]
    assert [(s, ns) for s, ns in r0["updates"]] == [
        (0, sorted(n for n in first if first[n] == 0)), (1, sorted(n for n in first if first[n] == 2))
    ]
    # no gather across replicas: each replica's ranks yield only their replica's tensors
    for r in range(4):
        assert f[r]["stats"]["tensors"] == sum(1 for o in owners.values() if r in o), r
    # bytes per sender: max <= total / senders + the largest tensor
    sizes = r0["sizes"]
    per = [sum(sizes[n] for n in first if first[n] == s) for s in (0, 2)]
    assert max(per) <= sum(per) / 2 + max(sizes.values()), (per, max(sizes.values()))


@needs_034
def test_fp8_over_many_senders_and_refusals(world2):
    f = {r: world2[r]["fp8"] for r in (0, 1)}
    r0 = f[0]
    assert r0["mismatch"] == [] and r0["fp8"] > 0
    owners = r0["owners"]
    for n, o in owners.items():  # a scale travels with its weight, from the weight's stage
        if n.endswith("weight_scale_inv"):
            assert o == owners[n.removesuffix("_scale_inv")], n
    assert {o for o in owners.values()} == {(0,), (1,)}
    assert [f[r]["sent"] for r in (0, 1)] == [sum(1 for o in owners.values() if o == (r,)) for r in (0, 1)]
    for r in (0, 1):
        assert f[r]["delta"].startswith("ValueError") and "sparse_nccl" in f[r]["delta"] and f"rank {r}" in f[r]["delta"]
        assert f[r]["local"].startswith("ValueError") and "mode='full'" in f[r]["local"]
        assert f[r]["bad_value"].startswith("ValueError") and "senders=" in f[r]["bad_value"]
        assert f[r]["plain_fsdp"].startswith("ValueError") and "HSDP" in f[r]["plain_fsdp"], f[r]["plain_fsdp"]
        assert f"rank {r}" in f[r]["plain_fsdp"]


def test_many_senders_refused_on_a_single_sender_vllm(monkeypatch):
    """On vLLM 0.33 (one NCCL sender) senders="owners" raises naming the installed version; runs on
    either version (0.34: the engine's single-sender answer is simulated)."""
    from weightsync.sources.core import senders

    if SKIP is None:
        monkeypatch.setattr(senders, "many_senders_supported", lambda: False)
    with pytest.raises(ValueError, match=r"rank 0: FSDPSource\(senders='owners'\) needs vLLM 0.34 or newer.*installed vLLM 0\.3"):
        from weightsync.sources import FSDPSource

        FSDPSource(torch.nn.Linear(2, 2), senders="owners", rank=0)
