"""Delta sync, plugins side: ``WeightSync`` driving delta rounds (``DeltaSource``) into the sparse
loopback receiver and into vLLM's real ``SparseNCCLTrainerWeightTransferEngine``; patch files.

Oracles: after every sync the sparse loopback engine compares the receiver's full tensors (applied
through vLLM's own ``load_checkpoint_weight_patches``) with a dense ``iter_full`` pass of the wrapped
``FSDPSource`` (``verify_round``), and at the end of each scenario rank 0 compares them again with
torch's own ``get_model_state_dict(full_state_dict=True)`` cast to the wire dtype (no weightsync code
on that side). For vLLM's NCCL engine (needs GPUs) only the communicator is a recording fake; the
engine, its update info and its chunk lifecycle are vLLM's. Patch files: a chain applied to a folder
equals a fresh ``save_safetensors``, file by file, byte for byte.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from worlds import CONTEXT, run_cli, run_world

from weightsync.plugins.loopback.receiver import ReceiverClient, start_receiver_process
from weightsync.plugins.testbed.presets import build_model, load_config

pytestmark = pytest.mark.slow

PRESET = "tiny-qwen3"


def _receiver_model() -> torch.nn.Module:
    return build_model(load_config(PRESET), seed=1).to(torch.bfloat16)


def _fsdp_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(load_config(PRESET), seed=seed).to(dtype)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, n: int = 2) -> None:
    for k in range(n):
        gen = torch.Generator().manual_seed(1000 * step + 10 * k + torch.distributed.get_rank())
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


def _oracle(model: torch.nn.Module) -> dict[str, str]:
    """torch's full state dict (a collective), cast to the bf16 wire: what the receiver must hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from weightsync.sources.toolkit import checksum

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: checksum(v.to(torch.bfloat16)) for k, v in sd.items()}


def _err(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test records it
        return f"{type(e).__name__}: {e}"
    return None


class _FlakyFinish:
    """A ``ReceiverClient`` whose ``finish_weight_update`` fails once when armed (a failure after
    the round's iterator was exhausted: the receiver applied everything, the commit failed)."""

    def __init__(self, url: str) -> None:
        self.inner = ReceiverClient(url)
        self.fail_finish = False

    def finish_weight_update(self, weight_version=None):
        if self.fail_finish:
            self.fail_finish = False
            raise RuntimeError("injected: finish_weight_update failed")
        return self.inner.finish_weight_update(weight_version)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)


# --- world 1: FSDPSource -> WeightSync -> sparse loopback -> receiver process ---------------------


