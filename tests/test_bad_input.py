"""The bad-input suite: every case ends in a named error on EVERY rank within a bounded time, nothing
the user passed is mutated, and the next sync after a recoverable error works.

Each world runs many scenarios in sequence on 2 gloo ranks and returns, per scenario and rank, the
error type, message and seconds it took to raise; the parent asserts. Sources are small fakes over
tiny ``nn.Module``s wrapped with ``weightsync.sources.checked`` -- the checks are the subject, the
sources are only the way to misbehave -- plus the real ``FSDPSource`` / loopback cases where noted.
"""

from __future__ import annotations

import time
from functools import cached_property

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from worlds import run_world, tell_peers, wait_for_peers

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0  # weightsync's bound in these worlds; every error below must come far sooner


def _model(hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 4), torch.nn.Linear(4, 4, bias=False)
    )


class ToySource(WeightSource):
    """Every rank holds the whole model; ``misbehave`` (a function of the pair list) applies on
    ``bad_rank`` only. With ``gather=True`` each tensor is rebuilt by an all-gather of row shards on a
    bounded group (like an FSDP unit gather), waited through ``wait_bounded``."""

    def __init__(self, model, *, misbehave=None, bad_rank=1, gather=False):
        self.model = model
        self.misbehave = misbehave
        self.bad_rank = bad_rank
        self.gather = gather

    @cached_property
    def metadata(self):
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def _pairs(self):
        pairs = [(n, p.detach()) for n, p in self.model.named_parameters()]
        if self.misbehave is not None and dist.get_rank() == self.bad_rank:
            pairs = self.misbehave(pairs)
        return pairs

    def iter_local(self):  # no placements: every rank's piece is the whole tensor
        yield from self._pairs()

    def iter_full(self):
        if not self.gather:
            yield from self._pairs()
            return
        from weightsync.sources.core.comm.waits import bounded_group, wait_bounded

        world, rank = dist.get_world_size(), dist.get_rank()
        group = bounded_group(timeout_s=TIMEOUT_S, purpose="pass")
        for name, full in self._pairs():
            shard = full.chunk(world, 0)[rank].contiguous()
            parts = [torch.empty_like(shard) for _ in range(world)]
            work = dist.all_gather(parts, shard, group=group, async_op=True)
            wait_bounded(work, ranks=range(world), what=f"all-gather of {name!r}", timeout_s=TIMEOUT_S)
            yield name, torch.cat(parts)


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", ()))
        return {"type": type(e).__name__, "msg": str(e) + notes, "s": time.monotonic() - t0}
    return {"type": None, "msg": "", "s": time.monotonic() - t0}


def _drain(source, what="iter_full"):
    return [(n, t.clone()) for n, t in getattr(source, what)()]


class _GarbledStore:
    """The default store as one rank reads it, except that the given keys read as ``garble`` says:
    a store that returns garbage for what a peer posted."""

    def __init__(self, store, garble: dict) -> None:
        self._store, self._garble = store, garble

    def multi_get(self, keys):
        return [self._garble.get(k, v) for k, v in zip(keys, self._store.multi_get(keys))]

    def __getattr__(self, name):
        return getattr(self._store, name)


def _garbled_pass(source, garble: dict, *, on_rank: int):
    """Drain ``source`` once; on ``on_rank`` the pass's board reads rank values through
    ``_GarbledStore`` (board exchange ``x/<step>/<rank>`` keys)."""
    from weightsync.sources.core.comm import waits as groups

    init = groups.Board.__init__

    def garbled_init(self, tag, **kw):
        init(self, tag, **kw)
        if tag.startswith("pass/"):
            self._store = _GarbledStore(self._store, garble)

    if dist.get_rank() == on_rank:
        groups.Board.__init__ = garbled_init
    try:
        return _outcome(lambda: _drain(source))
    finally:
        groups.Board.__init__ = init


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SCENARIOS = {
    "order": lambda p: [p[1], p[0], *p[2:]],
    "extra": lambda p: p + [("extra.weight", torch.zeros(2))],
    "missing": lambda p: [p[0], *p[2:]],
    "dtype": lambda p: [p[0], (p[1][0], p[1][1].to(torch.float64)), *p[2:]],
    "shape": lambda p: [p[0], (p[1][0], p[1][1][:-1]), *p[2:]],
    # 4x4: same shape, transposed view; refused where the engine ships it as is (iter_local, nccl_m2n)
    "non_contiguous": lambda p: [*p[:4], (p[4][0], p[4][1].t())],
}
#: drained through iter_local, not iter_full
LOCAL = {"non_contiguous"}


