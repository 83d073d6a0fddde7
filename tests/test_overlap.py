"""FSDPSource overlap (issue 19): gathers posted ahead of the consumer, on a 2-rank gloo world.

Oracle: the same source with ``overlap=False`` (the sequential pass every other test checks against
``save_pretrained``), in the same world. One world checks:

* the stream (names, order, dtypes, bytes) and the collective count are the same with overlap on
  (one group ahead, the default), off, several groups ahead (``prefetch_bytes``) and small groups;
* the bytes in flight ahead stay within the bound (``PassStats.ahead_peak_bytes``), and the whole
  pass's extra memory within two groups (plus the send block packed ahead on CPU);
* a consumer that raises mid-pass on every rank -- at the first tensor, inside a group, at a group's
  first tensor, at the last tensor -- or closes the generator, plain and under ``checked()``, leaves
  nothing held and nothing half-posted: the next pass on the same source equals the reference on
  every rank; so does a pass started while an abandoned one is still open;
* pieces large enough to be unpacked one ahead on the helper thread (CPU) stream the same bytes.

And ``save_safetensors``'s writer thread: the same files, byte for byte, with the default queue, a
queue that admits one tensor at a time and no thread (``write_queue_bytes=0``), within the queue's
bound. (Its failure paths -- ENOSPC/EFBIG raised on the thread, a peer failing mid-stream -- are
``tests/test_checkpoint.py``'s, which run with the thread on by default.)

``WEIGHTSYNC_OVERLAP=0`` turns overlap off for every source built with the default (run any FSDP
test file that way to check the sequential path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_worlds import pack, shard, tiny_model, unpack
from worlds import run_world

pytestmark = pytest.mark.slow


class ConsumerFailed(RuntimeError):
    pass


def _bytes_equal(got: list, want: list) -> bool:
    if [n for n, _ in got] != [n for n, _ in want]:
        return False
    return all(
        g.dtype == w.dtype
        and g.shape == w.shape
        and torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
        for (_, g), (_, w) in zip(got, want)
    )


def _cpu(pairs) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in pairs]


def _raise_at(source, index: int) -> str:
    """Consume until tensor ``index``, then raise in the consumer; returns the error seen."""
    try:
        for k, (_name, _t) in enumerate(source.iter_full()):
            if k == index:
                raise ConsumerFailed(f"consumer failed at tensor {k}")
    except ConsumerFailed as e:
        return str(e)
    return "no error"


def _close_at(source, index: int) -> None:
    it = source.iter_full()
    for _ in range(index + 1):
        next(it)
    it.close()


def world_overlap(rank: int, world_size: int) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import FSDPSource, checked

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_model("qwen3", tied=False, seed=1, layers=4)
    shard(model, mesh)
    facts: dict[str, Any] = {}

    off = FSDPSource(model, dtype=torch.bfloat16, overlap=False)
    ref = _cpu(off.iter_full())
    facts["n"] = len(ref)
    facts["off"] = off.last_pass.as_dict()
    # Explicit overlap=True: these scenarios test overlap whatever WEIGHTSYNC_OVERLAP says (the suite
    # also runs with it off); the default and the variable are checked on their own below.
    variants = {
        "on": FSDPSource(model, dtype=torch.bfloat16, overlap=True),
        "deep": FSDPSource(model, dtype=torch.bfloat16, prefetch_bytes=1 << 30, overlap=True),
        "small_one": FSDPSource(model, dtype=torch.bfloat16, group_bytes=4096, overlap=True),
        "small_deep": FSDPSource(model, dtype=torch.bfloat16, group_bytes=4096, prefetch_bytes=20_000, overlap=True),
        "small_off": FSDPSource(model, dtype=torch.bfloat16, group_bytes=4096, overlap=False),
    }
    facts["defaults"] = _defaults(model)
    for key, src in variants.items():
        facts[f"{key}_overlap"] = src.overlap
        facts[f"{key}_equal"] = _bytes_equal(_cpu(src.iter_full()), ref)
        facts[key] = src.last_pass.as_dict()
        facts[f"{key}_held_after"] = src.last_pass._extra

    # Early stops, on every rank at the same point; each followed by a full pass on the same source.
    src = variants["on"]
    steps = src._plan(src._resolve())
    group_first = len(steps[0].indices) + len(steps[1].indices)  # first tensor of the third step
    stops = {"first": 0, "inside": 2, "group_first": group_first, "last": len(ref) - 1}
    for label, index in stops.items():
        facts[f"raise_{label}"] = _raise_at(src, index)
        facts[f"raise_{label}_held"] = src.last_pass._extra
        facts[f"raise_{label}_next"] = _bytes_equal(_cpu(src.iter_full()), ref)
    _close_at(src, 2)
    facts["close_held"] = src.last_pass._extra
    facts["close_next"] = _bytes_equal(_cpu(src.iter_full()), ref)
    chk = checked(variants["deep"], timeout_s=20)
    facts["checked_raise"] = _raise_at(chk, 3)
    facts["checked_next"] = _bytes_equal(_cpu(chk.iter_full()), ref)
    _close_at(chk, 1)
    facts["checked_close_next"] = _bytes_equal(_cpu(chk.iter_full()), ref)
    # A pass abandoned without being closed (a traceback holding it): a new pass still lines up,
    # because every rank posted the same gathers before abandoning it.
    src = variants["deep"]
    it = src.iter_full()
    for _ in range(3):
        next(it)
    facts["abandoned_next"] = _bytes_equal(_cpu(src.iter_full()), ref)
    it.close()
    facts["after_abandoned_next"] = _bytes_equal(_cpu(src.iter_full()), ref)
    # Pieces of >= 1 MiB (the MLP weights here): on CPU the helper thread unpacks them one ahead of
    # the consumer. Same stream as overlap off; a stop right after one was handed off still leaves
    # the next pass equal on every rank.
    from transformers import AutoModelForCausalLM, Qwen3Config

    from weightsync.sources.fsdp.buffers import BufferPool
    from weightsync.sources.fsdp.gather import BatchedGather

    torch.manual_seed(3)
    wide = AutoModelForCausalLM.from_config(Qwen3Config(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, tie_word_embeddings=False,
    ))
    shard(wide, mesh)
    pools: list[tuple[int, int]] = []  # (taken, allocated) of each pass's buffer pools
    early: list[bool] = []  # start_early calls that started an unpack
    close, start_early = BufferPool.close, BatchedGather.start_early

    def counting_close(self):
        pools.append((self.taken, self.allocated))
        close(self)

    def counting_start_early(self):
        out = start_early(self)
        early.append(self._early is not None)
        return out

    BufferPool.close, BatchedGather.start_early = counting_close, counting_start_early
    try:
        wide_ref = _cpu(FSDPSource(wide, overlap=False).iter_full())
        facts["wide_off_buffers"] = pools[:]
        src = FSDPSource(wide, overlap=True)
        del pools[:], early[:]
        facts["wide_equal"] = _bytes_equal(_cpu(src.iter_full()), wide_ref)
        facts["wide_on_buffers"] = pools[:]
        facts["wide_big_pieces"] = sum(t.numel() * t.element_size() >= 1 << 20 for _, t in wide_ref)
        gate = next(k for k, (n, _) in enumerate(wide_ref) if n.endswith("layers.0.mlp.gate_proj.weight"))
        facts["wide_raise"] = _raise_at(src, gate)
        facts["wide_raise_held"] = src.last_pass._extra
        facts["wide_raise_next"] = _bytes_equal(_cpu(src.iter_full()), wide_ref)
        # A slow consumer: each next gather has completed before this group's last tensor, so its
        # first large piece is unpacked early (while this group is still consumed). Same bytes; a
        # stop at a group's last tensor, with the next group's unpack started, leaves all ready.
        del early[:]
        slow = [(n, t.clone()) for n, t in _slowly(src.iter_full())]
        facts["slow_equal"] = _bytes_equal(slow, wide_ref)
        facts["slow_early"] = sum(early)
        last0 = max(k for k, (n, _) in enumerate(wide_ref) if ".layers.0." in n)
        del early[:]
        facts["slow_raise"] = _raise_at(_Slow(src), last0)
        facts["slow_raise_early"] = sum(early)
        facts["slow_raise_held"] = src.last_pass._extra
        facts["slow_raise_next"] = _bytes_equal(_cpu(src.iter_full()), wide_ref)
    finally:
        BufferPool.close, BatchedGather.start_early = close, start_early
    return pack(facts)


def _defaults(model) -> dict[str, bool]:
    """``FSDPSource(model).overlap`` under each value of WEIGHTSYNC_OVERLAP (restored afterwards),
    and an explicit ``overlap=True`` / ``False`` under the opposite value."""
    import os

    from weightsync.sources import FSDPSource

    saved = os.environ.pop("WEIGHTSYNC_OVERLAP", None)
    out = {}
    try:
        out["unset"] = FSDPSource(model).overlap
        for value in ("0", "false", "OFF", "no", "1", "yes"):
            os.environ["WEIGHTSYNC_OVERLAP"] = value
            out[value] = FSDPSource(model).overlap
        os.environ["WEIGHTSYNC_OVERLAP"] = "0"
        out["explicit_on_under_0"] = FSDPSource(model, overlap=True).overlap
        os.environ["WEIGHTSYNC_OVERLAP"] = "1"
        out["explicit_off_under_1"] = FSDPSource(model, overlap=False).overlap
    finally:
        os.environ.pop("WEIGHTSYNC_OVERLAP", None)
        if saved is not None:
            os.environ["WEIGHTSYNC_OVERLAP"] = saved
    return out


def _slowly(pairs, pause: float = 0.01):
    """A consumer that spends ``pause`` seconds on each tensor (the next gather completes meanwhile)."""
    import time

    for name, t in pairs:
        time.sleep(pause)
        yield name, t


class _Slow:
    def __init__(self, source):
        self.source = source

    def iter_full(self):
        return _slowly(self.source.iter_full())


@pytest.fixture(scope="module")
def overlap_world():
    return unpack(run_world(world_overlap, 2, timeout=300))


def test_same_stream_and_collectives_with_overlap_on_and_off(overlap_world):
    for rank, f in overlap_world.items():
        assert f["off"]["ahead_peak_bytes"] == 0 and f["small_off"]["ahead_peak_bytes"] == 0
        for key in ("on", "deep", "small_one", "small_deep", "small_off"):
            assert f[f"{key}_equal"], (rank, key)
            assert f[f"{key}_held_after"] == 0, (rank, key)
            assert f[key]["tensors"] == f["n"]
        assert f["on_overlap"] and not f["small_off_overlap"]
        want = {"unset": True, "0": False, "false": False, "OFF": False, "no": False, "1": True, "yes": True,
                "explicit_on_under_0": True, "explicit_off_under_1": False}
        assert f["defaults"] == want, (rank, f["defaults"])  # overlap on by default; the variable turns it off
        for key in ("on", "deep"):
            assert f[key]["collectives"] == f["off"]["collectives"], (rank, key)
            assert f[key]["bytes_received"] == f["off"]["bytes_received"], (rank, key)
        for key in ("small_one", "small_deep"):
            assert f[key]["collectives"] == f["small_off"]["collectives"] > f["off"]["collectives"]
            assert f[key]["bytes_received"] == f["small_off"]["bytes_received"]


def test_bytes_in_flight_stay_within_the_bound(overlap_world):
    for rank, f in overlap_world.items():
        off_peak = f["off"]["peak_extra_bytes"]  # one group + the tensor being unpacked
        # default: one group ahead, never more than the largest group the sequential pass held
        assert 0 < f["on"]["ahead_peak_bytes"] <= off_peak, (rank, f["on"])
        # two groups (send + gathered buffer each), plus on CPU the next group's send block packed
        # ahead on the helper thread (a third of a group's footprint at n=2)
        assert f["on"]["peak_extra_bytes"] <= 2 * off_peak + off_peak // 2, (rank, f["on"], off_peak)
        # prefetch_bytes: several small groups ahead, within the bytes asked for
        one = f["small_one"]["ahead_peak_bytes"]
        deep = f["small_deep"]["ahead_peak_bytes"]
        assert 0 < one < deep <= 20_000, (rank, one, deep)
        assert f["deep"]["ahead_peak_bytes"] > f["on"]["ahead_peak_bytes"]


def test_consumer_raising_or_closing_mid_pass_leaves_every_rank_ready(overlap_world):
    for rank, f in overlap_world.items():
        for label in ("first", "inside", "group_first", "last"):
            assert f[f"raise_{label}"].startswith("consumer failed"), (rank, label, f[f"raise_{label}"])
            assert f[f"raise_{label}_held"] == 0, (rank, label)  # posted gathers drained and freed
            assert f[f"raise_{label}_next"], (rank, label)
        assert f["close_held"] == 0 and f["close_next"], rank
        assert f["checked_raise"].startswith("consumer failed"), f["checked_raise"]
        assert f["checked_next"] and f["checked_close_next"], rank
        assert f["abandoned_next"] and f["after_abandoned_next"], rank
        assert f["wide_big_pieces"] >= 6 and f["wide_equal"], rank
        assert f["wide_raise"].startswith("consumer failed") and f["wide_raise_held"] == 0, rank
        assert f["wide_raise_next"], rank
        assert f["slow_equal"] and f["slow_early"] >= 3, (rank, f["slow_early"])  # 4 layers + the head
        assert f["slow_raise"].startswith("consumer failed") and f["slow_raise_early"] >= 1, rank
        assert f["slow_raise_held"] == 0 and f["slow_raise_next"], rank


def test_gather_buffers_are_recycled_within_a_pass(overlap_world):
    """CPU: send blocks and gathered buffers of a pass's groups reuse the memory of earlier groups
    (buffers.BufferPool) -- 6 gathers (embeddings, 4 layers, head) need 12 buffers, far fewer are
    allocated -- with overlap on and off, and the pass ends holding nothing (checked above)."""
    for rank, f in overlap_world.items():
        for key in ("wide_off_buffers", "wide_on_buffers"):
            assert len(f[key]) == 2, (rank, key)  # one pool per role (send, gathered), closed once
            taken, allocated = (sum(x) for x in zip(*f[key]))
            assert taken == 12 and allocated <= 7, (rank, key, taken, allocated)


def world_writer_queue(rank: int, world_size: int, *, base: str) -> bytes:
    """``save_safetensors`` with the writer thread (default queue, a 1-byte queue that admits one
    tensor at a time) and without (``write_queue_bytes=0``), sharded, on the same FSDP2 source."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(tiny_model("qwen3", tied=False, seed=2, layers=3), mesh)
    src = FSDPSource(model)
    facts: dict[str, Any] = {"largest": max(t.numel() * t.element_size() for _, t in _cpu(src.iter_full()))}
    for label, q in (("default", None), ("one", 1), ("sync", 0)):
        kw = {} if q is None else {"write_queue_bytes": q}
        facts[label] = save_safetensors(src, os.path.join(base, label), max_shard_bytes=20_000, **kw).metrics()
    facts["bad_queue"] = None
    try:
        save_safetensors(src, os.path.join(base, "bad"), write_queue_bytes=-1)
    except Exception as e:  # noqa: BLE001
        facts["bad_queue"] = f"{type(e).__name__}: {e}"
    return pack(facts)