def _loopback_world(rank: int, world_size: int, url: str) -> dict:
    from weightsync.plugins.loopback import LoopbackSparseTrainerInitInfo
    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import DeltaSource, FSDPSource

    scenarios = {}
    for label, dtype, lr in (("fp32 params, bf16 wire", torch.float32, 1e-5), ("bf16 params", torch.bfloat16, 3e-5)):
        model = _fsdp_model(dtype, seed=0 if dtype == torch.float32 else 2)
        optim = torch.optim.Adam(model.parameters(), lr=lr)
        delta = DeltaSource(FSDPSource(model, dtype=torch.bfloat16))
        client = _FlakyFinish(url)
        info = LoopbackSparseTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
        ws = WeightSync(delta, info, client, pause="keep", chunk_bytes=8 << 10)
        rc = ReceiverClient(url)
        rounds = []

        def sync(step: int, tag: str) -> None:
            before = rc.state() if rank == 0 else None
            rep = ws.sync(step)
            f = {k: v for k, v in rep.as_dict().items() if k.startswith("delta_")}
            f.update(tag=tag, version=rep.weight_version, rounds=delta.rounds, anchor_next=delta.anchor_next,
                     verified=ws.engine.verified_rounds)
            if rank == 0:
                st = rc.state()
                f["receiver_version"] = st["weight_version"]
                last = st["last_update"]
                f["masked_calls"] = last["apply_masked_calls"] - before["last_update"].get("apply_masked_calls", 0)
                f["apply_calls"] = last["apply_calls"] - before["last_update"].get("apply_calls", 0)
                f["patches"] = last["patches"]
                f["engine_bytes"] = ws.engine.last_send.bytes
            rounds.append(f)

        sync(0, "anchor")
        sync(1, "no change")
        for step in (2, 3):
            _train(model, optim, step)
            sync(step, "trained")
        # A consumer failure halfway: the 2nd chunk's send raises on the sender. The receiver has
        # applied the first chunk (a state no trainer version had); every rank raises and resets.
        _train(model, optim, 4)
        failures = {}
        engine = ws.engine
        real = engine.send_weight_chunk
        calls = {"n": 0}

        def failing(chunk):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected: the consumer failed halfway through the round")
            return real(chunk)

        engine.send_weight_chunk = failing
        failures["halfway"] = _err(lambda: ws.sync(4))
        engine.send_weight_chunk = real
        failures["halfway_chunks_tried"] = calls["n"] if rank == 0 else None
        failures["anchor_next_after_halfway"] = delta.anchor_next
        failures["version_after_halfway"] = rc.weight_version() if rank == 0 else None
        sync(5, "anchor after failure")
        # A failure after the iterator was exhausted: finish_weight_update raises.
        _train(model, optim, 6)
        client.fail_finish = rank == 0
        failures["finish"] = _err(lambda: ws.sync(6))
        failures["anchor_next_after_finish"] = delta.anchor_next
        sync(7, "anchor after finish failure")
        _train(model, optim, 8)
        sync(8, "trained after recovery")
        oracle = _oracle(model)
        if rank == 0:
            got = rc.full_checksums(list(oracle))
            failures["oracle_mismatch"] = [k for k in oracle if got[k] != oracle[k]]
        ws.shutdown()
        scenarios[label] = {"rounds": rounds, **failures}
    return scenarios


def _megatron_world(rank: int, world_size: int, url: str) -> dict:
    """MegatronSource at TP2 through the same path: anchor, a perturbed delta round, a no-change
    round, each verified against a dense pass by the engine."""
    import argparse

    from weightsync.plugins.cli.build import build_model_and_source
    from weightsync.plugins.cli.delta import _perturb
    from weightsync.plugins.loopback import LoopbackSparseTrainerInitInfo
    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import DeltaSource

    config = load_config(PRESET)
    args = argparse.Namespace(layout="megatron", tp=2, pp=1, vpp=None, ep=1, expert_layout=None, quantize=None)
    hf = build_model(config, seed=3) if rank == 0 else None
    modules, source = build_model_and_source(args, config, torch.bfloat16, hf_model=hf)
    delta = DeltaSource(source)
    info = LoopbackSparseTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
    ws = WeightSync(delta, info, ReceiverClient(url), pause=None, chunk_bytes=16 << 10)
    out = []
    for step in range(3):
        if step == 1:
            _perturb(modules)
        rep = ws.sync(step)
        out.append((rep.delta_anchor, rep.delta_changed, rep.delta_elements, rep.delta_chunks,
                    ws.engine.verified_rounds, type(source).__name__))
    ws.shutdown()
    # a receiver that does not know a name answers "no" in the handshake: every rank raises naming
    # it, no byte moves, the transport stays aligned (the same engine's next round is refused alike)
    from vllm.distributed.weight_transfer.base import ModuleSource

    odd = DeltaSource(ModuleSource(torch.nn.Linear(4, 2).to(torch.bfloat16)))
    bad = WeightSync(odd, LoopbackSparseTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60),
                     ReceiverClient(url), pause=None)
    rejected = [_err(lambda: bad.sync(k)) for k in range(2)]
    aligned = bad.engine._midstream is None
    bad.shutdown()
    return {"syncs": out, "rejected": rejected, "aligned": aligned, "anchor_next": odd.anchor_next}