def world_stream_cases(rank, world_size):
    from weightsync.sources import checked

    facts = {}
    model = _model()
    for case, bad in SCENARIOS.items():
        before = _snapshot(model)
        src = checked(ToySource(model, misbehave=bad), timeout_s=TIMEOUT_S)
        meta_before = list(src.metadata)
        facts[case] = _outcome(lambda: _drain(src, "iter_local" if case in LOCAL else "iter_full"))
        facts[case]["unmutated"] = _same(before, _snapshot(model)) and src.metadata == meta_before
        # the next sync after the error works, on the same model, same process groups
        good = checked(ToySource(model), timeout_s=TIMEOUT_S)
        facts[case]["next_ok"] = [n for n, _ in _drain(good)] == [n for n, _ in model.named_parameters()]

    # every iter_full consumer linearizes: a non-contiguous full tensor is a valid stream (vLLM's
    # ModuleSource yields them), passed through as is
    src = checked(ToySource(model, misbehave=SCENARIOS["non_contiguous"]), timeout_s=TIMEOUT_S)
    got: list = []
    facts["non_contiguous_full"] = _outcome(lambda: got.extend(_drain(src)))
    want = [(n, p.detach()) for n, p in model.named_parameters()]
    facts["non_contiguous_full"]["values_ok"] = [n for n, _ in got] == [n for n, _ in want] and all(
        torch.equal(a, b if rank == 0 or n != "2.weight" else b.t()) for (n, a), (_, b) in zip(got, want)
    )

    # a store that returns garbage for a peer's post in the metadata agreement: rank 0 reads rank 1's
    # digest as bytes that are not text, then (a differing digest) rank 1's entries as a broken literal
    for case, garble in (
        ("garbage_digest", {"x/1/1": b"\xff\xfe digest"}),
        ("garbage_entries", {"x/1/1": ("f" * 64 + ":5").encode(), "x/2/1": b"[('0.weight', 'float32', (8, 8"}),
    ):
        facts[case] = _garbled_pass(checked(ToySource(model), timeout_s=TIMEOUT_S), garble, on_rank=0)
        facts[case]["next_ok"] = len(_drain(checked(ToySource(model), timeout_s=TIMEOUT_S))) == 5

    # a rank with another model config: caught before any gather
    other = _model(hidden=8 if rank == 0 else 6)
    before = _snapshot(other)
    src = checked(ToySource(other, gather=True), timeout_s=TIMEOUT_S)
    facts["config"] = _outcome(lambda: _drain(src))
    facts["config"]["unmutated"] = _same(before, _snapshot(other))
    facts["config"]["next_ok"] = len(_drain(checked(ToySource(model, gather=True)))) == 5

    # a rank that stops early while its peers wait in a gather for the next parameter
    src = checked(ToySource(model, gather=True, misbehave=lambda p: p[:2]), timeout_s=TIMEOUT_S)
    facts["stops_early"] = _outcome(lambda: _drain(src))
    facts["stops_early"]["next_ok"] = len(_drain(checked(ToySource(model, gather=True)))) == 5

    # a rank that never starts the pass at all (rank-conditional sync): bounded, names the rank
    src = checked(ToySource(model), timeout_s=3.0)
    if rank == 0:
        facts["absent"] = _outcome(lambda: _drain(src))
        tell_peers("rank 0 gave up on the absent pass")
    else:
        wait_for_peers("rank 0 gave up on the absent pass")  # then it shows up late, for the same pass
        facts["absent"] = _outcome(lambda: _drain(src))
    facts["absent"]["next_ok"] = len(_drain(checked(ToySource(model)))) == 5
    return facts


