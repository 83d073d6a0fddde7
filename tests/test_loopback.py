"""The loopback backend end to end: a 2-rank FSDP2 trainer world (gloo, CPU) syncing through vLLM's
``WeightTransferTrainerFactory`` into a receiver process over HTTP.

Oracles: torch's own ``get_model_state_dict(full_state_dict=True)`` for what the trainer holds,
SHA-256 of the receiver's state dict for what it loaded, the receiver model's forward for logits,
and vLLM's own ``HTTPVLLMWeightSyncClient`` as the driver of the HTTP routes.

One world per scenario family; each returns a dict of facts the parent asserts.
"""

from __future__ import annotations

import functools
import hashlib
import time

import pytest
import torch

from worlds import CONTEXT, errors_of, run_world

from weightsync.plugins.loopback.receiver import ReceiverClient, start_receiver_process
from weightsync.plugins.testbed.presets import build_model, load_config
from weightsync.sources import WeightSyncError

pytestmark = pytest.mark.slow

PRESET = "tiny-qwen3"  # tied embeddings: lm_head.weight is an alias the receiver must handle


def _receiver_model(preset: str = PRESET) -> torch.nn.Module:
    return build_model(load_config(preset), seed=1)  # differs from the trainer's seed-0 init


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _fsdp_model(preset: str, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(load_config(preset), seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _source(model: torch.nn.Module):
    try:
        from weightsync.sources import FSDPSource

        return FSDPSource(model)
    except (ImportError, AttributeError):
        from vllm.distributed.weight_transfer.base import ModuleSource

        return ModuleSource(model)


def _full_state(model: torch.nn.Module) -> dict[str, str]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: _sha(v) for k, v in sd.items()}


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One real FSDP2 step (not an in-place edit: that would race FSDP2's unsharded root params)."""
    gen = torch.Generator().manual_seed(100 * step + torch.distributed.get_rank())
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()


def _engine(cls_or_factory, rank, port, client, source, **kw):
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo

    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=60, **kw)
    return cls_or_factory.trainer_init(info, client=client, source=source)


# --- world: good syncs, driven by our client and by vLLM's HTTP client ---------------------------


def _sync_world(rank: int, world_size: int, url: str, ports: list[int]) -> dict:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import weightsync.plugins.loopback as lb

    lb.register()  # idempotent: the import already registered it
    facts: dict = {"registered": "loopback" in WeightTransferTrainerFactory._registry}
    model = _fsdp_model(PRESET, world_size)
    source = _source(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    facts["source"] = type(source).__name__
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(7)).tolist()
    rounds = []
    for k, (client, packed, checksums) in enumerate(
        [
            (ReceiverClient(url), True, True),
            (ReceiverClient(url), False, True),
            (HTTPVLLMWeightSyncClient(url), True, False),
        ]
    ):
        engine = _engine(
            WeightTransferTrainerFactory, rank, ports[k], client, source,
            packed=packed, checksums=checksums, packed_buffer_size_bytes=64 * 1024,
        )
        for step in range(2):
            _train_step(model, optim, 10 * k + step)
            # vLLM's client is driven without a version (its finish then sends no body).
            version = f"r{k}s{step}" if isinstance(client, ReceiverClient) else None
            engine.send_weights(weight_version=version)
        full = _full_state(model)
        with torch.no_grad():
            model.eval()
            logits = model(input_ids=torch.tensor(ids)).logits.float()
            model.train()
        out = {"kind": type(client).__name__, "packed": packed, "checksums": checksums}
        if rank == 0:
            out["trainer"] = full
            out["collectives"] = engine.last_send.collectives
            out["bytes"] = engine.last_send.bytes
            out["tensors"] = engine.last_send.tensors
            rc = ReceiverClient(url)
            rlogits, rsha = rc.logits(ids)
            out["logits_equal"] = torch.equal(rlogits, logits)
            out["logits_sha_equal"] = rsha == _sha(logits)
            out["logits_maxdiff"] = float((rlogits - logits).abs().max())
            out["receiver_checksums"] = rc.weight_checksums()
            out["receiver_digests"] = rc.weight_digests()
            out["state"] = rc.state()
        rounds.append(out)
    facts["rounds"] = rounds
    return facts


def test_sync_end_to_end_both_clients():
    client, handle = start_receiver_process(functools.partial(_receiver_model), mp_context=CONTEXT)
    with handle:
        before_digests = client.weight_digests()
        ports = [0] * 3  # 0: each sender binds a free port itself
        res = run_world(_sync_world, 2, timeout=300, url=handle.url, ports=ports)
        calls = client.calls()
        state = client.state()
    r0 = res[0]
    assert res[0]["registered"] and res[1]["registered"]
    expected_model = build_model(load_config(PRESET), seed=0)
    for rnd in r0["rounds"]:
        # Logits of the receiver equal the FSDP trainer's, bit for bit (same dtype, same CPU kernels).
        assert rnd["logits_equal"], (rnd["kind"], rnd["logits_maxdiff"])
        assert rnd["logits_sha_equal"]
        # Every tensor the trainer holds (torch's full state dict) is what the receiver got.
        # vLLM's own weight_checker digests (SHA-256 over the receiver's parameters) equal SHA-256
        # over torch's full state dict of the FSDP trainer.
        trainer = rnd["trainer"]
        digests = rnd["receiver_digests"]
        assert digests == {k: v for k, v in trainer.items() if k in digests}
        assert set(digests) == set(trainer) - {"lm_head.weight"}  # tied alias, one storage
        got = rnd["receiver_checksums"]
        assert "lm_head.weight" not in got  # tied: sent once as embed_tokens, like save_pretrained
        assert set(got) == set(digests)
        assert rnd["tensors"] == len(got)
        assert rnd["bytes"] == sum(p.numel() * 4 for p in expected_model.parameters())
    # Collectives: handshake + chunks (+ checksums). Unpacked sends one broadcast per tensor.
    n = r0["rounds"][1]["tensors"]
    assert r0["rounds"][1]["collectives"] == 1 + n + 1
    assert r0["rounds"][0]["collectives"] < r0["rounds"][1]["collectives"]
    assert r0["rounds"][2]["collectives"] == r0["rounds"][0]["collectives"] - 1  # no checksums
    # Protocol seen by the server, in order: per engine one init, then start/update/finish per send.
    paths = [c["path"] for c in calls if c["path"] != "/weight_checker"]
    one = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert paths == (["/init_weight_transfer_engine"] + one * 2) * 3, paths
    assert all(c["status"] == 200 for c in calls)
    updates = [c["body"]["update_info"] for c in calls if c["path"] == "/update_weights"]
    # NCCL-shaped update info; the second send of an engine reuses the metadata (empty lists).
    assert updates[0]["names"][0] == "model.embed_tokens.weight" and updates[0]["dtype_names"][0] == "float32"
    assert updates[1] == {"names": [], "dtype_names": [], "shapes": []}
    inits = [c["body"]["init_info"] for c in calls if c["path"] == "/init_weight_transfer_engine"]
    assert [i["packed"] for i in inits] == [True, False, True]
    assert [i["checksums"] for i in inits] == [True, True, False]
    # weight_version: ours passes it, vLLM's client passes none (stays at the last one set).
    finishes = [c["body"] for c in calls if c["path"] == "/finish_weight_update"]
    assert finishes[:2] == [{"weight_version": "r0s0"}, {"weight_version": "r0s1"}]
    assert finishes[4:] == [None, None]
    assert state["weight_version"] == "r1s1" and state["updates_finished"] == 6
    assert before_digests != r0["rounds"][0]["receiver_digests"]  # the receiver really changed


# --- world: bad input and corruption ----------------------------------------------------------


def _renamed_source(source, old: str, new: str):
    """A source whose metadata and stream call ``old`` ``new`` (a mapping bug)."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Renamed(WeightSource):
        @cached_property
        def metadata(self):
            return [
                ParamMeta(new if m.name == old else m.name, m.dtype, m.shape, owners=m.owners,
                          mesh_shape=m.mesh_shape, placements=m.placements)
                for m in source.metadata
            ]

        def iter_full(self):
            for n, t in source.iter_full():
                yield (new if n == old else n), t

    return Renamed()


def _dropping_source(source, drop: str):
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import WeightSource

    class Dropping(WeightSource):
        @cached_property
        def metadata(self):
            return [m for m in source.metadata if m.name != drop]

        def iter_full(self):
            for n, t in source.iter_full():
                if n != drop:
                    yield n, t

    return Dropping()


def _late_owner_source(source):
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Late(WeightSource):
        @cached_property
        def metadata(self):
            ms = list(source.metadata)
            m = ms[-1]
            ms[-1] = ParamMeta(m.name, m.dtype, m.shape, owners=(1,))
            return ms

        def iter_full(self):
            yield from source.iter_full()

    return Late()


def _bad_world(rank: int, world_size: int, url: str, ports: list[int]) -> dict:
    from weightsync.plugins.loopback import LoopbackTrainerWeightTransferEngine as Engine

    class Corrupting(Engine):
        """Flips one byte of one parameter on the wire, after its checksum was taken."""

        def _wire(self, name, data):
            if name == "model.layers.1.mlp.down_proj.weight":
                data = data.clone()
                data[5] ^= 0x10
            return data

    model = _fsdp_model(PRESET, world_size)
    source = _source(model)
    client = ReceiverClient(url)
    facts: dict = {}
    # 1. unknown name: receiver rejects at the handshake, before any byte is broadcast.
    eng = _engine(Engine, rank, ports[0], client, _renamed_source(source, "model.norm.weight", "model.nrm.weight"))
    facts["unknown"] = errors_of(lambda: eng.send_weights(weight_version="bad1"))
    facts["unknown_bytes"] = eng.last_send.bytes if rank == 0 else None
    facts["unknown_collectives"] = eng.last_send.collectives if rank == 0 else None
    # 2. missing name: everything sent, finish refuses and lists what is missing.
    eng = _engine(Engine, rank, ports[1], client, _dropping_source(source, "model.layers.0.self_attn.q_norm.weight"))
    facts["missing"] = errors_of(lambda: eng.send_weights(weight_version="bad2"))
    # 3. a byte flipped on the wire: the receiver's checksum names the parameter.
    eng = _engine(Corrupting, rank, ports[2], client, source)
    facts["corrupt"] = errors_of(lambda: eng.send_weights(weight_version="bad3"))
    # 4. same corruption without checksums goes unnoticed by the transport (why checksums exist).
    eng = _engine(Corrupting, rank, ports[3], client, source, checksums=False)
    facts["corrupt_unchecked"] = errors_of(lambda: eng.send_weights(weight_version="unchecked"))
    # 5. owners not starting at rank 0: rejected in trainer_init on every rank, no RPC.
    facts["late_owner"] = errors_of(lambda: _engine(Engine, rank, ports[4], client, _late_owner_source(source)))
    # 6. a good sync still works after all that (fresh engine, receiver re-initialized).
    eng = _engine(Engine, rank, ports[5], client, source)
    facts["good"] = errors_of(lambda: eng.send_weights(weight_version="good"))
    return facts


def test_bad_input_and_corruption_raise_on_every_rank():
    client, handle = start_receiver_process(functools.partial(_receiver_model), mp_context=CONTEXT)
    with handle:
        ports = [0] * 6
        res = run_world(_bad_world, 2, timeout=300, url=handle.url, ports=ports)
        calls = client.calls()
        state = client.state()
        bad_pause = errors_of(lambda: client.pause(mode="sideways"))
        client.pause(mode="keep")
        paused = client.is_paused()
        client.resume()
        resumed = client.is_paused()
    for rank in (0, 1):
        f = res[rank]
        assert f["unknown"] and "model.nrm.weight" in f["unknown"] and "unknown parameter" in f["unknown"], f
        assert f["missing"] and "model.layers.0.self_attn.q_norm.weight" in f["missing"], f
        assert f["corrupt"] and "model.layers.1.mlp.down_proj.weight" in f["corrupt"], f
        assert "checksum" in f["corrupt"]
        assert f["late_owner"] and "rank 0" in f["late_owner"] and "model.norm.weight" in f["late_owner"]
        assert f["good"] is None and f["corrupt_unchecked"] is None
    # On rank 1 the error says it came from the sender.
    assert "failed on rank 0" in res[1]["unknown"]
    # The rejected update moved no parameter bytes: only the handshake ran.
    assert res[0]["unknown_bytes"] == 0 and res[0]["unknown_collectives"] == 1
    # The server saw: init x5 (late_owner made none), the failing updates answered with errors,
    # no finish for rejected/corrupt rounds, and a refused finish for the missing one.
    by = [(c["path"], c["status"], (c["body"] or {}).get("weight_version")) for c in calls]
    inits = [b for b in by if b[0] == "/init_weight_transfer_engine"]
    assert len(inits) == 5
    finishes = [b for b in by if b[0] == "/finish_weight_update"]
    assert finishes == [
        ("/finish_weight_update", 400, "bad2"),  # MetadataMismatchError: missing names
        ("/finish_weight_update", 200, "unchecked"),
        ("/finish_weight_update", 200, "good"),
    ]
    assert state["weight_version"] == "good"
    assert bad_pause and "sideways" in bad_pause
    assert paused is True and resumed is False


# --- the last op of a failed round: the peer matched it, then answered with its error ----------


class _SlowWork:
    """A gloo work item whose completion is marked ``after`` polls late (gloo's thread starved on a
    loaded host), or never (``after=None``: the peer never joined)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.polls = after, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.after is not None and self.polls > self.after

    def wait(self) -> None:
        if self.after is None:
            raise RuntimeError("timed out")


def _rejected() -> None:
    raise WeightSyncError("loopback receiver rejected the update: injected: cannot load a tensor")


def test_an_op_the_peer_matched_completes_although_its_error_came_first():
    """Issue 56 (a failure of the test below on a busy host): the receiver consumed the last
    broadcast, raised its load error and answered over HTTP before gloo marked the sender's side of
    that broadcast done. ``wait_work`` must let the op complete (the transport is aligned, the next
    round may start) and leave the error to the RPC; a peer that never joins still aborts the wait."""
    from weightsync.plugins.loopback.receiver.transport import wait_work

    work = _SlowWork(after=40)  # done 40 polls (~0.2 s) after the error arrived
    wait_work(work, "checksums", rank=0, abort=_rejected, grace_s=30.0)
    assert work.polls > 40
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="injected: cannot load"):
        wait_work(_SlowWork(after=None), "checksums", rank=0, abort=_rejected, grace_s=0.3)
    assert time.monotonic() - t0 < 10


