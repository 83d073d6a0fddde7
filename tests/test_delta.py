"""``DeltaSource`` on 2 gloo ranks: a receiver fed only delta rounds equals a dense pass of the same
source bitwise after every round, each round carries exactly the elements whose wire bytes changed,
a no-change round sends nothing, a stopped round is followed by an anchor, a NaN raises on every rank
naming the tensor, and vLLM's own ``load_checkpoint_weight_patches`` applies ``iter_patches`` on CPU.

The oracle of "changed" is the source's own dense ``iter_full`` before and after each round (itself
proven against ``save_pretrained`` in test_fsdp / test_moe_fsdp); the receiver never sees a dense pass.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from worlds import run_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp():
    from delta_worlds import world_fsdp

    return run_world(world_fsdp, 2, timeout=400)


@pytest.fixture(scope="module")
def fsdp_kernels(tmp_path_factory):
    """The same world with the CUDA diff kernels (``diff_triton``) run by Triton's CPU interpreter.

    In a fresh interpreter: Triton decides interpreted vs compiled when it is first imported, and this
    process's forkserver imported it already."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("kernels") / "facts.pkl"
    code = ("import pickle, sys; from worlds import run_world; from delta_worlds import world_fsdp; "
            f"pickle.dump(run_world(world_fsdp, 2, timeout=400), open({str(out)!r}, 'wb'))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def generic():
    from delta_worlds import world_generic

    return run_world(world_generic, 2, timeout=400)


def _by(facts):
    return {f["label"]: f for f in facts}


def test_receiver_equals_dense_after_every_round(fsdp):
    for key in ("dense_facts", "moe_facts"):
        for f in fsdp[0][key]:
            if "mismatch" in f:
                assert f["mismatch"] == [], (key, f["label"], f["mismatch"][:5])


def test_each_round_carries_exactly_the_changed_elements(fsdp):
    facts = _by(fsdp[0]["dense_facts"])
    for label in ("delta", "patches"):
        f = facts[label]
        assert f["minimal"], label
        assert 0 < f["stats"]["changed"] == f["changed_oracle"], label
        assert not f["stats"]["anchor"], label
        # int32 index + bf16 value per changed element: 6 bytes each, nothing else
        assert f["wire_bytes"] == 6 * f["changed_oracle"], label
        assert f["stats"]["collective_bytes"] < f["stats"]["dense_bytes"] / 2, label
    for f in fsdp[0]["moe_facts"]:
        assert f["minimal"], f["label"]


def test_triton_kernels_find_exactly_what_torch_finds(fsdp, fsdp_kernels):
    """The kernel path (``diff_triton``, interpreted on CPU) gives every round the receiver bytes and
    the minimal patch set the torch path gives; its counts equal the torch world's, element for
    element, and it really ran (``kernel_buckets``)."""
    for key in ("dense_facts", "moe_facts"):
        kern_facts, torch_facts = fsdp_kernels[0][key], fsdp[0][key]
        for a, b in zip(kern_facts, torch_facts):
            if "mismatch" in a:
                assert a["mismatch"] == [], (key, a["label"], a["mismatch"][:5])
            assert a.get("minimal", True), (key, a["label"])
            assert a["stats"]["changed"] == b["stats"]["changed"], (key, a["label"])
            assert a["stats"]["wire_bytes"] == b["stats"]["wire_bytes"], (key, a["label"])
            assert b["stats"]["kernel_buckets"] == 0, "the default CPU run uses the torch ops"
    used = [f["stats"]["kernel_buckets"] for f in fsdp_kernels[0]["dense_facts"]
            if not f["stats"]["anchor"] and f["stats"]["changed"]]
    assert used and all(n > 0 for n in used), used


def test_no_change_round_sends_nothing(fsdp):
    f = _by(fsdp[0]["dense_facts"])["no change"]
    assert f["yielded"] == 0 and f["stats"]["changed"] == 0 and f["wire_bytes"] == 0
    assert f["stats"]["tensors"] == 0


def test_anchors(fsdp):
    facts = _by(fsdp[0]["dense_facts"])
    first = facts["anchor"]
    assert first["stats"]["anchor"] and first["stats"]["changed"] == first["stats"]["elements"]
    assert first["minimal"] and first["mismatch"] == []
    # a round stopped after two tensors on every rank: the next one is an anchor and repairs the receiver
    assert facts["stopped"]["yielded"] == 2 and not facts["stopped"]["stats"]["completed"]
    assert facts["after stop"]["stats"]["anchor"] and facts["after stop"]["mismatch"] == []
    assert facts["after reset"]["stats"]["anchor"]
    assert not facts["delta"]["stats"]["anchor"]
    moe = _by(fsdp[0]["moe_facts"])
    assert [moe[k]["stats"]["anchor"] for k in ("anchor", "delta", "delta 2", "anchor_every")] == [True, False, False, True]
    # every rank saw the same decisions
    for r in (0, 1):
        assert [f["stats"]["anchor"] for f in fsdp[r]["dense_facts"]] == [f["stats"]["anchor"] for f in fsdp[0]["dense_facts"]]


def test_whole_when_cheaper(fsdp):
    f = _by(fsdp[0]["dense_facts"])["whole ok"]
    assert f["whole"] == ["model.layers.0.self_attn.q_norm.weight"]
    assert f["mismatch"] == [] and f["minimal"]  # every element of it changed: whole costs 2 bytes each, not 6
    assert f["wire_bytes"] < 6 * f["changed_oracle"]


def test_nan_raises_on_every_rank_naming_the_tensor(fsdp):
    for r in (0, 1):
        err = fsdp[r]["nan_error"]
        assert err is not None and "DeltaError" in err and "model.layers.1.mlp.up_proj.weight" in err, err
        assert "rank 1" in err
        assert fsdp[r]["anchor_after_nan"]
    after = _by(fsdp[0]["dense_facts"])["after nan"]  # the failed round is followed by an anchor
    assert after["stats"]["anchor"] and after["mismatch"] == []


def test_vllm_apply_path(fsdp):
    f = _by(fsdp[0]["dense_facts"])["patches"]
    assert f["mismatch"] == [] and f["yielded"] > 0


def test_snapshot_memory_is_the_shard_in_the_wire_dtype(fsdp):
    for r in (0, 1):
        assert fsdp[r]["snapshot_bytes"] == fsdp[r]["shard_bytes"]


def test_moe_experts_go_per_expert(fsdp):
    names = fsdp[0]["moe_names"]
    assert any(".mlp.experts.0.down_proj.weight" in n for n in names), names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_sources_without_pieces(generic):
    for key in ("module_facts", "fp8_facts", "safetensors_facts"):
        for f in generic[0][key]:
            assert f["mismatch"] == [], (key, f["label"], f["mismatch"][:5])
            assert f["minimal"], (key, f["label"])
    assert "DeltaError" in generic[0]["swap_error"] and "differ" in generic[0]["swap_error"]
    assert not _by(generic[0]["safetensors_facts"])["delta"]["stats"]["anchor"]
    mod = _by(generic[0]["module_facts"])
    assert mod["no change"]["yielded"] == 0
    assert 0 < mod["delta"]["stats"]["changed"] < mod["delta"]["stats"]["elements"] / 10


def test_replicas_and_gathered_fallbacks(fsdp):
    """HSDP answers from one replica (rank 1 sends nothing); experts sharded on dim 1 and LoRA-merged
    bases are gathered and diffed on rank 0: still exact and minimal."""
    for label, case in fsdp[0]["fallbacks"].items():
        for f in case["facts"]:
            assert f["mismatch"] == [] and f["minimal"], (label, f["label"], f["mismatch"][:3])
        assert case["facts"][1]["stats"]["changed"] > 0, label
    hsdp = fsdp[1]["fallbacks"]["hsdp"]  # rank 1's only traffic: its counts rows (40 bytes per tensor)
    assert hsdp["sent"] == 40 * hsdp["tensors"]
    lora = fsdp[0]["fallbacks"]["lora"]["facts"][1]
    assert lora["stats"]["tensors"] == 4  # q_proj and down_proj of 2 layers: only the merged bases moved


def test_pieces_that_do_not_fit_raise_on_every_rank():
    from delta_worlds import world_bad_pieces

    res = run_world(world_bad_pieces, 2, timeout=200)
    for r in (0, 1):
        assert res[r]["ok"] is None and res[r]["ok_equal"] == []
        assert "'a'" in res[r]["gap"] and "cover 12 elements" in res[r]["gap"], res[r]["gap"]
        assert "rank 1 yielded a piece that does not fit" in res[r]["outside"], res[r]["outside"]
        assert "rank 1 yielded a piece that does not fit" in res[r]["order"], res[r]["order"]
    assert "outside" in res[1]["outside"] and "out of metadata order" in res[1]["order"]


def test_refusals_at_construction():
    """Before any byte: a tensor of 2^31 elements (int32 indices), a non-floating tensor for vLLM's
    sparse apply, a DeltaSource over a DeltaSource, bad arguments."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from weightsync.sources import DeltaError, DeltaSource

    class Meta(WeightSource):
        def __init__(self, metas):
            self._metas = metas

        @cached_property
        def metadata(self):
            return self._metas

    with pytest.raises(DeltaError, match=r"'big'.*2147483648 elements.*int32"):
        DeltaSource(Meta([ParamMeta("ok", torch.bfloat16, (4,)), ParamMeta("big", torch.bfloat16, (1 << 16, 1 << 15))]))
    ints = DeltaSource(Meta([ParamMeta("steps", torch.int64, (1,))]))
    with pytest.raises(DeltaError, match="'steps' is not floating point"):
        next(ints.iter_patches())
    ok = DeltaSource(Meta([ParamMeta("w", torch.float32, (2,))]))
    with pytest.raises(TypeError, match="already a DeltaSource"):
        DeltaSource(ok)
    for kw in ({"anchor_every": 0}, {"group_bytes": 0}, {"snapshot": "disk"}):
        with pytest.raises(ValueError):
            DeltaSource(Meta([ParamMeta("w", torch.float32, (2,))]), **kw)


def test_group_diff_equals_piece_by_piece():
    """``Snapshots.diff_group`` (one flat compare per group and wire dtype) finds exactly what diffing
    each piece alone finds -- positions and value bytes --, across mixed wire dtypes, boxes that are
    views, fp32 pieces cast to bf16, a layout change (no snapshot: every element) and commits."""
    from weightsync.sources.core.layouts.pieces import Piece
    from weightsync.sources.delta.diff import Snapshots

    torch.manual_seed(0)
    base = torch.randn(40, 24)
    tensors = [base[:10], base[10:], torch.randn(7, 5), torch.randn(3), torch.randn(5, 6, 4)]
    wire = [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]

    def pieces():
        return [Piece(f"t{i}", (0,) * t.dim(), t) for i, t in enumerate(tensors)]

    one, grouped = Snapshots(), Snapshots()
    for rnd in range(4):
        ps = pieces()
        first = rnd == 0
        a = [one.diff(p, dt, everything=first) for p, dt in zip(ps, wire)]
        b = grouped.diff_group(0, list(zip(ps, wire)), everything=first)
        for x, y in zip(a, b):
            assert (x.pos is None) == (y.pos is None)
            if x.pos is not None:
                assert torch.equal(x.pos, y.pos)
            assert x.values.dtype == y.values.dtype
            assert torch.equal(x.values.view(-1).view(torch.uint8), y.values.view(-1).view(torch.uint8))
        for x in a:
            one.commit(x)
        grouped.commit_group()
        assert one.nbytes == grouped.nbytes
        with torch.no_grad():
            for t in tensors:
                t.add_((torch.rand(t.shape) < 0.3).to(t.dtype) * 0.5)
    tensors[2] = torch.randn(5, 7)  # another shape: that bucket has no snapshot, every element again
    b = grouped.diff_group(0, list(zip(pieces(), wire)), everything=False)
    assert b[2].pos is None and b[3].pos is None and b[0].pos is not None


def test_groups_agree_when_ranks_disagree_on_cuda():
    """``group_bytes=None``: rank 0 decides (its CUDA or not), every rank uses it from the first round;
    the rounds are exact; explicit values that differ are refused on every rank, by name."""
    from delta_worlds import world_group_agreement
    from weightsync.sources.delta.source import DEFAULT_CUDA_GROUP_BYTES, DEFAULT_GROUP_BYTES

    res = run_world(world_group_agreement, 2, timeout=300)
    for cuda_rank, want in ((1, DEFAULT_GROUP_BYTES), (0, DEFAULT_CUDA_GROUP_BYTES)):
        f0, f1 = res[0][f"cuda_on_{cuda_rank}"], res[1][f"cuda_on_{cuda_rank}"]
        own = {cuda_rank: DEFAULT_CUDA_GROUP_BYTES, 1 - cuda_rank: DEFAULT_GROUP_BYTES}
        assert (f0["before"], f1["before"]) == (own[0], own[1])  # each rank's own default, before
        assert f0["after"] == f1["after"] == want
        assert f0["all"][0] == f0["all"][1]  # the same size and the same groups
        assert f0["equal"] == [] and f0["carried"] == [("a", 6)]
    for r in (0, 1):
        err = res[r]["explicit_mismatch"]
        assert err and "DeltaError" in err and "group_bytes=16384" in err and f"rank {r}:" in err, err
        assert res[r]["explicit_same"] is None, res[r]["explicit_same"]
