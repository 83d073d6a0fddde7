"""``WeightSync`` on a real 2-rank gloo world with an FSDP2-sharded model.

The receiver is the recording dev-route server in the parent process; the transport is the test-only
``test_json`` trainer engine (vLLM's IPC engine shape, tensors in the HTTP body). The oracle for the
received weights is an unsharded copy of the model that received the same updates (torch's own
parameters, never gathered by weightsync).
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from vllm_devserver import DevServer
from worlds import run_world

pytestmark = pytest.mark.slow


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def _expect_error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test records type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _driver_world(rank: int, world_size: int, url: str) -> dict:
    import requests
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    import json_engine
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync

    facts: dict = {}
    ref = _model()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    facts["sharded"] = all(p.to_local().shape != p.shape for p in model.parameters() if p.dim() == 2)
    client = VLLMHTTPClient(url, timeout=20)

    def ctl(**cfg):
        if rank == 0:
            requests.post(f"{url}/_test/config", json=cfg, timeout=10).raise_for_status()

    # 1. every rank claims to be the sender: refused on every rank, before any HTTP call.
    facts["misconfig"] = _expect_error(
        lambda: WeightSync(ModuleSource(model), JSONTrainerInitInfo(rank=0), client).sync(0)
    )
    # 2. IPC to a remote host: refused on every rank before trainer_init.
    facts["ipc_remote"] = _expect_error(
        lambda: WeightSync(
            ModuleSource(model), IPCTrainerInitInfo(rank=rank), VLLMHTTPClient("http://10.1.2.3:8000")
        ).sync(0)
    )
    # 3. ranks disagree about the metadata: raises on every rank, nothing is updated.
    odd = torch.nn.Linear(2, 2 + rank)
    facts["meta_mismatch"] = _expect_error(
        lambda: WeightSync(ModuleSource(odd), JSONTrainerInitInfo(rank=rank), client, pause=None).sync(0)
    )

    # 4. the real schedule: cold sync, then every 2 steps, parameters updated in between.
    ws = WeightSync(ModuleSource(model), JSONTrainerInitInfo(rank=rank, chunk=3), client, every=2, pause="keep")
    refs: dict[str, dict] = {}
    synced = []

    def step_params(step: int) -> None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.add_(0.25 * step)
                q.add_(0.25 * step)

    r0 = ws.sync(step=0)
    refs["0"] = {k: v.clone() for k, v in ref.named_parameters()}
    for step in range(1, 5):
        step_params(step)
        rep = ws.maybe_sync(step)
        if rep is not None:
            synced.append(step)
            refs[rep.weight_version] = {k: v.clone() for k, v in ref.named_parameters()}
    facts["synced"] = synced
    facts["again_same_step"] = ws.maybe_sync(4)
    facts["report0"] = r0.as_dict()
    facts["report_last"] = ws.last_report.as_dict()

    # 5. the server fails update_weights: every rank raises, rank 0 its own error; resumed.
    step_params(5)
    ctl(fail={"update_weights": [500]})
    facts["send_fail"] = _expect_error(lambda: ws.sync(step=5))
    # 6. the server fails pause: every rank raises in prepare, nothing is sent.
    ctl(fail={"pause": [503]})
    facts["pause_fail"] = _expect_error(lambda: ws.sync(step=6))
    # 7. recovery: the next sync works and carries the current weights.
    facts["recovered"] = ws.sync(step=7).weight_version
    refs["7"] = {k: v.clone() for k, v in ref.named_parameters()}

    ws.shutdown()
    facts["after_shutdown"] = _expect_error(lambda: ws.sync(step=8))
    facts["shutdowns"] = json_engine.JSONTrainerEngine.shutdowns
    dist.barrier()
    # plain lists: tensors through a multiprocessing queue would be shared via file descriptors
    facts["refs"] = {v: {k: t.tolist() for k, t in d.items()} for v, d in refs.items()} if rank == 0 else None
    return facts


def test_driver_two_ranks_fsdp2():
    with DevServer() as server:
        out = run_world(_driver_world, 2, timeout=300, url=server.url)
        calls = server.routes()
    f0, f1 = out[0], out[1]
    assert f0["sharded"] and f1["sharded"]

    # misconfiguration and refusals: every rank raised the same named error, before any bytes moved
    for f in (f0, f1):
        assert f["misconfig"].startswith("ValueError") and "init_info.rank values repeat" in f["misconfig"]
        assert f["ipc_remote"].startswith("InsecureTransportError") and "10.1.2.3" in f["ipc_remote"]
        assert f["meta_mismatch"].startswith("CrossRankMismatchError")
    # the mismatching sync started an update (the engine's first call) but sent no weights
    first_update = calls.index("update_weights")
    assert calls[:first_update] == ["init_weight_transfer_engine", "start_weight_update",
                                    "init_weight_transfer_engine", "pause", "start_weight_update"]

    # schedule
    assert f0["synced"] == f1["synced"] == [2, 4]
    assert f0["again_same_step"] is None
    r0 = f0["report0"]
    n = sum(p.numel() for p in _model().parameters())
    assert r0["tensors"] == 6 and r0["bytes"] == 4 * n and r0["cold"] and r0["weight_version"] == "0"
    assert f1["report0"]["bytes"] == r0["bytes"] and not f1["report0"]["is_sender"]
    assert f0["report_last"]["step"] == 4 and not f0["report_last"]["cold"]

    # what vLLM received at each committed version equals the unsharded oracle at that step
    snaps = server.snapshots
    assert set(snaps) == {"0", "2", "4", "7"}
    for version, expected in f0["refs"].items():
        got = snaps[version]
        assert set(got) == set(expected)
        for k in expected:
            want = torch.tensor(expected[k], dtype=torch.float32)
            torch.testing.assert_close(got[k], want, rtol=0, atol=0, msg=f"{version}/{k}")
    assert server.weight_version == "7" and f0["recovered"] == f1["recovered"] == "7"

    # failures: rank 0 re-raises the server's error, rank 1 a WeightSyncError naming rank 0; resumed
    assert f0["send_fail"].startswith("ControlPlaneError") and "/update_weights HTTP 500" in f0["send_fail"]
    assert f1["send_fail"].startswith("WeightSyncError") and "failed in send on rank(s) [0]" in f1["send_fail"]
    assert "generation was resumed" in f1["send_fail"]
    assert f0["pause_fail"].startswith("ControlPlaneError") and "/pause HTTP 503" in f0["pause_fail"]
    assert f1["pause_fail"].startswith("WeightSyncError") and "failed in pause on rank(s) [0]" in f1["pause_fail"]
    assert calls[-12:] == [
        "pause", "start_weight_update", "update_weights", "resume",  # step 5: send failed, resumed
        "pause", "resume",  # step 6: pause failed, resumed, nothing sent
        "pause", "start_weight_update", "update_weights", "update_weights", "finish_weight_update", "resume",
    ]
    assert "5" not in snaps and "6" not in snaps
    # every sync that paused also resumed, in order
    pauses = [i for i, c in enumerate(calls) if c == "pause"]
    resumes = [i for i, c in enumerate(calls) if c == "resume"]
    assert len(pauses) == len(resumes) and all(p < r for p, r in zip(pauses, resumes))
    assert not server.paused

    for f in (f0, f1):
        assert "after shutdown" in f["after_shutdown"] and f["shutdowns"] >= 1


def test_a_single_nccl_sender_failing_mid_stream_completes_its_turn(monkeypatch):
    """vLLM's dense NCCL engine, one sender: its source raises after 2 of 4 tensors. The worker waits in
    a broadcast for every tensor the update info declared (NCCL has no timeout), so the sender completes
    the turn with zeros: ``sync`` raises the source's error well before the transfer group's own
    timeout, the worker got every declared tensor (zeros for the last two) and finished without a
    ``weight_version``; the next sync is exact and commits. vLLM's real trainer and worker engines;
    only the communicator is a gloo stand-in (``tests/gloo_comm.py``), whose receive would time out."""
    import time

    import vllm.distributed.weight_transfer.nccl_engine as ne
    from flaky_source import FlakySource
    from many_senders_worlds import GlooNCCL, InProcessWorker
    from vllm.distributed.weight_transfer import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync.driver import WeightSync

    group_timeout = 30.0
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(ne, "open_trainer_endpoint", lambda info, rank=0: GlooNCCL(
        info.master_address, info.master_port, rank, info.world_size, group_timeout))
    monkeypatch.setattr(ne, "worker_init_process_group", lambda info, pc: GlooNCCL(
        info.master_address, info.master_port, info.rank_offset, info.world_size, group_timeout))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))

    src = FlakySource(model)
    worker = InProcessWorker("cpu")
    worker.expect(src.metadata)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=0, packed=False)
    ws = WeightSync(src, info, worker, pause=None, timeout_s=60)
    try:
        ws.sync(1)
        assert worker.versions == ["1"]
        src.fail_after = 2
        worker.model.loaded = []
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="injected: the source fails mid-stream"):
            ws.sync(2)
        took = time.perf_counter() - t0
        assert took < group_timeout / 3, f"the failed sync took {took:.1f}s: the worker waited for the missing tensors"
        names = [m.name for m in src.metadata]
        assert worker.model.loaded == names, worker.model.loaded  # every declared tensor arrived
        for n in names[2:]:
            assert torch.count_nonzero(worker.model.held[n]) == 0, n  # the completed turn: zeros
        assert worker.versions == ["1", None]  # finished, nothing committed
        src.fail_after = None
        worker.expect(src.metadata)
        ws.sync(3)
        assert worker.versions == ["1", None, "3"]
        for n, t in ModuleSource(model).iter_full():
            assert torch.equal(worker.model.held[n], t), n
    finally:
        ws.shutdown()
        worker.engine.shutdown()


def test_a_pause_exchange_that_fails_resumes_the_server(monkeypatch):
    """The sender paused the server, then the exchange of the pause's outcome itself failed (a peer
    died or stopped before it: ``SyncTimeoutError``): the sender resumes before raising, so the server
    is never left paused (the soak, ``bench/soak.py`` kill_before, found it left paused)."""
    from json_engine import JSONTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.plugins.sync.driver import WeightSync
    from weightsync.sources import SyncTimeoutError

    class Recording:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return lambda *a, **k: self.calls.append(name)

    client = Recording()
    ws = WeightSync(ModuleSource(torch.nn.Linear(2, 2)), JSONTrainerInitInfo(rank=0), client, pause="keep")
    real = ws._agree

    def agree(board, phase, err):
        if phase == "pause":
            raise SyncTimeoutError("rank 0: the weight sync pause outcome exchange: rank 1 did not answer")
        return real(board, phase, err)

    monkeypatch.setattr(ws, "_agree", agree)
    with pytest.raises(SyncTimeoutError, match="did not answer"):
        ws.sync(1)
    assert "pause" in client.calls and client.calls[-1] == "resume", client.calls
    assert "start_weight_update" not in client.calls  # nothing was sent