def test_stream_and_rank_divergence_raise_named_errors_on_every_rank():
    out = run_world(world_stream_cases, 2, timeout=180)
    print({r: {c: round(f["s"], 2) for c, f in facts.items()} for r, facts in out.items()})
    for case in SCENARIOS:
        bad, peer = out[1][case], out[0][case]
        assert bad["type"] == "MetadataMismatchError", (case, bad)
        assert bad["msg"].startswith("rank 1:"), (case, bad)
        assert peer["type"] == "PeerFailedError", (case, peer)
        assert "rank 1 failed" in peer["msg"] and bad["msg"] in peer["msg"], (case, peer)
        for r in (0, 1):
            # named error, not a timeout (the types above; a timeout would be SyncTimeoutError)
            assert "did not complete within" not in out[r][case]["msg"], (case, r, out[r][case])
            assert out[r][case]["unmutated"] and out[r][case]["next_ok"], (case, r, out[r][case])
    assert "name/order" in out[1]["order"]["msg"] and "'0.bias'" in out[1]["order"]["msg"]
    assert "more tensors" in out[1]["extra"]["msg"] and "'extra.weight'" in out[1]["extra"]["msg"]
    assert "index 1" in out[1]["missing"]["msg"] and "'0.bias'" in out[1]["missing"]["msg"]
    assert "dtype" in out[1]["dtype"]["msg"] and "float64" in out[1]["dtype"]["msg"]
    assert "shape" in out[1]["shape"]["msg"] and "(7,)" in out[1]["shape"]["msg"]
    assert "non-contiguous" in out[1]["non_contiguous"]["msg"] and "'2.weight'" in out[1]["non_contiguous"]["msg"]
    assert "iter_local" in out[1]["non_contiguous"]["msg"]
    for r in (0, 1):
        full = out[r]["non_contiguous_full"]
        assert full["type"] is None and full["values_ok"], (r, full)

    for case, exchange, why in (
        ("garbage_digest", "the cross-rank metadata agreement", "UnicodeDecodeError"),
        ("garbage_entries", "the exchange of differing metadata", "SyntaxError"),
    ):
        garbled, peer = out[0][case], out[1][case]
        assert garbled["type"] == "ExchangeError", (case, garbled)  # a weightsync error, not the parser's
        assert garbled["msg"].startswith("rank 0:") and exchange in garbled["msg"], (case, garbled)
        assert "value of rank 1" in garbled["msg"] and why in garbled["msg"], (case, garbled)
        # the peer hears it (or, out of step, fails its own exchange by name): never a timeout
        assert peer["type"] in ("PeerFailedError", "ExchangeError"), (case, peer)
        for r in (0, 1):
            assert "did not complete within" not in out[r][case]["msg"], (case, r, out[r][case])
            assert out[r][case]["next_ok"], (case, r, out[r][case])

    for r in (0, 1):
        cfg = out[r]["config"]
        assert cfg["type"] == "CrossRankMismatchError", cfg
        assert cfg["msg"].startswith(f"rank {r}:") and "rank 1 differs from rank 0" in cfg["msg"]
        assert "entry 0" in cfg["msg"] and "(shape)" in cfg["msg"] and "(8, 8)" in cfg["msg"] and "(6, 6)" in cfg["msg"]
        assert "did not complete within" not in cfg["msg"] and cfg["unmutated"] and cfg["next_ok"], cfg

    early_bad, early_peer = out[1]["stops_early"], out[0]["stops_early"]
    assert early_bad["type"] == "MetadataMismatchError" and "stopped after 2" in early_bad["msg"]
    assert early_peer["type"] == "PeerFailedError"
    assert "all-gather of '1.weight'" in early_peer["msg"] and "stopped after 2" in early_peer["msg"]
    assert "did not complete within" not in early_peer["msg"]  # heard rank 1's error, did not time out
    assert early_bad["next_ok"] and early_peer["next_ok"]

    late0, late1 = out[0]["absent"], out[1]["absent"]
    assert late0["type"] == "SyncTimeoutError" and "rank 1 never reached it" in late0["msg"], late0
    # it waited out the bound it was given (3 s, not the world's default): at least that long, and
    # the message names it
    assert late0["s"] > 2.5 and "within 3s" in late0["msg"], late0
    assert late1["type"] == "PeerFailedError" and "rank 1 never reached it" in late1["msg"], late1
    # rank 1, arriving late, learns rank 0's timeout from the board at once (PeerFailedError quoting
    # it) instead of waiting out a bound of its own
    assert late1["msg"].startswith("rank 1: rank 0 failed"), late1
    assert late0["next_ok"] and late1["next_ok"]


# ---- preflight across ranks -----------------------------------------------------------------