# --- world: the receiver fails while loading, mid-stream; the same engine recovers ---------------


FAIL_NAME = "model.layers.0.mlp.up_proj.weight"


def _recover_world(rank: int, world_size: int, url: str, port: int) -> dict:
    from weightsync.plugins.loopback import LoopbackTrainerWeightTransferEngine as Engine

    model = _fsdp_model(PRESET, world_size)
    eng = _engine(Engine, rank, port, ReceiverClient(url), _source(model), packed=False)
    facts = {"first": errors_of(lambda: eng.send_weights(weight_version="v1"))}
    facts["second"] = errors_of(lambda: eng.send_weights(weight_version="v2"))  # same engine
    facts["trainer"] = _full_state(model)
    return facts


def test_receiver_load_failure_mid_stream_then_same_engine_recovers():
    from weightsync.plugins.loopback.receiver import LoopbackReceiver
    from weightsync.plugins.loopback.receiver import ReceiverServer

    class Faulty(LoopbackReceiver):
        """Raises while loading one parameter in its first round, as a worker's loader might."""

        rounds = 0

        def start_weight_update(self):
            Faulty.rounds += 1
            super().start_weight_update()

        def _load(self, entry, data):
            if Faulty.rounds == 1 and entry[0] == FAIL_NAME:
                raise RuntimeError(f"injected: cannot load {entry[0]}")
            return super()._load(entry, data)

    server = ReceiverServer(Faulty(_receiver_model())).start()
    try:
        res = run_world(_recover_world, 2, timeout=300, url=server.url, port=0)
        client = ReceiverClient(server.url)
        digests = client.weight_digests()
        version = client.weight_version()
    finally:
        server.stop()
    for rank in (0, 1):
        assert res[rank]["first"] and f"injected: cannot load {FAIL_NAME}" in res[rank]["first"], res[rank]
        assert res[rank]["second"] is None, res[rank]["second"]
    assert version == "v2"
    trainer = res[0]["trainer"]
    assert digests == {k: v for k, v in trainer.items() if k in digests} and len(digests) == len(trainer) - 1
