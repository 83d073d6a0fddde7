"""One soak trainer rank: a 2-rank FSDP2 model that syncs into the vLLM server on command, and the
faults a rank can inject on itself at an exact point of a sync.

The parent (``soak_job``) sends ``{"op": "sync", "version": v, "fault": ...}`` over a pipe; the rank
loads version ``v``'s weights (``served_model(v)``: the parent's oracle rebuilds them from the same
seed, never from the trainer), runs ``WeightSync.sync(weight_version=v)`` and answers with what
happened: ``ok``, or the exception's class, whether it is a ``WeightSyncError``, its message and the
seconds from the start of the sync to the raise. ``{"op": "exit"}`` ends the loop.

Faults injected here (``fault["rank"]`` is the rank that acts):

* ``kill_before`` / ``kill_during`` / ``kill_after``: SIGKILL of this rank before ``sync``, at the
  ``fault["at"]``-th tensor of the pass, or after ``sync`` returned (the peer learns it at the next sync);
* ``stop``: this rank tells the parent, then SIGSTOPs itself at the ``at``-th tensor; the parent
  SIGCONTs it once its peer raised and the sync timeout has passed;
* ``sigint``: rank 0 sends SIGINT to every rank of the job at the ``at``-th tensor (Ctrl-C of a
  terminal reaches the whole foreground job at once);
* ``server_kill``: rank 0's client SIGKILLs the vLLM API server inside ``update_weights`` (mid-update);
* ``flip``: one byte of one tensor flipped on the wire (rank 0's engine);
* ``nan``: one element of this rank's shard set to NaN before the pass.

After any failed sync the rank drops its ``WeightSync`` (``shutdown``) and builds a new one at the next
sync: re-initialising the engine is what a user does after a failure (and the only way after a
server restart). Every wait is bounded by the configured timeout; the rank's own process group has
the same timeout (README, "A rank that dies or stops").
"""

from __future__ import annotations

import datetime
import logging
import os
import resource
import signal
import time
import traceback
from typing import Any

__all__ = ["rank_main"]