def test_delta_sync_fsdp_loopback():
    client, handle = start_receiver_process(functools.partial(_receiver_model), mp_context=CONTEXT)
    with handle:
        out = run_world(_loopback_world, 2, timeout=400, url=handle.url)
        calls = client.calls()
        mega = run_world(_megatron_world, 2, timeout=300, url=handle.url)
    syncs = mega[0]["syncs"]
    assert syncs[0][5] == "MegatronSource" and [s[4] for s in syncs] == [1, 2, 3], syncs
    assert syncs[0][0] and syncs[0][1] == syncs[0][2], syncs
    assert not syncs[1][0] and 0 < syncs[1][1] < syncs[1][2], syncs
    assert not syncs[2][0] and syncs[2][1] == 0 and syncs[2][3] == 0, syncs
    assert [s[:3] for s in mega[1]["syncs"]] == [s[:3] for s in syncs]
    for m in mega.values():
        assert all(e is not None and "unknown parameter 'weight'" in e for e in m["rejected"]), m["rejected"]
        assert m["aligned"] and m["anchor_next"]
    for label, s in out[0].items():
        s1 = out[1][label]
        r = {f["tag"]: f for f in s["rounds"]}
        rounds = s["rounds"]
        # every sync verified against a dense pass (verify_round raises otherwise), on every rank
        verified = [0] + [f["verified"] for f in rounds]
        assert all(b > a for a, b in zip(verified, verified[1:])), (label, verified)
        assert [f["version"] for f in rounds] == [f["receiver_version"] for f in rounds], label
        a = r["anchor"]
        assert a["delta_anchor"] and a["delta_changed"] == a["delta_elements"] > 0, (label, a)
        nc = r["no change"]
        assert not nc["delta_anchor"] and nc["delta_changed"] == 0 and nc["delta_chunks"] == 0, (label, nc)
        assert nc["delta_sent_bytes"] == 0 and nc["engine_bytes"] == 0 and nc["receiver_version"] == "1"
        trained = [f for f in rounds if f["tag"].startswith("trained")]
        for f in trained:
            assert not f["delta_anchor"] and 0 < f["delta_changed"] < f["delta_elements"], (label, f)
            assert f["delta_sent_bytes"] == f["engine_bytes"] == f["delta_wire_bytes"], (label, f)
            assert f["delta_wire_bytes"] < f["delta_dense_bytes"], (label, f)
            assert f["apply_calls"] >= 1 and f["masked_calls"] <= f["apply_calls"], (label, f)
        # sparse patches went through vLLM's NaN-masked apply (its copy_ swapped in while loading)
        assert sum(f["masked_calls"] for f in trained) >= 1, label
        assert max(f["delta_chunks"] for f in rounds) > 1  # bounded chunks, several per round
        # the failed syncs raised on every rank, left the version, and the next sync was an anchor
        for s_ in (s, s1):
            assert "injected: the consumer failed halfway" in s_["halfway"], s_["halfway"]
            assert s_["anchor_next_after_halfway"] and s_["anchor_next_after_finish"]
            assert s_["finish"] is not None
        assert "injected: finish_weight_update failed" in s["finish"]
        assert s["halfway_chunks_tried"] == 2 and s["version_after_halfway"] == "3"
        assert r["anchor after failure"]["delta_anchor"] and r["anchor after finish failure"]["delta_anchor"]
        assert not r["trained after recovery"]["delta_anchor"]
        assert s["oracle_mismatch"] == [], (label, s["oracle_mismatch"][:5])
        # both ranks ran every round (the collectives), and agree on the stats
        assert [f["rounds"] for f in s1["rounds"]] == [f["rounds"] for f in rounds]
        assert [f["delta_changed"] for f in s1["rounds"]] == [f["delta_changed"] for f in rounds]
    # the protocol the receiver saw: vLLM's sparse update info, one start/finish per sync
    updates = [c["body"]["update_info"] for c in calls if c["path"] == "/update_weights"]
    assert all("num_updates_list" in u for u in updates)
    assert any("whole" in u for u in updates) and any("whole" not in u for u in updates)


# --- world 2: vLLM's real sparse NCCL trainer engine (recording communicator) + patch files -------