def world_preflight(rank, world_size):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from weightsync.plugins.sync import check_engine

    class Client:
        def init_weight_transfer_engine(self, init_info): ...
        def start_weight_update(self): ...
        def update_weights(self, update_info): ...
        def finish_weight_update(self, weight_version=None): ...

    # vLLM's own communicator over the trainer's gloo world, with an "NCCL" lacking its symbols:
    # vLLM disables it. Only the sender holds it; the non-sender must still raise.
    comm = PyNcclCommunicator(dist.group.WORLD, device="cpu", library_path="libc.so.6")
    engine = NCCLTrainerWeightTransferEngine(
        client=Client(), source=ToySource(_model()), is_sender=rank == 0, rank=rank
    )
    engine.model_update_group = comm if rank == 0 else None
    facts = {"vllm_disabled": bool(comm.disabled and not comm.available)}
    facts["disabled"] = _outcome(lambda: check_engine(engine, timeout_s=TIMEOUT_S))
    return facts


def test_preflight_disabled_nccl_raises_on_every_rank():
    out = run_world(world_preflight, 2, timeout=120)
    for r in (0, 1):
        f = out[r]
        assert f["vllm_disabled"]
        assert f["disabled"]["type"] == "SilentTransportError", f
        assert f["disabled"]["msg"].startswith(f"rank {r}:")
        assert "disabled" in f["disabled"]["msg"] and "ncclCommSuspend" in f["disabled"]["msg"]
    assert "preflight failed on rank 0" in out[1]["disabled"]["msg"]


# ---- end to end: WeightSync + FSDPSource + the loopback backend + an HTTP receiver -----------

FAIL_NAME = "model.layers.1.mlp.down_proj.weight"


def _faulty_receiver(model):
    """vLLM-like receiver whose loading raises mid-round (in its first update round only), as a
    worker's ``load_weights`` would on a loader assertion or an OOM."""
    from weightsync.plugins.loopback.receiver import LoopbackReceiver

    class Faulty(LoopbackReceiver):
        rounds = 0

        def start_weight_update(self):
            Faulty.rounds += 1
            return super().start_weight_update()

        def _load(self, entry, data):
            if Faulty.rounds == 1 and entry[0] == FAIL_NAME:
                raise RuntimeError(f"injected: load_weights failed on {entry[0]}")
            return super()._load(entry, data)

    return Faulty(model)


def _full_checksums(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from weightsync.sources.core.check.integrity import checksum

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: checksum(v) for k, v in sd.items()}


def world_e2e(rank, world_size, url, dead_url, ports):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.testbed.presets import build_model, load_config
    from weightsync.sources import FSDPSource

    model = build_model(load_config("tiny-qwen3"), seed=0)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = _full_checksums(model)

    def info(i, timeout_s=30.0):
        return LoopbackTrainerInitInfo("127.0.0.1", ports[i], 2, rank=rank, timeout_s=timeout_s)

    facts = {}
    ws = WeightSync(FSDPSource(model), info(0), VLLMHTTPClient(url, timeout=20), timeout_s=TIMEOUT_S)
    # 1. the receiver raises while loading one parameter, mid-round
    facts["receiver_raises"] = _outcome(lambda: ws.sync(1))
    facts["same_ws_next"] = _outcome(lambda: ws.sync(2))  # the same WeightSync recovers
    # 2. the HTTP control plane is unreachable (nothing listens there)
    dead = WeightSync(FSDPSource(model), info(1, 8.0), VLLMHTTPClient(dead_url, timeout=5), timeout_s=TIMEOUT_S)
    facts["http_fails"] = _outcome(lambda: dead.sync(2))
    # 3. a parameter name the receiver does not have (a mapping bug): the renamed source
    renamed = _Renamed(FSDPSource(model), "model.norm.weight", "model.nrm.weight")
    bad = WeightSync(renamed, info(2), VLLMHTTPClient(url, timeout=20), timeout_s=TIMEOUT_S)
    facts["unmapped"] = _outcome(lambda: bad.sync(3))
    facts["unmutated"] = _full_checksums(model) == before
    # 4. a transfer world size that is not 1 sender + the receiver's 1 worker: refused before any
    #    rendezvous (it used to wait out the group's timeout, then name a store key)
    wrong = WeightSync(FSDPSource(model), LoopbackTrainerInitInfo("127.0.0.1", 0, 3, rank=rank, timeout_s=30.0),
                       VLLMHTTPClient(url, timeout=20), timeout_s=TIMEOUT_S)
    facts["world_size"] = _outcome(lambda: wrong.sync(4))
    # 5. a sync after all that works (a fresh WeightSync: the ones above re-initialized the
    #    receiver's transport), and the receiver holds exactly the trainer's bytes
    good = WeightSync(FSDPSource(model), info(3), VLLMHTTPClient(url, timeout=20), timeout_s=TIMEOUT_S)
    facts["next"] = _outcome(lambda: good.sync(4))
    facts["trainer"] = _full_checksums(model)
    return facts


