"""Who releases a gather's buffers when an FSDP pass stops early, and when (``prefetch.GatherPipeline.close``).

The interleaving forced here, on a 2-rank gloo world with overlap on (CPU: one helper thread):
gather ``G1`` is posted ahead and its first tensor queued on the helper thread as an early unpack
(which waits for ``G1``'s collective); the pass then takes ``G1`` (``take``) and, before iterating it,
posting the next gather ``G2`` raises (the same on both ranks: a post refused). The early unpack is
held on purpose until it is told to stop. What must hold, and what a user notices otherwise:

* the pass raises the post's error promptly -- not after the early unpack's own bound (the source's
  ``timeout_s``), which is how long closing the pass waited for a helper job nobody stopped;
* every gather that was posted is released exactly once (its buffers back to the pass's pool),
  and never while a helper job of that gather (pack, unpack, early unpack) is still running -- the
  ownership that a helper thread still packing or unpacking while a drain releases its buffer would
  break (the double free seen once in ``test_delta_sync_fsdp_loopback``);
* the next pass on the same source is exact on both ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fsdp_worlds import pack, shard, tiny_model, unpack
from worlds import run_world

pytestmark = pytest.mark.slow

SOURCE_TIMEOUT_S = 40.0


class PostRefused(RuntimeError):
    pass


def world_taken_gather_never_iterated(rank: int, world_size: int) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import FSDPSource
    from weightsync.sources.fsdp import gather as gather_mod

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_model("qwen3", tied=False, seed=1, layers=4)
    shard(model, mesh)
    ref = [(n, t.clone()) for n, t in FSDPSource(model, dtype=torch.bfloat16, overlap=False).iter_full()]

    BG = gather_mod.BatchedGather
    lock = threading.Lock()
    running: dict[int, int] = {}  # id(gather) -> helper jobs of it running now
    posted: list[int] = []
    released: list[tuple[int, int]] = []  # (id(gather), helper jobs of it running at the release)
    early_seen = threading.Event()
    plan = {"posts": 0, "refuse_at": None, "hold": False}
    orig = {k: getattr(BG, k) for k in ("_pack", "_unpack", "_unpack_when_done", "post", "_release")}

    def on_helper(name):
        def job(self, *a, **k):
            if threading.current_thread() is threading.main_thread():
                return orig[name](self, *a, **k)
            with lock:
                running[id(self)] = running.get(id(self), 0) + 1
            try:
                if name == "_unpack_when_done" and plan["hold"]:
                    early_seen.set()
                    stop = a[2]
                    t0 = time.monotonic()  # held: the early unpack still waits when the pass stops
                    while not stop.is_set() and time.monotonic() - t0 < SOURCE_TIMEOUT_S:
                        time.sleep(0.005)
                return orig[name](self, *a, **k)
            finally:
                with lock:
                    running[id(self)] -= 1
        return job

    def post(self):
        if self._state == "new":
            plan["posts"] += 1
            if plan["refuse_at"] is not None and plan["posts"] == plan["refuse_at"]:
                raise PostRefused(f"rank {rank}: injected: post {plan['posts']} refused")
            out = orig["post"](self)
            posted.append(id(self))
            return out
        return orig["post"](self)

    def release(self):
        if self._state in ("posted", "done"):
            with lock:
                released.append((id(self), running.get(id(self), 0)))
        return orig["_release"](self)

    facts: dict = {}
    try:
        for name in ("_pack", "_unpack", "_unpack_when_done"):
            setattr(BG, name, on_helper(name))
        BG.post, BG._release = post, release
        gather_mod._HANDOFF_BYTES = 0  # every tensor worth the helper: G1's first one is unpacked early
        source = FSDPSource(model, dtype=torch.bfloat16, overlap=True, group_bytes=4096, timeout_s=SOURCE_TIMEOUT_S)
        # post 1: G0 (taken at its step), post 2: G1 (ahead), post 3: G2 (ahead, right after take(G1))
        plan["refuse_at"], plan["hold"] = 3, True
        t0 = time.monotonic()
        try:
            for _ in source.iter_full():
                pass
            facts["error"] = None
        except PostRefused as e:
            facts["error"] = str(e)
        facts["seconds"] = time.monotonic() - t0
        facts["early_seen"] = early_seen.is_set()
        facts["posted"] = list(posted)
        facts["released"] = list(released)
        plan["refuse_at"], plan["hold"] = None, False
        got = [(n, t.clone()) for n, t in source.iter_full()]
        facts["next_pass_exact"] = [n for n, _ in got] == [n for n, _ in ref] and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for (_, a), (_, b) in zip(got, ref))
    finally:
        for name, fn in orig.items():
            setattr(BG, name, fn)
    return pack(facts)


@pytest.fixture(scope="module")
def taken_world():
    return unpack(run_world(world_taken_gather_never_iterated, 2, timeout=300))


def test_a_pass_stopped_between_take_and_iteration_ends_promptly(taken_world):
    for rank, f in taken_world.items():
        assert f["error"] and "post 3 refused" in f["error"], (rank, f["error"])
        assert f["early_seen"], rank  # the interleaving happened: an early unpack was waiting
        assert f["seconds"] < SOURCE_TIMEOUT_S / 4, (rank, f["seconds"])


def test_every_posted_gather_is_released_once_and_never_under_the_helper(taken_world):
    for rank, f in taken_world.items():
        ids = [g for g, _ in f["released"]]
        assert sorted(ids) == sorted(f["posted"]) and len(set(ids)) == len(ids), (rank, f["posted"], f["released"])
        assert [g for g, busy in f["released"] if busy] == [], (rank, f["released"])


def test_the_next_pass_is_exact(taken_world):
    assert all(f["next_pass_exact"] for f in taken_world.values())