class _FakeComm:
    """Stands in for vLLM's ``PyNcclCommunicator`` (NCCL needs GPUs): records each broadcast."""

    device = torch.device("cpu")
    world_size = 2
    rank = 0
    available = True
    disabled = False

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    def broadcast(self, tensor, src=0, stream=None):
        assert src == 0
        self.sent.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))

    def destroy(self):
        pass


class _RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init",))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def pause(self, mode="keep", clear_cache=True):
        self.calls.append(("pause", mode))

    def resume(self):
        self.calls.append(("resume",))


def _nccl_world(rank: int, world_size: int, tmp: str) -> dict:
    import filecmp

    import vllm.distributed.weight_transfer.sparse_nccl_engine as sne
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerInitInfo,
        SparseNCCLTrainerWeightTransferEngine,
    )

    from weightsync.plugins.checkpoint import apply_delta, read_delta_header, save_delta, save_safetensors
    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import DeltaSource, FSDPSource

    comm = _FakeComm()
    sne.open_trainer_endpoint = lambda info: comm  # only the communicator is fake
    torch.cuda.current_stream = lambda *a, **k: None  # CPU torch: vLLM asks for the CUDA stream
    facts: dict = {}
    model = _fsdp_model(torch.float32)
    optim = torch.optim.Adam(model.parameters(), lr=1e-5)
    delta = DeltaSource(FSDPSource(model, dtype=torch.bfloat16))
    client = _RecordingClient()
    info = SparseNCCLTrainerInitInfo("127.0.0.1", 29999, 2, rank=rank)
    limit = 96 << 10
    ws = WeightSync(delta, info, client, pause="keep", chunk_bytes=limit)
    # what WeightSync refuses at construction, on every rank
    facts["dense_engine"] = _err(lambda: WeightSync(delta, NCCLTrainerInitInfo("h", 1, 2, rank=rank), client))
    facts["plain_source"] = _err(lambda: WeightSync(FSDPSource(model), info, client))
    reports = []
    for step in range(3):
        if step:
            _train(model, optim, step)
        rep = ws.sync(step)
        reports.append({k: v for k, v in rep.as_dict().items() if k.startswith("delta_")})
    # a NaN among the new values (vLLM would read it as "unchanged"): every rank raises naming the
    # tensor, nothing is sent, the next sync is an anchor
    param = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    local = param.to_local()
    with torch.no_grad():
        keep = local[0, 0].clone()
        if rank == 1:
            local[0, 0] = float("nan")
    n_updates = sum(1 for c in client.calls if c[0] == "update")
    facts["nan"] = _err(lambda: ws.sync(3))
    facts["nan_updates_sent"] = sum(1 for c in client.calls if c[0] == "update") - n_updates
    facts["nan_anchor_next"] = delta.anchor_next
    with torch.no_grad():
        local[0, 0] = keep
    rep = ws.sync(4)
    facts["after_nan"] = (rep.delta_anchor, rep.weight_version)
    facts["after_nan_chunks"] = rep.delta_chunks
    facts["after_nan_bytes"] = rep.delta_sent_bytes
    facts["engine"] = type(ws.engine).__name__
    facts["is_vllm_engine"] = isinstance(ws.engine, SparseNCCLTrainerWeightTransferEngine)
    facts["rounds"] = delta.rounds
    facts["completed"] = delta.last_round.completed
    facts["reports"] = reports
    facts["calls"] = [(c[0], c[1] if len(c) > 1 else None) for c in client.calls]
    facts["sent"] = comm.sent if rank == 0 else []
    facts["limit"] = limit
    ws.shutdown()

    # patch files: a chain applied to a folder equals a fresh save_safetensors, byte for byte
    pdelta = DeltaSource(FSDPSource(model, dtype=torch.bfloat16))
    src = FSDPSource(model, dtype=torch.bfloat16)
    base, fresh = os.path.join(tmp, "base"), os.path.join(tmp, "fresh")
    save_safetensors(src, base, version="0", max_shard_bytes=60_000)
    anchor = save_delta(pdelta, os.path.join(tmp, "p0.safetensors"), base_version="", version="0")
    files, reps = [], []
    for v in (1, 2, 3):
        if v != 3:  # the last round: nothing changed
            _train(model, optim, 10 + v)
        p = os.path.join(tmp, f"p{v}.safetensors")
        reps.append(save_delta(pdelta, p, base_version=str(v - 1), version=str(v)))
        files.append(p)
    save_safetensors(src, fresh, version="3", max_shard_bytes=60_000)
    facts["anchor_file"] = (anchor.anchor, anchor.tensors)
    facts["patch_reports"] = [(r.anchor, r.tensors, r.bytes) for r in reps]
    if rank == 0:
        facts["applied"] = apply_delta(base, files)
        names = sorted(os.listdir(fresh))
        facts["files"] = names
        facts["same_names"] = names == sorted(os.listdir(base))
        facts["equal"] = {n: filecmp.cmp(os.path.join(base, n), os.path.join(fresh, n), shallow=False) for n in names}
        facts["stale_base"] = _err(lambda: apply_delta(base, files[0]))
        # cold start: the anchor file brings a folder of any version to "0", the chain to "3"
        import shutil

        cold = os.path.join(tmp, "cold")
        shutil.copytree(fresh, cold)
        facts["cold"] = apply_delta(cold, [os.path.join(tmp, "p0.safetensors"), *files])
        facts["cold_equal"] = all(
            filecmp.cmp(os.path.join(cold, n), os.path.join(fresh, n), shallow=False) for n in names
        )
        facts["header"] = read_delta_header(files[0])
    return facts