class _Renamed(WeightSource):
    def __init__(self, source, old, new):
        self.source, self.old, self.new = source, old, new

    @cached_property
    def metadata(self):
        return [
            ParamMeta(self.new if m.name == self.old else m.name, m.dtype, m.shape, owners=m.owners,
                      mesh_shape=m.mesh_shape, placements=m.placements)
            for m in self.source.metadata
        ]

    def iter_full(self):
        for n, t in self.source.iter_full():
            yield (self.new if n == self.old else n), t


def test_end_to_end_receiver_http_and_unmapped_failures_raise_on_every_rank_then_recover():
    from weightsync.plugins.loopback.receiver import ReceiverClient, ReceiverServer
    from weightsync.plugins.testbed.presets import build_model, load_config
    from worlds import dead_port

    receiver = _faulty_receiver(build_model(load_config("tiny-qwen3"), seed=1))
    server = ReceiverServer(receiver).start()
    try:
        with dead_port() as dead:
            out = run_world(
                world_e2e, 2, timeout=240, url=server.url, dead_url=f"http://127.0.0.1:{dead}",
                ports=[0] * 4,  # 0: each loopback sender binds a free port itself
            )
        received = ReceiverClient(server.url).weight_checksums()
    finally:
        server.stop()
    for r in (0, 1):
        f = out[r]
        for case in ("receiver_raises", "http_fails", "unmapped"):
            assert f[case]["type"] is not None, (case, r, f[case])
            assert f"rank {r}" in f[case]["msg"] or "rank(s)" in f[case]["msg"], (case, r, f[case])
        for case in ("receiver_raises", "unmapped"):  # the receiver's answer, heard at once: no timeout
            assert "timeout" not in f[case]["msg"] and "within" not in f[case]["msg"], (case, r, f[case])
        assert "injected: load_weights failed" in f["receiver_raises"]["msg"], f["receiver_raises"]
        assert FAIL_NAME in f["receiver_raises"]["msg"]
        # named and bounded on every rank; the loopback engine currently reports its transport
        # group timeout rather than the refused HTTP call itself (see the report), hence no URL check
        # bounded by the transport timeout it was given (8 s), which the message names
        assert "engine init" in f["http_fails"]["msg"] and "within 8s" in f["http_fails"]["msg"], f["http_fails"]
        assert "model.nrm.weight" in f["unmapped"]["msg"], f["unmapped"]
        ws_err = f["world_size"]
        assert ws_err["type"] is not None and (f"rank {r}" in ws_err["msg"] or "rank(s)" in ws_err["msg"]), ws_err
        assert "world_size=3" in ws_err["msg"] and "Pass world_size=2" in ws_err["msg"], ws_err
        assert ws_err["s"] < 30.0 and "within" not in ws_err["msg"], ws_err  # refused, not a rendezvous timeout
        assert f["unmutated"], r
        assert f["next"]["type"] is None, f["next"]
    # the receiver holds the trainer's bytes after the recovered sync (torch's full state dict is
    # the oracle; tied lm_head is an alias on both sides)
    trainer = out[0]["trainer"]
    assert {k: v for k, v in received.items() if k in trainer} == {
        k: v for k, v in trainer.items() if k in received
    }
    assert len(set(received) & set(trainer)) >= len(trainer) - 1
    # Known gap (reported to the loopback owner): after the receiver raised mid-round, the SAME
    # WeightSync's next sync times out in the loopback transport handshake (its sender<->receiver
    # group is left misaligned); a fresh WeightSync works (asserted above).
    same = [out[r]["same_ws_next"] for r in (0, 1)]
    if any(x["type"] is not None for x in same):
        pytest.xfail(f"same-WeightSync recovery after a mid-round receiver error: {same[0]['msg'][:200]}")
