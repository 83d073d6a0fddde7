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
from many_senders_worlds import check_hsdp, check_megatron, skip_reason, world_2, world_4
from worlds import run_world as _run_world

SKIP = skip_reason()
needs_034 = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


@pytest.fixture(scope="module")
def world2():
    if SKIP is not None:
        pytest.skip(SKIP)
    return run_world(world_2, 2, tmp=tempfile.mkdtemp(), timeout=300)


@needs_034
def test_megatron_ep2_experts_leave_from_their_ep_rank(world2):
    f = {r: world2[r]["ep2"] for r in (0, 1)}
    r0 = f[0]
    assert r0["vs_megatron_ckpt"] == []  # experts and routers: Megatron's own checkpoint
    assert r0["vs_rank0"] == []  # everything: what the single sender delivers through the same engines
    owners = {n: o for n, (o,) in r0["owners"]["owners"].items()}
    # routed experts leave from the EP rank holding them (experts 0-1: rank 0, 2-3: rank 1) ...
    experts = {n: int(n.split(".experts.")[1].split(".")[0]) for n in owners if ".experts." in n}
    assert {n: owners[n] for n in experts} == {n: int(e >= 2) for n, e in experts.items()}
    # ... and rank 1, a data-parallel replica of the dense weights, sends the later part of the
    # dense stream (one switch point in stream order), the router with its layer
    dense = [owners[n] for n in owners if n not in experts and ".mlp.gate." not in n]
    assert dense == sorted(dense) and set(dense) == {0, 1}, dense
    assert [f[r]["owners"]["sent"] for r in (0, 1)] == [sum(1 for s in owners.values() if s == r) for r in (0, 1)]
    assert [s for s, _ in r0["owners"]["updates"]] == [0, 1]
    # rank 0 received nothing point to point (it used to receive EP rank 1's experts)
    assert r0["owners"]["stats"]["bytes_received"] == 0 < r0["rank0"]["stats"]["bytes_received"]
    assert f[1]["owners"]["stats"]["tensors"] == sum(1 for s in owners.values() if s == 1)


@needs_034
def test_megatron_pp2_vpp_and_a_failed_sender(world2):
    res = world2
    pp2 = {r: f["pp2"] for r, f in res.items()}
    check_megatron(pp2, world=2, tp=1, pp=2)
    check_megatron({r: f["vpp"] for r, f in res.items()}, world=2, tp=1, pp=2, vpp=2)
    # a sender that fails mid-stream: every rank raises, naming it; nothing is committed; the next sync works
    for r in (0, 1):
        assert "injected: this sender fails mid-stream" in pp2[r]["fail_outcome"], (r, pp2[r]["fail_outcome"])
    assert pp2[0]["after_fail_mismatch"] > 0  # the failed turn was completed with zeros
    assert pp2[0]["next_mismatch"] == []
    assert pp2[0]["versions"] == ["1", None, "3"]
    assert pp2[1]["sent_in_failed"] == pp2[1]["sent"]  # its whole turn: 3 tensors, then zeros
    assert pp2[1]["resent"] == pp2[1]["sent"]


# ---- 4 ranks: Megatron PP2 x TP2, FSDP2 under HSDP (2 replicas x 2 shards) ---------------------------


@pytest.fixture(scope="module")
def world4():
    if SKIP is not None:
        pytest.skip(SKIP)
    return run_world(world_4, 4, tmp=tempfile.mkdtemp(), timeout=400)


@needs_034
def test_megatron_pp2_tp2_and_a_failed_helper(world4):
    check_megatron({r: world4[r]["pp2tp2"] for r in range(4)}, world=4, tp=2, pp=2)
    # rank 3 (stage 1's TP peer, not a sender) fails at its 3rd piece: its sender, rank 2, hears it
    # (its receive times out, naming rank 3) and completes its turn with zeros; every rank raises,
    # naming rank 3, and nothing is committed
    f = {r: world4[r]["helper_fails"] for r in range(4)}
    assert "injected: this helper fails mid-stream" in f[3]["fail_outcome"]
    for r in (0, 1, 2):
        assert "rank 3" in f[r]["fail_outcome"], (r, f[r]["fail_outcome"])
    assert f[0]["versions"] == ["1", None]
    assert f[2]["sent_in_failed"] == f[2]["sent"]


