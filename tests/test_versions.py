"""Mixed vLLM versions: a trainer on one vLLM, servers on another (issue 40).

vLLM's workers build their init / update info as ``InfoClass(**payload)``, so a field the server's
vLLM does not know fails the call ("unexpected keyword argument"). ``VLLMHTTPClient`` reads each
server's ``GET /version`` and leaves out what a server predates while it holds its default, or
refuses, naming the server, both versions and the field, before any request (and ``WeightSync``
before any collective, on every rank).

Oracles: the payloads are built by the installed vLLM's own trainer engine; what a 0.33 server
parses is 0.33.0's dataclass fields (``V033_*`` below, read from the 0.33.0 wheel and checked against
the installed classes in the 0.33 pass of ``.ci/test``); the stand-in server answers a field outside
that set as vLLM's worker does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import vllm

from vllm_devserver import DevServer
from worlds import dead_port, run_world

from weightsync.plugins.sync import ControlPlaneError, ServerVersionError, VLLMHTTPClient
from weightsync.plugins.sync.http_client import ADDED_FIELDS, parse_vllm_version

#: vLLM 0.33.0's ``nccl_common.NCCLWeightTransferInitInfo`` (the dense and sparse NCCL workers' init
#: info) and ``nccl_engine.NCCLWeightTransferUpdateInfo`` fields.
V033_NCCL_INIT_FIELDS = {
    "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
    "packed_buffer_size_bytes", "packed_num_buffers",
}
V033_NCCL_UPDATE_FIELDS = {"names", "dtype_names", "shapes"}

INSTALLED = parse_vllm_version(vllm.__version__)
needs_034 = pytest.mark.skipif(
    INSTALLED is None or INSTALLED < (0, 34), reason="the trainer-side field exists from vLLM 0.34 on"
)


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_added_fields_table_matches_the_installed_vllm():
    """0.33: the 0.33 sets are the installed classes' fields. 0.34: the installed classes' fields are
    the 0.33 sets plus exactly ``ADDED_FIELDS``, whose "as before" values are the dataclass defaults."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    init, update = _fields(NCCLWeightTransferInitInfo), _fields(NCCLWeightTransferUpdateInfo)
    if INSTALLED < (0, 34):
        assert init == V033_NCCL_INIT_FIELDS and update == V033_NCCL_UPDATE_FIELDS
        return
    assert init - V033_NCCL_INIT_FIELDS == set(ADDED_FIELDS["init_info"])
    assert update - V033_NCCL_UPDATE_FIELDS == set(ADDED_FIELDS["update_info"])
    for cls, table in ((NCCLWeightTransferInitInfo, "init_info"), (NCCLWeightTransferUpdateInfo, "update_info")):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name, (added, default) in ADDED_FIELDS[table].items():
            assert added == (0, 34) and defaults[name] == default, (name, defaults[name], default)


def test_parse_vllm_version():
    assert parse_vllm_version("0.34.0") == (0, 34)
    assert parse_vllm_version("0.33.1.dev4+gabc123") == (0, 33)
    assert parse_vllm_version("0.32.0+cpu") == (0, 32)
    assert parse_vllm_version(None) is None and parse_vllm_version("dev") is None


