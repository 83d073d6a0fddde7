"""The HTTP control plane against real HTTP servers started here.

Route shapes are checked against vLLM's own FastAPI router (``VLLMRouterServer``: vLLM parses
the query and the body, we only record what its EngineClient receives). Failure injection, auth and
fan-out bookkeeping use the stdlib recording server (``DevServer``), which stands in for an
authenticating proxy / a broken instance.
"""

from __future__ import annotations


import pytest
import torch

import json_engine  # noqa: F401 - registers the "test_json" trainer backend
from json_engine import JSONTrainerInitInfo
from vllm_devserver import DevServer, VLLMRouterServer

from weightsync.plugins.sync import ControlPlaneError, InsecureTransportError, VLLMHTTPClient, WeightSync
from weightsync.plugins.sync.http_client import is_loopback_url


@pytest.fixture(scope="module")
def routers():
    with VLLMRouterServer(world_size=2) as a, VLLMRouterServer(world_size=3) as b:
        yield a, b


def _reset(*servers):
    for s in servers:
        s.engine.calls.clear()
        s.engine.fail.clear()
        s.engine.delay.clear()


def test_routes_match_vllm_router_and_fan_out(routers):
    a, b = routers
    _reset(a, b)
    c = VLLMHTTPClient([a.url, b.url])
    c.pause("keep", clear_cache=False)
    assert c.is_paused() == {a.url: True, b.url: True}
    c.resume()
    c.update_weight_version("v3")
    assert c.weight_info() == {a.url: "v3", b.url: "v3"}
    assert c.get_world_size() == {a.url: 2, b.url: 3}
    c.start_weight_update()
    c.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    c.finish_weight_update("v4")
    for s in (a, b):
        calls = s.engine.calls
        assert calls[0] == ("pause_generation", {"mode": "keep", "clear_cache": False})
        assert [n for n, _ in calls] == [
            "pause_generation",
            "is_paused",
            "resume_generation",
            "update_weight_version",
            "get_weight_version",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
        ]
        assert calls[6][1] == {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
        assert calls[7][1] == "v4"
        assert s.engine.version == "v4"
    # finish without a version: vLLM's route takes an empty body and sets nothing
    c.finish_weight_update()
    assert a.engine.calls[-1] == ("finish_weight_update", None)
    # default pause is vLLM's: abort + clear_cache
    c.pause()
    assert a.engine.calls[-1] == ("pause_generation", {"mode": "abort", "clear_cache": True})


def test_failure_on_one_server_names_it_and_reaches_all(routers):
    a, b = routers
    _reset(a, b)
    b.engine.fail["pause_generation"] = RuntimeError("engine dead")
    c = VLLMHTTPClient([a.url, b.url])
    with pytest.raises(ControlPlaneError) as ei:
        c.pause("wait")
    msg = str(ei.value)
    assert b.url in msg and "/pause" in msg and "500" in msg and "1 of 2" in msg
    assert a.url in msg  # listed as succeeded
    assert list(ei.value.failures) == [b.url]
    assert a.names() == ["pause_generation"] and b.names() == ["pause_generation"]


def test_bad_pause_mode_rejected_before_any_request(routers):
    a, _ = routers
    _reset(a)
    with pytest.raises(ValueError, match="mode"):
        VLLMHTTPClient(a.url).pause("drain")
    assert a.names() == []


def test_timeout_is_bounded_and_named(routers):
    a, b = routers
    _reset(a, b)
    a.engine.delay["resume_generation"] = 3.0
    c = VLLMHTTPClient([a.url, b.url], timeout=0.5)
    with pytest.raises(ControlPlaneError) as ei:  # the 0.5 s client bound, not the 3 s delay
        c.resume()
    assert a.url in str(ei.value) and "/resume" in str(ei.value) and "timed out after 0.5s" in str(ei.value)
    assert b.names() == ["resume_generation"]  # the healthy server was still called


def test_unreachable_server_named():
    c = VLLMHTTPClient(["http://127.0.0.1:9"], timeout=2)
    with pytest.raises(ControlPlaneError, match=r"http://127.0.0.1:9: GET /weight_info request failed"):
        c.weight_info()


def test_bearer_auth():
    with DevServer(api_key="s3cret") as s:
        with pytest.raises(ControlPlaneError, match=r"HTTP 401 \(wrong or missing api_key\)"):
            VLLMHTTPClient(s.url).resume()
        c = VLLMHTTPClient(s.url, api_key="s3cret")
        c.pause("abort")
        c.start_weight_update()
        assert [x["auth"] for x in s.calls] == [None, "Bearer s3cret", "Bearer s3cret"]
        assert "s3cret" not in repr(c)


def test_dev_mode_hint_on_404():
    with DevServer() as s:
        with pytest.raises(ControlPlaneError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMHTTPClient(s.url)._fanout("POST", "no_such_route")


def test_pickled_ipc_refused_for_remote_hosts(routers):
    a, _ = routers
    _reset(a)
    assert all(map(is_loopback_url, ["http://127.0.0.1:8000", "http://127.3.4.5", "http://localhost:1", "http://[::1]:8000"]))
    assert not any(map(is_loopback_url, ["http://10.0.0.7:8000", "http://0.0.0.0:8000", "http://vllm.internal:8000", "https://example.com"]))
    handles = [{"GPU-uuid": ("args",)}]
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "ipc_handles": handles}
    remote = VLLMHTTPClient(["http://10.0.0.7:8000", a.url])
    with pytest.raises(InsecureTransportError, match=r"10\.0\.0\.7.*allow_insecure_ipc=True"):
        remote.update_weights(info)
    with pytest.raises(InsecureTransportError):
        remote.check_backend("ipc")
    remote.check_backend("nccl")  # only IPC pickles handles
    VLLMHTTPClient("http://10.0.0.7:8000", allow_insecure_ipc=True).check_backend("ipc")
    assert a.names() == []  # nothing left the process
    # loopback: sent, pickled by vLLM's own client code
    VLLMHTTPClient(a.url).update_weights(info)
    (name, sent), = a.engine.calls
    assert name == "update_weights" and "ipc_handles" not in sent and sent["ipc_handles_pickled"]


def test_nccl_init_gets_per_server_rank_offsets(routers):
    from vllm.distributed.weight_transfer.nccl_common import build_worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    a, b = routers
    _reset(a, b)
    c = VLLMHTTPClient([a.url, b.url])
    assert c.nccl_world_size() == 1 + 2 + 3
    assert c.nccl_world_size(senders=4) == 4 + 2 + 3  # vLLM 0.34's many senders: broadcasters + workers
    with pytest.raises(ValueError, match="senders=0"):
        c.nccl_world_size(senders=0)
    good = build_worker_init_payload(NCCLTrainerInitInfo("10.0.0.1", 29500, 6, rank=0))
    assert good["rank_offset"] == 1
    c.init_weight_transfer_engine(good)
    (na, ia), (nb, ib) = a.engine.calls[-1], b.engine.calls[-1]
    assert na == nb == "init_weight_transfer_engine"
    assert (ia["rank_offset"], ib["rank_offset"]) == (1, 3) and ia["world_size"] == ib["world_size"] == 6
    _reset(a, b)
    bad = build_worker_init_payload(NCCLTrainerInitInfo("10.0.0.1", 29500, 3, rank=0))
    with pytest.raises(ValueError, match="world_size=3.*must be 6"):
        c.init_weight_transfer_engine(bad)
    assert "init_weight_transfer_engine" not in a.names() + b.names()
    # one server: the payload goes through unchanged
    VLLMHTTPClient(a.url).init_weight_transfer_engine(bad)
    assert a.engine.calls[-1] == ("init_weight_transfer_engine", bad)


def test_client_argument_errors():
    with pytest.raises(ValueError, match="base_urls is empty"):
        VLLMHTTPClient([])
    with pytest.raises(ValueError, match="'localhost:8000' is not an http"):
        VLLMHTTPClient("localhost:8000")
    with pytest.raises(ValueError, match="duplicates"):
        VLLMHTTPClient(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="transfer_timeout"):
        VLLMHTTPClient("http://a:1", transfer_timeout=0)


# ---- the driver over HTTP, single trainer process ------------------------------------------------


def _sync(url: str, **kw) -> WeightSync:
    from vllm.distributed.weight_transfer.base import ModuleSource

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ws = WeightSync(ModuleSource(model), JSONTrainerInitInfo(rank=0, chunk=2), VLLMHTTPClient(url), **kw)
    ws.model = model  # type: ignore[attr-defined]
    return ws


def test_driver_pause_send_commit_resume_order(routers):
    a, b = routers
    _reset(a, b)
    ws = _sync(a.url, pause="keep", clear_cache=False)
    report = ws.sync(step=7)
    sync2 = ws.sync(step=8)
    names = a.names()
    one_round = ["pause_generation", "start_weight_update", "update_weights", "update_weights",
                 "finish_weight_update", "resume_generation"]
    assert names == ["init_weight_transfer_engine"] + one_round + one_round
    finishes = [arg for n, arg in a.engine.calls if n == "finish_weight_update"]
    assert finishes == ["7", "8"] and a.engine.version == "8"
    assert a.engine.calls[1][1] == {"mode": "keep", "clear_cache": False}
    n_params = sum(p.numel() for p in ws.model.parameters())
    assert report.tensors == 4 and report.bytes == 4 * n_params and report.cold and not sync2.cold
    assert report.step == 7 and report.weight_version == "7" and report.pause_mode == "keep"
    assert report.metrics()["weightsync/bytes"] == 4 * n_params


def test_driver_resumes_after_failed_send_and_reraises(routers):
    a, _ = routers
    _reset(a)
    ws = _sync(a.url, pause="wait")
    ws.sync(step=1)
    a.engine.calls.clear()
    a.engine.fail["update_weights"] = RuntimeError("worker OOM")
    with pytest.raises(ControlPlaneError, match=r"/update_weights HTTP 500") as ei:
        ws.sync(step=2)
    assert "generation was resumed" in "".join(getattr(ei.value, "__notes__", []))
    assert a.names() == ["pause_generation", "start_weight_update", "update_weights", "resume_generation"]
    assert a.engine.version == "1"  # the failed step never committed
    assert not a.engine.paused
    del a.engine.fail["update_weights"]
    ws.sync(step=3)  # the engine is still usable
    assert a.engine.version == "3"


def test_driver_failed_pause_resumes_and_sends_nothing(routers):
    a, b = routers
    _reset(a, b)
    from vllm.distributed.weight_transfer.base import ModuleSource

    b.engine.fail["pause_generation"] = RuntimeError("no")
    ws = WeightSync(
        ModuleSource(torch.nn.Linear(2, 2)), JSONTrainerInitInfo(rank=0), VLLMHTTPClient([a.url, b.url])
    )
    with pytest.raises(ControlPlaneError, match=r"/pause"):
        ws.sync(step=1)
    for s in (a, b):  # paused (a) or maybe paused (b): both are resumed; no update started
        assert s.names() == ["init_weight_transfer_engine", "pause_generation", "resume_generation"]
    del b.engine.fail["pause_generation"]
    ws.sync(step=2)  # the engine built before the failed pause is reused
    assert a.names().count("init_weight_transfer_engine") == 1 and a.engine.version == "2"


def test_driver_commits_when_engine_never_finishes(routers):
    a, _ = routers
    _reset(a)
    from vllm.distributed.weight_transfer.base import ModuleSource

    ws = WeightSync(ModuleSource(torch.nn.Linear(2, 2)), JSONTrainerInitInfo(rank=0, call_finish=False),
                    VLLMHTTPClient(a.url), pause=None)
    ws.sync(step=5)
    assert a.names()[-1] == "update_weight_version" and a.engine.version == "5"
    assert "pause_generation" not in a.names()


def test_driver_argument_errors(routers):
    a, _ = routers
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    src, info = ModuleSource(torch.nn.Linear(2, 2)), JSONTrainerInitInfo(rank=0)
    with pytest.raises(ValueError, match="every must be a positive int"):
        WeightSync(src, info, VLLMHTTPClient(a.url), every=0)
    with pytest.raises(ValueError, match="pause must be one of"):
        WeightSync(src, info, VLLMHTTPClient(a.url), pause="stop")
    with pytest.raises(TypeError, match="needs a client with pause"):
        WeightSync(src, info, HTTPVLLMWeightSyncClient(a.url))
    with pytest.raises(TypeError, match="init_info must be a vLLM TrainerInitInfo"):
        WeightSync(src, {"rank": 0}, VLLMHTTPClient(a.url))
    with pytest.raises(TypeError, match="source must be a vLLM WeightSource"):
        WeightSync(torch.nn.Linear(2, 2), info, VLLMHTTPClient(a.url))
    with pytest.raises(ValueError, match="init_info.rank=1 in a single-process trainer"):
        WeightSync(src, JSONTrainerInitInfo(rank=1), VLLMHTTPClient(a.url), pause=None).sync(0)