@needs_034
def test_megatron_pp2_dp2_replicas_share_each_stage(world4):
    """PP2 x DP2 (ranks: stage 0 = 0, 1; stage 1 = 2, 3; replicas {0, 2} and {1, 3}, Megatron's
    default order): each stage's tensors leave from both of its data-parallel replicas, in one
    contiguous run each, so there are 4 senders and nothing moves between ranks."""
    f = {r: world4[r]["pp2dp2"] for r in range(4)}
    r0 = f[0]
    assert r0["mismatch"] == [], r0["mismatch"][:5]
    first = {n: o[0] for n, o in r0["owners"].items()}
    stage0 = [first[n] for n in first if first[n] in (0, 1)]
    assert set(first.values()) == {0, 1, 2, 3}
    for layer in range(4):  # a layer's tensors come from its stage's ranks
        assert {first[n] for n in first if n.startswith(f"model.layers.{layer}.")} <= ({0, 1} if layer < 2 else {2, 3})
    assert stage0 == sorted(stage0)  # one switch point per stage, in stream order
    assert [f[r]["sent"] for r in range(4)] == [sum(1 for s in first.values() if s == r) for r in range(4)]
    assert [s for s, _ in r0["updates"]] == [0, 1, 2, 3] and r0["payload_rank_offset"] == 4
    assert all(f[r]["stats"]["bytes_received"] == 0 for r in range(4))


@needs_034
@pytest.mark.parametrize("kind", ["plain", "lora", "moe"])
def test_fsdp_hsdp_each_replica_sends_its_share(world4, kind):
    check_hsdp({r: world4[r][f"hsdp_{kind}"] for r in range(4)})


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
    from weightsync.sources.core.comm import senders

    if SKIP is None:
        monkeypatch.setattr(senders, "many_senders_supported", lambda: False)
    with pytest.raises(ValueError, match=r"rank 0: FSDPSource\(senders='owners'\) needs vLLM 0.34 or newer.*installed vLLM 0\.3"):
        from weightsync.sources import FSDPSource

        FSDPSource(torch.nn.Linear(2, 2), senders="owners", rank=0)


@needs_034
def test_use_load_plan_refused_for_delta_rounds():
    """vLLM 0.34's ``use_load_plan`` plans direct writes from the metadata sent at init; a delta round
    (sparse patches) cannot use it: refused at construction, naming the field."""
    from many_senders_worlds import NoClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync.driver import WeightSync
    from weightsync.sources import DeltaSource, FSDPSource

    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=0, use_load_plan=True)
    with pytest.raises(ValueError, match=r"rank 0: init_info.use_load_plan=True .* cannot serve delta rounds"):
        WeightSync(DeltaSource(FSDPSource(torch.nn.Linear(2, 2), rank=0)), info, NoClient(), pause=None)


def test_preflight_checks_every_sender_and_counts_them():
    """``check_engine`` with many senders: the group is broadcasters + workers (``nccl_world_size()``
    counts one sender), and a non-zero broadcaster checks its own communicator. Runs on either vLLM."""
    from types import SimpleNamespace as NS

    from vllm.distributed.weight_transfer.base import ParamMeta

    from weightsync.plugins.sync.preflight import check_engine
    from weightsync.sources import PreflightError, SilentTransportError

    meta = [ParamMeta("a", torch.float32, (2,), owners=(0,)), ParamMeta("b", torch.float32, (2,), owners=(1,))]
    client = NS(nccl_world_size=lambda: 2)  # 1 sender + 1 worker, as VLLMHTTPClient counts

    def engine(trainer_rank, **comm):
        c = NS(**{"rank": trainer_rank, "world_size": 3, "available": True, "disabled": False, **comm})
        return NS(is_sender=trainer_rank == 0, rank=trainer_rank, model_update_group=c, source=NS(metadata=meta),
                  client=client)

    assert "matches" in " ".join(check_engine(engine(0), agree=False).checks)  # 2 senders + 1 worker
    with pytest.raises(PreflightError, match=r"world_size 4 .* needs 3 \(2 trainer sender\(s\) \[0, 1\] \+ 1 workers\)"):
        check_engine(engine(0, world_size=4), agree=False)
    assert check_engine(engine(1, rank=1), agree=False).checks == ["nccl: communicator enabled", "nccl: broadcaster 1 of [0, 1], communicator enabled"]
    with pytest.raises(PreflightError, match=r"rank 1: this NCCL sender is rank 0 of its transfer group, not 1"):
        check_engine(engine(1, rank=0), agree=False)
    with pytest.raises(SilentTransportError, match=r"rank 1: vLLM's NCCL communicator is disabled"):
        check_engine(engine(1, rank=1, disabled=True), agree=False)


def test_many_senders_need_the_nccl_backend():
    """A many-sender source with another engine (IPC, loopback) is refused when ``WeightSync`` is built."""
    from many_senders_worlds import NoClient
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    from weightsync.plugins.sync.driver import WeightSync

    from vllm.distributed.weight_transfer import ModuleSource

    src = ModuleSource(torch.nn.Linear(2, 2))
    src.senders = "owners"  # what a many-sender source declares (a real one needs vLLM 0.34)
    with pytest.raises(ValueError, match=r"rank 0: the source has senders='owners'.*backend 'ipc'"):
        WeightSync(src, IPCTrainerInitInfo(rank=0), NoClient(), pause=None, check=False)