def test_sparse_nccl_engine_and_patch_files(tmp_path):
    out = run_world(_nccl_world, 2, timeout=300, tmp=str(tmp_path))
    f0, f1 = out[0], out[1]
    for f in (f0, f1):
        assert f["is_vllm_engine"], f["engine"]
        assert "TypeError" in f["dense_engine"] and "sends dense tensors" in f["dense_engine"]
        assert "TypeError" in f["plain_source"] and "DeltaSource" in f["plain_source"]
        assert f["rounds"] == 4 and f["completed"]  # every rank iterated every round
        assert "model.layers.1.mlp.down_proj.weight" in f["nan"] and "NaN" in f["nan"], f["nan"]
        assert f["nan_anchor_next"] and f["after_nan"] == (True, "4")
    # rank 0 talks to vLLM: pause, one start, the chunks, one finish with the version, resume
    calls = f0["calls"]
    names = [c[0] for c in calls]
    assert names[0] == "init"
    per_sync = [names[i] for i in range(1, len(names))]
    # the NaN sync (3) raised before any patch: start, no update, no finish
    assert per_sync.count("start") == 5 and per_sync.count("finish") == 4 and per_sync.count("pause") == 5
    assert [c[1] for c in calls if c[0] == "finish"] == ["0", "1", "2", "4"]
    assert f0["nan_updates_sent"] == 0
    assert f1["calls"] == []  # non-senders never talk to vLLM
    updates = [c[1] for c in calls if c[0] == "update"]
    reports = f0["reports"]
    assert sum(r["delta_chunks"] for r in reports) + f0["after_nan_chunks"] == len(updates)
    assert reports[0]["delta_anchor"] and not reports[1]["delta_anchor"]
    assert reports[0]["delta_chunks"] > 1
    # each chunk within the bound (or one patch alone), broadcasts = indices then values per patch
    sent = f0["sent"]
    k = 0
    for u in updates:
        assert set(u) == {"names", "dtype_names", "shapes", "num_updates_list"}
        size = sum(6 * n for n in u["num_updates_list"])
        assert size <= f0["limit"] or len(u["names"]) == 1, size
        for n, dt in zip(u["num_updates_list"], u["dtype_names"]):
            assert sent[k] == ("int32", n) and sent[k + 1] == (dt, n)
            k += 2
    assert k == len(sent)
    total = sum(r["delta_sent_bytes"] for r in reports) + f0["after_nan_bytes"]
    assert total == sum(6 * n for u in updates for n in u["num_updates_list"])
    # patch files
    assert f0["anchor_file"][0] and f0["patch_reports"][2][1] == 0  # nothing changed: an empty patch
    assert f0["applied"] == "3" and f0["same_names"], f0["files"]
    assert all(f0["equal"].values()), f0["equal"]
    assert len([n for n in f0["files"] if n.endswith(".safetensors")]) > 1  # a sharded folder
    assert "CheckpointError" in f0["stale_base"] and "base_version '0'" in f0["stale_base"]
    assert f0["header"]["base_version"] == "0" and f0["header"]["version"] == "1"
    assert f0["cold"] == "3" and f0["cold_equal"]