def _nccl_payload(**kw) -> dict:
    """The worker init payload the installed vLLM's NCCL trainer engine sends."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=29555, world_size=4, **kw)
    return NCCLTrainerWeightTransferEngine._build_worker_init_payload(info)


def _old(**kw) -> DevServer:
    return DevServer(vllm_version="0.33.0", init_fields=V033_NCCL_INIT_FIELDS,
                     update_fields=V033_NCCL_UPDATE_FIELDS, **kw)


def _bodies(server: DevServer, route: str) -> list:
    return [c["body"] for c in server.calls if c["route"] == route]


def test_nccl_init_payload_reaches_old_new_and_unknown_servers():
    """One client, three servers (0.33, 0.34, no /version): each gets vLLM's own payload in a form it
    parses -- the 0.33 one without the 0.34 fields at their defaults, the others as vLLM built it --
    with its own rank_offset; the fields they share are identical."""
    payload = _nccl_payload()
    with _old(world_size=1) as old, DevServer(vllm_version="0.34.0", world_size=1) as new, \
            DevServer(world_size=1) as unknown:
        c = VLLMHTTPClient([old.url, new.url, unknown.url])
        c.init_weight_transfer_engine(payload)
        assert c.server_versions() == {old.url: "0.33.0", new.url: "0.34.0", unknown.url: None}
        (to_old,), (to_new,), (to_unknown,) = (
            [b["init_info"] for b in _bodies(s, "init_weight_transfer_engine")] for s in (old, new, unknown)
        )
        assert set(to_old) <= V033_NCCL_INIT_FIELDS
        assert [to_old["rank_offset"], to_new["rank_offset"], to_unknown["rank_offset"]] == [1, 2, 3]
        assert to_new == {**payload, "rank_offset": 2}
        for k in V033_NCCL_INIT_FIELDS & set(payload) - {"rank_offset"}:
            assert to_old[k] == to_new[k] == to_unknown[k] == payload[k]
        if INSTALLED >= (0, 34):
            assert payload["use_load_plan"] is False  # vLLM 0.34 always sends it ...
            assert "use_load_plan" not in to_old  # ... and a 0.33 server never sees it
            assert "use_load_plan" not in to_unknown  # a default is safe to leave out anywhere
        # /version was asked once per server, not once per call
        c.init_weight_transfer_engine(payload)
        assert [c_["route"] for c_ in old.calls].count("version") == 1


def test_without_the_client_a_034_payload_is_an_error_on_a_033_server():
    """What the client prevents: vLLM 0.34's payload sent as it is (vLLM's own client) fails on a
    0.33 server, naming the field."""
    payload = _nccl_payload()
    if "use_load_plan" not in payload:
        pytest.skip("vLLM < 0.34 sends no 0.34-only field")
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    import requests

    with _old() as old:
        with pytest.raises(requests.HTTPError, match="500"):
            HTTPVLLMWeightSyncClient(old.url, timeout=20).init_weight_transfer_engine(payload)


@needs_034
def test_load_plan_for_an_old_server_is_refused_before_any_request():
    payload = _nccl_payload(use_load_plan=True)
    payload["metadata"] = [["w", "float32", [2, 2]]]
    with _old() as old, DevServer(vllm_version="0.34.0") as new:
        c = VLLMHTTPClient([new.url, old.url])
        with pytest.raises(ServerVersionError) as e:
            c.init_weight_transfer_engine({**payload, "rank_offset": 1, "world_size": 3})
        msg = str(e.value)
        for needle in (old.url, "vLLM 0.33.0", f"this trainer runs vLLM {vllm.__version__}",
                       "'use_load_plan'", "added in vLLM 0.34", "Upgrade that server"):
            assert needle in msg, (needle, msg)
        assert new.url not in msg
        # only GETs (the versions, the world sizes for the rank offsets): no init was posted anywhere
        assert {c["method"] for c in old.calls + new.calls} == {"GET"}
        assert "version" in old.routes() and "version" in new.routes()


def test_update_src_for_an_old_server():
    with _old() as old, DevServer(vllm_version="0.34.0") as new:
        c = VLLMHTTPClient([old.url, new.url])
        c.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "src": 0})
        assert _bodies(old, "update_weights")[0]["update_info"] == {
            "names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
        assert _bodies(new, "update_weights")[0]["update_info"]["src"] == 0
        with pytest.raises(ServerVersionError, match=r"no field 'src'.*many senders"):
            c.update_weights({"names": [], "dtype_names": [], "shapes": [], "src": 1})
        assert len(_bodies(new, "update_weights")) == 1  # refused before the fan-out


def test_version_route_failure_is_a_control_plane_error():
    with dead_port() as port:
        c = VLLMHTTPClient(f"http://127.0.0.1:{port}", timeout=5)
        with pytest.raises(ControlPlaneError, match=r"GET /version request failed"):
            c.server_versions()


# ---- WeightSync, 2 ranks: every rank raises before any collective ------------------------------


class _TwoSenders:
    """Built in the rank: a source whose 'b' is first-owned by rank 1 (0.34's many senders), so
    vLLM's NCCL engine would send update info with ``src=1``."""

    @staticmethod
    def make():
        from functools import cached_property

        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        class TwoSenders(WeightSource):
            @cached_property
            def metadata(self):
                return [ParamMeta("a", torch.float32, (2,), owners=(0,)),
                        ParamMeta("b", torch.float32, (2,), owners=(1,))]

            def owned_names(self, rank):
                return [m.name for m in self.metadata if rank in m.owners]

            def iter_full(self):
                raise AssertionError("no pass may start: the server was refused first")

        return TwoSenders()


def _refusal_world(rank: int, world_size: int, url: str, port: int) -> dict:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync import WeightSync

    def attempt(fn) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test records type and message
            return f"{type(e).__name__}: {e}"
        return "no error"

    def info(**kw):
        return NCCLTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=4, **kw)

    client = VLLMHTTPClient(url, timeout=20)
    facts = {}
    ws = WeightSync(ModuleSource(torch.nn.Linear(2, 2)), info(use_load_plan=True), client, pause="keep")
    facts["load_plan"] = attempt(lambda: ws.sync(step=0))
    facts["engine_after_load_plan"] = ws.engine is not None
    ws2 = WeightSync(_TwoSenders.make(), info(), client, pause="keep")
    facts["senders"] = attempt(lambda: ws2.sync(step=0))
    return facts