def test_writer_thread_writes_the_same_files_within_its_queue_bound(tmp_path):
    import filecmp
    import os

    results = unpack(run_world(world_writer_queue, 2, timeout=300, base=str(tmp_path)))
    f = results[0]
    files = sorted(os.listdir(tmp_path / "sync"))
    assert len([x for x in files if x.endswith(".safetensors")]) > 1  # sharded
    for label in ("default", "one"):
        assert sorted(os.listdir(tmp_path / label)) == files
        for name in files:
            assert filecmp.cmp(tmp_path / label / name, tmp_path / "sync" / name, shallow=False), (label, name)
    assert f["sync"]["peak_queued_bytes"] == 0 and f["sync"]["write_queue_bytes"] == 0
    assert 0 < f["default"]["peak_queued_bytes"] <= max(f["default"]["write_queue_bytes"], f["largest"])
    assert 0 < f["one"]["peak_queued_bytes"] <= f["largest"]  # one tensor at a time
    for label in ("default", "one", "sync"):
        assert f[label]["peak_extra_bytes"] == f["sync"]["peak_extra_bytes"]  # headers only (CPU tensors)
    for rank, facts in results.items():
        assert facts["bad_queue"].startswith("CheckpointError") and "write_queue_bytes" in facts["bad_queue"], rank


