"""MegatronSource's point-to-point transfers are bounded on gloo: a TP peer that stops taking part
in a pass (here: it never starts its second pass) makes rank 0 raise ``SyncTimeoutError`` naming
that rank and the parameter it was receiving, within ``timeout_s`` -- not a hang until the process
group's own timeout (the world below is created with 120 s)."""

from __future__ import annotations

import time

import pytest
import torch

import megatron_worlds as mw
from worlds import run_world, tell_peers, wait_for_peers

pytestmark = pytest.mark.slow


def _second_pass(src) -> dict:
    """One more pass: the ``SyncTimeoutError`` it raised (or None) and how long it took."""
    from weightsync.sources import SyncTimeoutError

    t0 = time.monotonic()
    try:
        sum(1 for _ in src.iter_full())
    except SyncTimeoutError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def _rank_peer_stops(rank, world_size):
    from weightsync.sources import MegatronSource

    cfg = mw.hf_config("qwen3", layers=2)
    mw.init_parallel(2, 1)
    src = MegatronSource(mw.megatron_model(cfg), hf_config=cfg, timeout_s=3.0)
    torch.distributed.barrier()  # both start the healthy pass together: only its own waits count
    first = sum(1 for _ in src.iter_full())  # a whole pass on both ranks: agreement done
    if rank == 1:
        wait_for_peers("rank 0 left its second pass")  # never joins it; leaves once rank 0 raised
        return {"first": first}
    out = {"first": first, **_second_pass(src)}
    tell_peers("rank 0 left its second pass")
    return out


def test_tp_peer_that_stops_is_named_within_the_bound():
    res = run_world(_rank_peer_stops, 2, timeout=240)
    assert res[0]["first"] > 0 and res[1]["first"] == 0  # full mode: only rank 0 yields
    err = res[0]["error"]
    assert err is not None, "rank 0 completed a pass its TP peer never joined"
    # The second pass's first transfer is the TP-sharded embedding, which rank 1 never sends.
    assert "rank 1" in err and "'model.embed_tokens.weight'" in err and "within 3s" in err, err
    assert res[0]["seconds"] >= 2.5, res[0]["seconds"]  # it waited out its bound (named above)


def _rank_ep_peer_stops(rank, world_size):
    """EP4, one expert per rank (MoE path: ``MegatronMoEExporter``): rank 3 never joins the second pass."""
    from moe_megatron import build_gpt, init_parallel, moe_config
    from test_moe_megatron import _hf_config

    from weightsync.sources import MegatronSource

    init_parallel(ep=world_size)
    hf = _hf_config("qwen3_moe", layers=2, experts=world_size, hidden=16, moe_ffn=12, shared=None)
    model = build_gpt(hf, moe_config(hf, ep=world_size))
    src = MegatronSource(model, hf_config=hf, timeout_s=3.0)
    torch.distributed.barrier()  # every rank starts the healthy pass together
    first = sum(1 for _ in src.iter_full())  # a whole pass on every rank: agreement done
    if rank == world_size - 1:
        # never joins the second pass; leaves once every other rank has left its own
        wait_for_peers(*(f"rank {r} left its second pass" for r in range(world_size - 1)))
        return {"first": first}
    out = {"first": first, **_second_pass(src)}
    tell_peers(f"rank {rank} left its second pass")
    return out


def test_ep_peer_that_stops_makes_every_rank_raise_within_the_bound():
    res = run_world(_rank_ep_peer_stops, 4, timeout=240)
    assert res[0]["first"] > 0 and all(res[r]["first"] == 0 for r in (1, 2, 3))
    # rank 0 waits on rank 3's expert: it names rank 3 and the layer's experts
    err = res[0]["error"]
    assert err is not None, "rank 0 completed a pass its EP peer never joined"
    assert "rank 3" in err and "layer 0's experts" in err and "within 3s" in err, err
    assert res[0]["seconds"] >= 2.5, res[0]["seconds"]
    # the live EP peers' next sends to rank 0 (which left the pass) are bounded too
    for r in (1, 2):
        err = res[r]["error"]
        assert err is not None, f"rank {r} completed a pass whose receiver left"
        assert f"rank {r}" in err and "to rank 0" in err and "within 3s" in err, err