def test_construction_refusals_without_a_world():
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    from weightsync.plugins.loopback import LoopbackSparseTrainerInitInfo, LoopbackTrainerInitInfo
    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import DeltaSource

    lin = torch.nn.Linear(3, 2)
    delta = DeltaSource(ModuleSource(lin))
    client = _RecordingClient()
    for info in (LoopbackTrainerInitInfo("h", 0, 2, rank=0), IPCTrainerInitInfo(rank=0)):
        with pytest.raises(TypeError, match="sends dense tensors"):
            WeightSync(delta, info, client)
    with pytest.raises(TypeError, match="wrap the source in DeltaSource"):
        WeightSync(ModuleSource(lin), LoopbackSparseTrainerInitInfo("h", 0, 2, rank=0), client)
    with pytest.raises(ValueError, match="chunk_bytes"):
        WeightSync(delta, LoopbackSparseTrainerInitInfo("h", 0, 2, rank=0), client, chunk_bytes=0)


# --- the CLI ----------------------------------------------------------------------------------------


def test_cli_demo_and_check_delta():
    import re

    r = run_cli("demo", "--delta", "--nproc", "2", "--steps", "2", nproc=2)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    syncs = [line for line in out.splitlines() if line.strip().startswith(("sync ", "cold start (sync 0)"))]
    assert len(syncs) == 3 and all("EQUALS the trainer" in s for s in syncs), syncs
    assert "anchor: 100.0000% changed" in syncs[0] and all("| delta: " in s for s in syncs[1:]), syncs
    assert syncs[1].strip().startswith("sync 1/2:") and syncs[2].strip().startswith("sync 2/2:"), syncs
    for s in syncs[1:]:
        frac = float(re.search(r"delta: ([\d.]+)% changed", s).group(1))
        assert 0 < frac < 50, s
    assert re.search(r"2/2 syncs verified, .* -> PASS", out), out
    demo_anchor = re.search(r"anchor: .*?\), (\S+ \S+) sent vs", syncs[0]).group(1)
    for argv, nproc, layout in (
        (("--model", "tiny-qwen3", "--nproc", "2"), 2, "fsdp x2"),
        (("--model", "tiny-qwen3", "--layout", "megatron", "--pp", "2"), 2, "megatron tp1 pp2"),
        (("--model", "tiny-qwen3-moe", "--layout", "megatron", "--tp", "2", "--ep", "2"), 4, "tp2 pp1 vpp1 ep2"),
    ):
        r = run_cli("check", "--delta", *argv, nproc=nproc)
        assert r.returncode == 0, (argv, r.stdout, r.stderr[-3000:])
        assert layout in r.stdout and r.stdout.count("EQUALS a dense pass") == 2 and "PASS" in r.stdout, r.stdout
        if layout == "fsdp x2":  # the demo's model and layout: its anchor, in the bytes the demo counts
            anchor = re.search(r"anchor round: .* as vLLM sparse patches \(.*?; (\S+ \S+) whole where cheaper", r.stdout)
            assert anchor and anchor.group(1) == demo_anchor, (demo_anchor, r.stdout)
    r = run_cli("check", "--delta", "--quantize", "fp8")
    assert r.returncode == 2 and "--delta with --quantize" in r.stderr
    r = run_cli("demo", "--delta", "--no-checksums")
    assert r.returncode == 2 and "--no-checksums do not apply" in r.stderr
    r = run_cli("demo", "--lr", "1e-5")
    assert r.returncode == 2 and "--lr is for demo --delta" in r.stderr