# ---- MegatronSource: the next unit's point-to-point transfer posted ahead ------------------------


def world_megatron_overlap(rank: int, world_size: int) -> bytes:
    """4 ranks: a dense Qwen2 at TP2 x PP2 (bf16 wire: peers cast before sending), then a Qwen3-MoE at
    TP2 x EP2 (the lookahead stops at every MoE layer's export); each exported with overlap on and off."""
    import megatron_worlds as mw
    from moe_megatron import build_gpt, init_parallel, moe_config
    from test_moe_megatron import _hf_config

    from weightsync.sources import MegatronSource

    facts: dict[str, Any] = {}
    cfg = mw.hf_config("qwen2")
    mw.init_parallel(2, 2)
    model = mw.megatron_model(cfg)
    mw.randomize_norms_and_biases(model)
    facts["max_piece_bytes"] = max(p.numel() * 2 for p in model.parameters())  # bf16
    for label, on in (("on", True), ("off", False)):
        src = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16, overlap=on)
        facts[f"dense_{label}"] = _cpu(src.iter_full())
        facts[f"dense_{label}_stats"] = src.last_pass.as_dict()
        facts[f"dense_{label}_again"] = _cpu(src.iter_full())  # a second pass on the same source
    # The byte budget of what rank 0 posts ahead (megatron/ahead.py): 1 byte = one unit ahead.
    src = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16, overlap=True, ahead_bytes=1)
    facts["dense_one"] = _cpu(src.iter_full())
    facts["dense_one_stats"] = src.last_pass.as_dict()
    facts["max_unit_bytes"] = max(src._unit_bytes(u) for u in src.plan)
    facts["budget"] = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16, overlap=True).ahead_bytes
    hf = _hf_config("qwen3_moe", layers=2, experts=4, hidden=16, moe_ffn=12, shared=None)
    init_parallel(tp=2, ep=2)
    moe = build_gpt(hf, moe_config(hf, tp=2, ep=2))
    for label, on in (("on", True), ("off", False)):
        src = MegatronSource(moe, hf_config=hf, overlap=on)
        facts[f"moe_{label}"] = _cpu(src.iter_full())
        facts[f"moe_{label}_stats"] = src.last_pass.as_dict()
    return pack(facts)