logger = logging.getLogger("weightsync.bench.soak.rank")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Rank:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any], conn: Any) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.plugins.testbed.vllm_server import served_model

        self.rank, self.world, self.cfg, self.conn = rank, world, cfg, conn
        self.model = served_model(0)
        self.mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.ws: Any = None
        self.failed = False
        self.source: Any = None
        self.at_tensor: Any = None  # (index, callable) for the pass being run
        self.torch = torch

    # ---- weights -------------------------------------------------------------------------------

    def load(self, version: int, nan: bool) -> None:
        """Version ``version``'s weights into this rank's shards (no collective: every rank builds the
        same full tensors from the seed and keeps its own shard)."""
        from torch.distributed.tensor import distribute_tensor

        from weightsync.plugins.testbed.vllm_server import served_model

        full = dict(served_model(version).named_parameters())
        with self.torch.no_grad():
            for name, p in self.model.named_parameters():
                local = distribute_tensor(full[name].detach(), self.mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            if nan:
                p = dict(self.model.named_parameters())["model.layers.0.mlp.down_proj.weight"].to_local()
                p.view(-1)[3] = float("nan")

    # ---- the sync object -----------------------------------------------------------------------

    def build(self) -> None:
        import requests

        from weightsync.plugins.loopback import LoopbackTrainerInitInfo
        from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
        from weightsync.sources import FSDPSource

        timeout_s = self.cfg["timeout_s"]
        session = requests.Session()
        session.headers["Connection"] = "close"  # one request per connection: the proxy sees each one
        rank_self = self

        class Client(VLLMHTTPClient):
            def update_weights(self, update_info):  # noqa: ANN001
                hook = getattr(rank_self, "on_update", None)
                if hook is not None:
                    hook()
                return super().update_weights(update_info)

        client = Client(self.cfg["url"], timeout=timeout_s, transfer_timeout=timeout_s, session=session)
        info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=self.rank, timeout_s=timeout_s)
        source = FSDPSource(self.model, dtype=self.torch.float32)
        full = source.iter_full

        def iter_full():
            for i, pair in enumerate(full()):
                if self.at_tensor is not None and i == self.at_tensor[0]:
                    self.at_tensor[1]()
                yield pair

        source.iter_full = iter_full
        self.source = source
        self.ws = WeightSync(source, info, client, pause="keep", timeout_s=timeout_s)

    def drop(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.shutdown()
            except Exception as e:  # noqa: BLE001 - the failure already reported is what matters
                logger.warning("rank %d: shutdown after a failed sync raised %s: %s", self.rank, type(e).__name__, e)

    # ---- one sync ------------------------------------------------------------------------------

    def sync(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from weightsync.plugins.loopback import LoopbackTrainerWeightTransferEngine
        from weightsync.sources import WeightSyncError

        fault = cmd.get("fault") or {}
        kind = fault.get("kind")
        mine = kind is not None and fault.get("rank") == self.rank
        version = int(cmd["version"])
        self.load(version, nan=mine and kind == "nan")
        if self.ws is None:
            self.build()
        self.at_tensor = None
        self.on_update = None
        at = int(fault.get("at", 5))
        if mine and kind == "kill_before":
            os.kill(os.getpid(), signal.SIGKILL)
        if mine and kind == "kill_during":
            self.at_tensor = (at, lambda: os.kill(os.getpid(), signal.SIGKILL))
        if mine and kind == "stop":
            def stop() -> None:
                self.conn.send({"event": "stopping", "rank": self.rank, "t": time.time()})
                os.kill(os.getpid(), signal.SIGSTOP)

            self.at_tensor = (at, stop)
        if mine and kind == "sigint":
            def ctrl_c() -> None:
                for pid in cmd["job_pids"]:
                    os.kill(pid, signal.SIGINT)

            self.at_tensor = (at, ctrl_c)
        if mine and kind == "server_kill":
            def kill_server() -> None:
                os.kill(cmd["server_pid"], signal.SIGKILL)
                time.sleep(0.2)

            self.on_update = kill_server
        orig_wire = LoopbackTrainerWeightTransferEngine._wire
        if mine and kind == "flip":
            def flip(engine, name, data, _orig=orig_wire):  # noqa: ANN001
                if name == "model.layers.1.mlp.down_proj.weight":
                    data = data.clone()
                    data.view(self.torch.uint8)[100] ^= 0x40
                return _orig(engine, name, data)

            LoopbackTrainerWeightTransferEngine._wire = flip
        t0 = time.monotonic()
        out: dict[str, Any]
        try:
            self.ws.sync(weight_version=str(version))
            out = {"ok": True, "t": time.monotonic() - t0}
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which judges it
            out = {
                "ok": False, "t": time.monotonic() - t0, "error_type": type(e).__name__,
                "named": isinstance(e, WeightSyncError), "msg": str(e)[:600],
                "tb": traceback.format_exc()[-1500:],
            }
            self.failed = True  # the WeightSync is dropped after the answer is sent (rank_main)
            if isinstance(e, KeyboardInterrupt):
                out["interrupted"] = True
        finally:
            LoopbackTrainerWeightTransferEngine._wire = orig_wire
            self.at_tensor = None
            self.on_update = None
        if mine and kind == "kill_after":
            os.kill(os.getpid(), signal.SIGKILL)
        out.update(rank=self.rank, rss_kib=_rss_kib(), fds=_fds(), maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return out


def rank_main(rank: int, world: int, port: int, conn: Any, cfg: dict[str, Any], env: dict[str, str]) -> None:
    """A rank's life: join the job's gloo group (timeout = the sync timeout), then serve commands."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    me = _Rank(rank, world, cfg, conn)
    conn.send({"event": "ready", "rank": rank})
    try:
        while True:
            cmd = conn.recv()
            if cmd["op"] == "exit":
                break
            me.failed = False
            out = me.sync(cmd)
            conn.send(out)  # the raise is judged as it happened; a slow shutdown shows at the next sync
            if me.failed:
                me.drop()
            if out.get("interrupted"):
                break  # Ctrl-C ends the job
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        me.drop()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group with a dead peer may refuse; the process exits anyway
            pass