@needs_034
def test_weightsync_refuses_an_old_server_on_every_rank_before_any_collective():
    """2 gloo ranks, vLLM's NCCL init info, a 0.33 server: ``use_load_plan=True`` and a source whose
    second parameter is first-owned by rank 1 (update field ``src``) are each refused on both ranks
    -- rank 0 with the ``ServerVersionError``, rank 1 naming rank 0's -- and the server is asked only
    ``GET /version``: no pause, no init, no rendezvous (the NCCL port is dead and never dialled)."""
    with _old() as old, dead_port() as port:
        out = run_world(_refusal_world, 2, timeout=180, url=old.url, port=port)
        routes = old.routes()
    f0, f1 = out[0], out[1]
    assert f0["load_plan"].startswith("ServerVersionError"), f0
    for needle in (old.url, "vLLM 0.33.0", "'use_load_plan'", "this trainer runs vLLM"):
        assert needle in f0["load_plan"] and needle in f1["load_plan"], (needle, f0, f1)
    assert f1["load_plan"].startswith("WeightSyncError") and "server compatibility on rank(s) [0]" in f1["load_plan"]
    assert not f0["engine_after_load_plan"] and not f1["engine_after_load_plan"]
    assert f0["senders"].startswith("ServerVersionError") and "'src'" in f0["senders"], f0
    assert "many senders" in f0["senders"] and "'src'" in f1["senders"], f1
    assert f1["senders"].startswith("WeightSyncError"), f1
    assert set(routes) == {"version"}, routes  # no pause, no init: nothing but GET /version


# ---- a disabled PyNccl communicator: 0.34 raises at trainer_init, 0.33 at our preflight -------------


def _disabled_pynccl_world(rank: int, world_size: int, port: int) -> dict:
    import threading

    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync import WeightSync

    # vLLM's trainer endpoint asks the current CUDA device; this CPU machine stands in for device 0
    torch.accelerator.current_device_index = lambda: 0

    class Worker:
        """The inference side: its init joins the transfer group's store as the worker rank."""

        def __init__(self):
            self.calls = []
            self.joined = threading.Event()

        def init_weight_transfer_engine(self, payload):
            self.calls.append("init")
            StatelessProcessGroup.create(host=payload["master_address"], port=payload["master_port"],
                                         rank=payload["rank_offset"], world_size=payload["world_size"])
            self.joined.set()

        def start_weight_update(self):
            self.calls.append("start")

        def update_weights(self, update_info):
            self.calls.append("update")

        def finish_weight_update(self, weight_version=None):
            self.calls.append("finish")

    client = Worker()
    info = NCCLTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=2)
    ws = WeightSync(ModuleSource(torch.nn.Linear(2, 2)), info, client, pause=None)
    try:
        ws.sync(step=0)
        return {"error": "no error", "calls": client.calls}
    except Exception as e:  # noqa: BLE001 - the test records type, message and notes
        notes = " | ".join(getattr(e, "__notes__", []))
        return {"error": f"{type(e).__name__}: {e} {notes}", "calls": client.calls, "engine": ws.engine is not None}


def test_disabled_pynccl_raises_on_every_rank_before_any_byte(monkeypatch):
    """``VLLM_DISABLE_PYNCCL=1`` on a 2-rank trainer with vLLM's NCCL engine and a worker that joins the
    group: vLLM 0.34 raises at ``trainer_init`` on rank 0 (``_require_usable_communicator``; we add
    the cause), vLLM 0.33 builds a silent communicator and our preflight raises; either way every rank
    raises naming the disabled communicator, no update was started, and no engine is kept."""
    import socket

    monkeypatch.setenv("VLLM_DISABLE_PYNCCL", "1")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = run_world(_disabled_pynccl_world, 2, timeout=180, port=port)
    f0, f1 = out[0], out[1]
    if INSTALLED >= (0, 34):
        assert f0["error"].startswith("RuntimeError: PyNccl communicator is disabled"), f0
        assert "VLLM_DISABLE_PYNCCL is set" in f0["error"], f0
        assert f1["error"].startswith("WeightSyncError") and "engine init on rank(s) [0]" in f1["error"], f1
    else:
        assert f0["error"].startswith("SilentTransportError") and "VLLM_DISABLE_PYNCCL" in f0["error"], f0
        assert f1["error"].startswith("SilentTransportError") and "preflight failed on rank 0" in f1["error"], f1
    assert f0["calls"] == ["init"] and f1["calls"] == [], (f0, f1)  # the rendezvous, nothing after it
    assert not f0["engine"] and not f1["engine"]