def test_megatron_overlap_same_stream_collectives_and_bound():
    """Overlap on: the same tensors, bytes and collectives as off, on every rank; rank 0 receives the
    next units while the consumer holds this one (ahead_peak_bytes > 0), as far as the byte budget
    ``ahead_bytes`` (plus one unit) goes, one unit at a budget of 1 byte; peers still have one cast
    piece out at a time; a second pass on the same source equals the first (nothing left posted)."""
    res = unpack(run_world(world_megatron_overlap, 4, timeout=500))
    f0 = res[0]
    assert f0["dense_on"] and _bytes_equal(f0["dense_on"], f0["dense_off"])
    assert _bytes_equal(f0["dense_on_again"], f0["dense_off"])
    assert f0["moe_on"] and _bytes_equal(f0["moe_on"], f0["moe_off"])
    for r, f in res.items():
        for kind in ("dense", "moe"):
            on, off = f[f"{kind}_on_stats"], f[f"{kind}_off_stats"]
            assert on["collectives"] == off["collectives"] and on["bytes_received"] == off["bytes_received"], (r, kind)
            assert off["ahead_peak_bytes"] == 0, (r, kind)
        if r:
            assert f["dense_on"] == [] and f["moe_on"] == []
    assert f0["dense_on_stats"]["ahead_peak_bytes"] > 0  # rank 0 had a transfer in flight ahead
    # The lookahead's byte budget: one unit ahead at a budget of 1 byte; more under the default,
    # never more than the budget + one unit (received pieces: half of each TP-split unit or less).
    assert _bytes_equal(f0["dense_one"], f0["dense_off"])
    one, deep = f0["dense_one_stats"]["ahead_peak_bytes"], f0["dense_on_stats"]["ahead_peak_bytes"]
    assert 0 < one <= f0["max_unit_bytes"] < deep <= f0["budget"] + f0["max_unit_bytes"], (one, deep)
    assert f0["dense_one_stats"]["collectives"] == f0["dense_off_stats"]["collectives"]
    for r in (1, 2, 3):  # a peer sends one cast piece at a time, overlap or not
        assert res[r]["dense_on_stats"]["peak_extra_bytes"] <= res[r]["max_piece_bytes"], r
        assert res[r]["dense_on_stats"]["ahead_peak_bytes"] == 0, r


def test_megatron_lookahead_budget_follows_the_cores(monkeypatch):
    """``MegatronSource(ahead_bytes=None)`` posts up to 128 MiB ahead where each local rank has 4 cores
    or more, 64 MiB otherwise (more in flight only helps where gloo and the helper have cores of their
    own: ``megatron/ahead.py``); a bad budget is refused naming the parameter."""
    from weightsync.sources import MegatronSource
    from weightsync.sources.megatron import ahead

    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ahead.cores_per_local_rank() == 8 and ahead.default_ahead_bytes() == 128 << 20
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ahead.cores_per_local_rank() == 2 and ahead.default_ahead_bytes() == 64 << 20
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ahead_bytes="):
            MegatronSource(None, hf_config=None, ahead_bytes=bad)