# ---- bytes through vLLM 0.34's real NCCL engines into a server that parses like 0.33 --------------


def _forwarding_server(worker, **kw) -> DevServer:
    """A ``DevServer`` (strict 0.33 fields, ``GET /version`` 0.33.0) whose weight-transfer routes drive
    vLLM's real worker ``NCCLWeightTransferEngine`` (``many_senders_worlds.InProcessWorker``)."""

    class Forwarding(DevServer):
        def _call(self, fn, *a):
            try:
                fn(*a)
            except Exception as e:  # noqa: BLE001 - answered like vLLM's server: a 500 naming it
                return 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            return 200, {"message": "ok"}

        def _post_init_weight_transfer_engine(self, q, body):
            info = (body or {})["init_info"]
            return self._unexpected("init_info", info, self.init_fields) or self._call(
                worker.init_weight_transfer_engine, info)

        def _post_start_weight_update(self, q, body):
            return self._call(worker.start_weight_update)

        def _post_update_weights(self, q, body):
            info = (body or {})["update_info"]
            return self._unexpected("update_info", info, self.update_fields) or self._call(
                worker.update_weights, info)

        def _post_finish_weight_update(self, q, body):
            version = (body or {}).get("weight_version")
            status = self._call(worker.finish_weight_update, version)
            self.weight_version = version if status[0] == 200 else self.weight_version
            return status

    return Forwarding(**kw)


def _mixed_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from many_senders_worlds import InProcessWorker, install_standins, share_port
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync import WeightSync

    install_standins()  # CPU: a gloo stand-in for vLLM's PyNccl communicator, nothing else
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    source = ModuleSource(model)
    port = share_port()
    server = None
    box = [None]
    if rank == 0:
        worker = InProcessWorker()
        worker.expect(source.metadata)
        server = _forwarding_server(worker, vllm_version="0.33.0", init_fields=V033_NCCL_INIT_FIELDS,
                                    update_fields=V033_NCCL_UPDATE_FIELDS).__enter__()
        box[0] = server.url
    dist.broadcast_object_list(box, src=0)
    client = VLLMHTTPClient(box[0], timeout=30, transfer_timeout=60)
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=rank, packed=False)
    ws = WeightSync(source, info, client, pause=None)
    facts: dict = {}
    try:
        facts["report"] = ws.sync(step=3).weight_version
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        facts["report2"] = ws.sync(step=4).weight_version
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        facts["error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        want = dict(model.named_parameters())
        facts["equal"] = sorted(n for n, t in worker.model.held.items() if torch.equal(t, want[n].detach()))
        facts["names"] = sorted(want)
        facts["init_payload_keys"] = sorted(worker.init_payloads[0]) if worker.init_payloads else None
        facts["versions"] = worker.versions
        facts["server_routes"] = server.routes()
        facts["server_version"] = server.weight_version
    ws.shutdown()
    dist.barrier()
    if server is not None:
        server.__exit__(None, None, None)
    return facts


@needs_034
def test_a_034_trainer_syncs_into_a_server_that_parses_like_033():
    """2 gloo ranks, ``WeightSync`` over vLLM 0.34's real NCCL trainer engine, into vLLM's real worker
    engine behind an HTTP server that answers ``GET /version`` 0.33.0 and refuses any field 0.33's
    worker lacks (as vLLM 0.33 does). Two syncs land: the worker's tensors equal the trainer's
    bitwise after the second, each version is committed, and the init payload the server saw holds
    only 0.33 fields (vLLM 0.34 built it with ``use_load_plan``)."""
    out = run_world(_mixed_world, 2, timeout=180)
    f0, f1 = out[0], out[1]
    assert "error" not in f0 and "error" not in f1, (f0.get("error"), f1.get("error"))
    assert f0["report2"] == f1["report2"] == "4"
    assert f0["equal"] == f0["names"] and len(f0["names"]) == 4
    assert set(f0["init_payload_keys"]) <= V033_NCCL_INIT_FIELDS and "use_load_plan" not in f0["init_payload_keys"]
    assert f0["versions"] == ["3", "4"] and f0["server_version"] == "4"
    # the transfer world size checked against the server's workers, then its version, before init
    assert f0["server_routes"][:3] == ["get_world_size", "version", "init_weight_transfer_engine"], f0["server_routes"]
