"""``MegatronSource.iter_pieces`` (``sources/megatron/pieces.py``, ``Layout.boxes``) against the same
source's ``iter_full`` -- itself proven against megatron-core's ``dist_checkpointing`` elsewhere.

In each world every rank runs ``iter_pieces`` twice and sends its first pass's pieces to rank 0,
which places them into full tensors and checks: every element of every metadata tensor covered
exactly once (no replica answers twice, nothing left out, no box out of bounds), the assembled
tensors byte-equal to ``iter_full`` in the declared wire dtype, each rank's pieces in metadata order
(every name once, as its pieces or one marker), the second pass the same boxes and values with no communication (the
fallback layout excepted), the model unchanged. Layouts: TP2 dense with a vocabulary whose padding
is not ``torch.chunk``-aligned (250 -> 256: 128 + 122 rows), bf16 wire; PP2 x VPP2 with tied
embeddings; EP2 (TP1, so dense DP2) per_expert and fused; TP2 x EP2 x ETP1 with a shared expert and
its gate; Qwen3-Next and Qwen3.5 (gated delta net: chunked and block-per-TP-rank in-projections,
conv1d, shifted norms, gated attention) at TP2, Qwen3.5 also through the gather fallback; DeepSeek-V3
(MLA, ETP2 experts, expert bias) and DeepSeek-V3.2 (DSA indexer rows) at TP2; GPT-OSS (sinks,
router bias, transposed gate/up-interleaved biased experts) at TP2; 4 ranks: TP2 x EP2 x ETP2
(sequential and legacy grouped experts), TP2 x DP2, Mixtral PP2 x EP2, DeepSeek-V3 TP2 x EP2 x ETP1
with a dense first layer, shared experts and the expert bias. The layout kinds' boxes are also checked in one process, against ``concat``.

Then, per layout and variant, ``DeltaSource`` rounds over that source (``delta_rounds``): a receiver
on rank 0 fed only the rounds equals ``iter_full`` bitwise after every round, each round carries
exactly the elements whose wire bytes changed between the dense passes before and after (noise on
~2% of some parameters' elements, some of it too small for a bf16 wire, and a whole small tensor),
an anchor carries everything and a round without change carries nothing -- the gather fallback
included, whose point-to-point transfers run between ``DeltaSource``'s own exchanges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from fsdp_worlds import pack, unpack
from worlds import run_world as _run_world

pytestmark = pytest.mark.slow


def run_world(*a, **k):
    return unpack(_run_world(*a, **k))


# ---- Layout.boxes against concat, one process -------------------------------------------------------


def _kinds():
    """``(kind, full HF shapes, geometry)`` for every layout kind of ``core/layouts/tp.py``."""
    from weightsync.sources.core.layouts import tp as L

    gdn = dict(gdn_heads=(2, 4, 4, 2))  # key heads 2 x 4, value heads 4 x 2
    return [
        (L.REPLICATED, ((6,),), {}),
        (L.COLUMN, ((8, 3),), {}),
        (L.ROW, ((3, 8),), {}),
        (L.QKV_LAYOUT, ((8, 3), (4, 3), (4, 3)), dict(heads_per_group=2, head_dim=2)),
        (L.GLU_LAYOUT, ((6, 3), (6, 3)), {}),
        (L.STACK, ((3, 4), (5, 4)), {}),
        (L.STACK_COLUMN, ((4, 4), (6, 4)), {}),
        (L.QKV_GATED, ((16, 3), (4, 3), (4, 3)), dict(heads_per_group=2, head_dim=2)),
        (L.GDN_QKVZ_BA, ((2 * 8 + 2 * 8, 3), (8, 3)), gdn),
        (L.GDN_QKV_Z_B_A, ((2 * 8 + 8, 3), (8, 3), (4, 3), (4, 3)), gdn),
        (L.GDN_CONV, ((2 * 8 + 8, 1, 4),), gdn),
        (L.SHIFTED_PLUS_ONE, ((6,),), {}),
        (L.INDEXER_ROPE_HALF, ((8, 3),), dict(indexer_rope=(4, 2))),
        (L.INDEXER_ROPE_INTERLEAVED, ((8, 3),), dict(indexer_rope=(4, 2))),
    ]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_boxes_tile_what_concat_builds(tp):
    """For every kind: the boxes of TP shards 0..tp-1 (of TP rank 0 only for a kind every rank holds
    whole) cover each HF tensor exactly once with the values ``concat`` of all shards puts there;
    the vocabulary's trimmed rows (250 of 256 padded) sit at ``vocab_rows``."""
    from weightsync.sources.core.layouts.rows import vocab_rows
    from weightsync.sources.core.layouts.tp import KINDS, VOCAB

    covered = set()
    for kind, full, geo in _kinds():
        geo = {**geo, "stack_rows": tuple(s[0] for s in full)}
        if tp > 2 and (kind.dim == 0 and kind != "column"):
            continue  # 2 query groups / key heads / GLU rows of 3: a TP size of 2 at most
        g = torch.Generator().manual_seed(tp)
        shape = kind.shard_shape(full, tp)
        shards = [torch.randn(shape, generator=g) for _ in range(tp if kind.dim is not None else 1)]
        want = kind.concat(shards, **geo)
        got = [torch.full(s, float("nan")) for s in full]
        count = [torch.zeros(s, dtype=torch.int32) for s in full]
        for r, shard in enumerate(shards):
            for box in kind.boxes(shard, full=full, tp=tp, tp_rank=r, **geo):
                sl = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.tensor.shape))
                got[box.index][sl] = box.tensor
                count[box.index][sl] += 1
        for i in range(len(full)):
            assert bool((count[i] == 1).all()), (kind, tp, i)
            assert torch.equal(got[i], want[i]), (kind, tp, i)
        covered.add(str(kind))
    # the vocabulary: 250 rows padded to 256, not torch.chunk's 125 per rank at tp=2
    vocab, padded = 250, 256
    weight = torch.randn(padded, 3)
    got = torch.full((vocab, 3), float("nan"))
    count = torch.zeros(vocab, dtype=torch.int32)
    for r in range(tp):
        shard = weight[r * padded // tp : (r + 1) * padded // tp]
        for box in VOCAB.boxes(shard, full=((vocab, 3),), tp=tp, tp_rank=r, padded_vocab=padded):
            assert box.offsets == (vocab_rows(vocab, padded, tp, r)[0], 0)
            got[box.offsets[0] : box.offsets[0] + box.tensor.shape[0]] = box.tensor
            count[box.offsets[0] : box.offsets[0] + box.tensor.shape[0]] += 1
    assert bool((count == 1).all()) and torch.equal(got, weight[:vocab]), tp
    covered.add("vocab")
    if tp == 2:
        assert covered == set(KINDS), sorted(set(KINDS) - covered)


def test_layout_boxes_refuse_a_piece_that_is_not_its_chunk():
    """A shard whose split does not have the torch.chunk shape of its rank raises naming the kind."""
    from weightsync.sources.core.layouts.tp import COLUMN

    with pytest.raises(ValueError, match="column: TP shard 1 of 2"):
        COLUMN.boxes(torch.zeros(3, 2), full=((8, 2),), tp=2, tp_rank=1)


# ---- the worlds ----------------------------------------------------------------------------------


def _make(lay: dict):
    """This rank's chunks and the transformers config of one layout, from the one builder."""
    import mla_models as mm

    from weightsync.plugins.testbed.megatron import MegatronParallel

    par = MegatronParallel(tp=lay.get("tp", 1), pp=lay.get("pp", 1), vpp=lay.get("vpp"), ep=lay.get("ep", 1))
    build = lay["build"]
    if build == "dense":
        import megatron_worlds as mw

        hf = mw.hf_config(lay["family"], vocab=lay.get("vocab", 250), tied=lay.get("tied", False))
        return mm.build_megatron(hf, par), hf
    if build == "moe":  # test_moe_megatron's scenarios: ETP chosen, every tensor random per rank
        from moe_megatron import build_gpt, init_parallel, moe_config
        from test_moe_megatron import _hf_config, _knobs

        kw = lay["hf"]
        hf = _hf_config(lay["family"], **kw)
        init_parallel(tp=par.tp, pp=par.pp, ep=par.ep, etp=lay.get("etp"))
        mcfg = moe_config(hf, tp=par.tp, pp=par.pp, ep=par.ep, etp=lay.get("etp"),
                          expert_format=lay.get("fmt", "sequential"),
                          **_knobs(kw.get("shared"), lay.get("shared_gate", False), lay.get("expert_bias", False)))
        return [build_gpt(hf, mcfg, expert_format=lay.get("fmt", "sequential"))], hf
    if build == "next":
        import test_qwen3_next as qn

        hf = qn.hf_config(lay["preset"])
        return qn._build(hf, par, {}), hf
    if build == "dsa":
        import test_dsa

        hf = test_dsa._hf_of({})
        return test_dsa._build(hf, par, {}), hf
    if build == "mla":
        hf = mm.hf_config("q_lora")
        return mm.build_megatron(hf, par), hf
    if build == "gpt_oss":
        from test_gpt_oss import hf_config

        hf = hf_config()
        return mm.build_megatron(hf, par), hf
    raise ValueError(build)


def _pass(src) -> list[tuple[str, tuple[int, ...], torch.Tensor | None]]:
    """One ``iter_pieces`` pass, each piece copied as it comes (a piece may alias the model);
    markers as ``tensor`` None."""
    return [(p.name, tuple(p.offsets), None if p.tensor is None else p.tensor.detach().clone())
            for p in src.iter_pieces()]


def _order_problems(items: list[tuple], meta_names: list[str]) -> list[str]:
    """Every metadata name passed exactly once, in metadata order, as pieces or one marker alone."""
    names = [n for n, _, _ in items]
    runs = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    bad = [] if runs == meta_names else [f"names {runs[:3]}.. are not metadata's {meta_names[:3]}.. in order"]
    by_name: dict[str, list] = {}
    for n, _, t in items:
        by_name.setdefault(n, []).append(t)
    bad += [f"{n}: a marker among pieces" for n, ts in by_name.items() if len(ts) > 1 and any(t is None for t in ts)]
    return bad


def assemble(metadata, everyone: list[list]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Full tensors from every rank's pieces, and what is wrong with them: a dtype other than the
    declared one, a box out of bounds, an element covered twice or never."""
    meta = {m.name: m for m in metadata}
    got: dict[str, torch.Tensor] = {n: torch.zeros(tuple(m.shape), dtype=m.dtype) for n, m in meta.items()}
    count = {n: torch.zeros(tuple(m.shape), dtype=torch.int32) for n, m in meta.items()}
    bad: list[str] = []
    for r, pieces in enumerate(everyone):
        for name, off, t in pieces:
            if t is None:
                continue  # a marker
            m = meta.get(name)
            if m is None:
                bad.append(f"rank {r}: {name} is not in metadata")
                continue
            if t.dtype != m.dtype and not (t.dtype.is_floating_point and m.dtype.is_floating_point):
                bad.append(f"rank {r}: {name} piece in {t.dtype}, declared {m.dtype}")  # (the consumer casts floats)
            if len(off) != len(m.shape) or t.dim() != len(m.shape) or any(
                o < 0 or o + n > s for o, n, s in zip(off, t.shape, m.shape)
            ):
                bad.append(f"rank {r}: {name} box {off} + {tuple(t.shape)} outside {tuple(m.shape)}")
                continue
            sl = tuple(slice(o, o + n) for o, n in zip(off, t.shape))
            got[name][sl] = t.to(m.dtype)
            count[name][sl] += 1
    for n, c in count.items():
        if not bool((c == 1).all()):
            bad.append(f"{n}: {int((c == 0).sum())} elements missed, {int((c > 1).sum())} covered twice")
    return got, bad


def check_source(src, rank: int, world_size: int, *, fallback: bool = False) -> dict:
    """The checks of the module docstring on one source; rank 0's result says what is wrong."""
    import torch.distributed as dist
    from family_worlds import same_bytes
    from megatron_worlds import count_comm

    full = {n: t.clone() for n, t in src.iter_full()}
    first = _pass(src)
    with count_comm() as comm:
        second = _pass(src)
    wire = {m.name: m.dtype for m in src.metadata}

    def boxes(items):
        return [(n, o, None if t is None else tuple(t.shape)) for n, o, t in items]

    f: dict = {
        "order": _order_problems(first, [m.name for m in src.metadata]),
        "boxes_again": boxes(second) == boxes(first),
        "values_again": all(a[2] is None or torch.equal(a[2], b[2]) for a, b in zip(first, second)),
        "comm": dict(comm),
        "pieces": sum(t is not None for _, _, t in first),
        # pieces in the parameter's own floating dtype (their consumer casts), by name
        "uncast": sorted({n for n, _, t in first if t is not None and t.dtype != wire[n]}),
    }
    everyone = [None] * world_size if rank == 0 else None
    dist.gather_object(first, everyone, dst=0)
    if rank == 0:
        got, bad = assemble(src.metadata, everyone)
        if list(full) != [m.name for m in src.metadata]:
            bad.append("iter_full's names are not metadata's")
        bad += [f"{n}: assembled pieces != iter_full" for n, t in full.items() if not same_bytes(got[n], t)]
        f["bad"] = bad
        f["tensors"] = len(full)
    return f


def _perturb(chunks: list, *, frac: float, seed: int) -> None:
    """Noise on about ``frac`` of the elements of every other parameter (by name), through
    ``param.data``, each rank its own shards -- replicas of a replicated tensor drift apart, so a
    rank answering for the wrong replica shows -- and one whole small tensor changed: a MoE
    layer's router expert bias (a buffer), else the final norm. A tenth of the noise is too small
    for a bf16 wire to see (the wire bytes decide what changed)."""
    import zlib

    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    whole = False
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if zlib.crc32(name.encode()) % 2:
                    continue
                mask = (torch.rand(p.shape, generator=g) < frac).to(p.dtype)
                tiny = torch.rand(p.shape, generator=g) < 0.1
                step = torch.where(tiny, 1e-7, 0.05) * (1 + p.data.abs())
                p.data.add_(mask * step.to(p.dtype))
            for name, b in chunk.named_buffers():
                if name.endswith("router.expert_bias"):
                    b.add_(0.5)
                    whole = True
            if not whole:
                norm = getattr(chunk.decoder, "final_layernorm", None)
                if norm is not None:
                    norm.weight.data.add_(1.0)


def delta_rounds(src, chunks: list, seed: int) -> list[dict]:
    """``DeltaSource`` over ``src`` (small exchange groups): anchor, a round with no change, two
    rounds after ``_perturb``, another with no change; a receiver on rank 0 fed only the rounds
    (``delta_worlds.RoundLog``: it equals ``iter_full`` after each round, and each round carries
    exactly the elements whose wire bytes changed between the dense passes before and after)."""
    from delta_worlds import RoundLog

    from weightsync.sources import DeltaSource

    delta = DeltaSource(src, group_bytes=8 << 10)
    assert delta.pieces_native
    log = RoundLog(src, delta, {})
    log.round("anchor")
    log.round("no change")
    _perturb(chunks, frac=0.02, seed=seed)
    log.round("delta")
    _perturb(chunks, frac=0.02, seed=seed + 1)
    log.round("delta 2")
    log.round("no change 2")
    return log.facts


@contextlib.contextmanager
def gathered(kinds: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, these layout kinds say they cannot place their shards (``Layout.boxed``
    False): ``iter_pieces`` takes its fallback, ``iter_full``'s point-to-point gather to rank 0."""
    from weightsync.sources.core.layouts import tp as L

    try:
        for k in kinds:
            L.KINDS[k].boxed = False
        yield
    finally:
        for k in kinds:
            L.KINDS[k].__dict__.pop("boxed", None)


def _world(rank, world_size, *, layouts):
    import torch.distributed as dist

    from weightsync.sources import MegatronSource

    facts: dict = {}
    for lay in layouts:
        chunks, hf = _make(lay)
        model = chunks if len(chunks) > 1 else chunks[0]
        before = {(v, n): p.detach().clone() for v, c in enumerate(chunks) for n, p in c.named_parameters()}
        variants = lay.get("variants", [{}])
        for variant in variants:
            kw = {k: v for k, v in variant.items() if k in ("dtype", "expert_layout")}
            with gathered(variant.get("gather_kinds", ())):
                src = MegatronSource(model, hf_config=hf, **kw)
                key = f"{lay['name']}/{variant.get('tag', 'fp32')}"
                facts[key] = check_source(src, rank, world_size)
                facts[key]["kinds"] = sorted({str(u.kind) for u in src.plan})
                facts[key]["shifted"] = sorted(n for u in src.plan if u.kind.shifts_values for n in u.names)
        facts[lay["name"] + "/unchanged"] = all(
            torch.equal(p, before[(v, n)]) for v, c in enumerate(chunks) for n, p in c.named_parameters()
        )
        for j, variant in enumerate(variants):  # (these change the model: after the checks above)
            kw = {k: v for k, v in variant.items() if k in ("dtype", "expert_layout")}
            with gathered(variant.get("gather_kinds", ())):
                src = MegatronSource(model, hf_config=hf, **kw)
                key = f"{lay['name']}/{variant.get('tag', 'fp32')}/delta"
                facts[key] = delta_rounds(src, chunks, seed=10 * j + 1)
        dist.barrier()
    return pack(facts)


BF16 = dict(tag="bf16", dtype=torch.bfloat16)
EXPERTS = [dict(tag="per_expert", expert_layout="per_expert"), dict(tag="fused", expert_layout="fused")]
MOE_KW = dict(layers=2, experts=4, hidden=16, moe_ffn=12)

TWO_RANKS = [
    dict(name="llama_tp2", build="dense", family="llama", tp=2, variants=[{}, BF16]),
    dict(name="qwen3_pp2_vpp2_tied", build="dense", family="qwen3", pp=2, vpp=2, tied=True),
    dict(name="qwen3moe_ep2", build="moe", family="qwen3_moe", ep=2, hf=dict(MOE_KW, shared=None),
         variants=EXPERTS),
    dict(name="qwen2moe_tp2_ep2_etp1", build="moe", family="qwen2_moe", tp=2, ep=2, etp=1, shared_gate=True,
         hf=dict(MOE_KW, shared=20), variants=[*EXPERTS, dict(BF16, expert_layout="fused", tag="fused_bf16")]),
    dict(name="qwen3next_tp2", build="next", preset="tiny-qwen3-next", tp=2, variants=[*EXPERTS, BF16]),
    dict(name="qwen35_tp2", build="next", preset="tiny-qwen3.5", tp=2,
         variants=[{}, BF16, dict(tag="gathered", gather_kinds=("gdn_qkv_z_b_a", "gdn_conv"))]),
    dict(name="dsv3_tp2", build="mla", tp=2, variants=[*EXPERTS, BF16]),
    dict(name="dsv32_tp2", build="dsa", tp=2),
    dict(name="gptoss_tp2", build="gpt_oss", tp=2, variants=[*EXPERTS, BF16]),
]

FOUR_RANKS = [
    dict(name="qwen3moe_tp2_ep2_etp2", build="moe", family="qwen3_moe", tp=2, ep=2, etp=2,
         hf=dict(MOE_KW, shared=None), variants=EXPERTS),
    dict(name="qwen3moe_tp2_ep2_etp2_grouped", build="moe", family="qwen3_moe", tp=2, ep=2, etp=2, fmt="grouped",
         hf=dict(MOE_KW, shared=None), variants=EXPERTS[1:]),
    dict(name="llama_tp2_dp2", build="dense", family="llama", tp=2),
    dict(name="mixtral_pp2_ep2", build="moe", family="mixtral", pp=2, ep=2, hf=dict(MOE_KW, layers=4, shared=None),
         variants=EXPERTS),
    dict(name="dsv3_tp2_ep2_etp1_first_dense", build="moe", family="deepseek_v3", tp=2, ep=2, etp=1,
         expert_bias=True, hf=dict(MOE_KW, layers=3, shared=12, dense_first=1), variants=EXPERTS),
]


def _check(res: dict, layouts: list[dict]) -> None:
    for lay in layouts:
        for variant in lay.get("variants", [{}]):
            key = f"{lay['name']}/{variant.get('tag', 'fp32')}"
            r0 = res[0][key]
            assert r0["bad"] == [], (key, r0["bad"][:10])
            assert r0["tensors"] > 0
            for r, facts in res.items():
                f = facts[key]
                assert f["order"] == [], (key, r, f["order"])
                assert f["boxes_again"] and f["values_again"], (key, r)
                # a bf16 wire from fp32 parameters: floating pieces come uncast (the consumer casts),
                # except values to_wire changes (shifted norms), which come as iter_full sends them
                assert bool(f["uncast"]) == (variant.get("dtype") == torch.bfloat16) or not f["pieces"], (key, r)
                assert not set(f["uncast"]) & set(f["shifted"]), (key, r, sorted(set(f["uncast"]) & set(f["shifted"])))
                if variant.get("gather_kinds"):
                    assert f["comm"].get("isend", 0) + f["comm"].get("irecv", 0) > 0, (key, r, f["comm"])
                else:
                    assert f["comm"] == {}, (key, r, f["comm"])  # no collective in a later pass
        assert all(res[r][lay["name"] + "/unchanged"] for r in res), lay["name"]
        for variant in lay.get("variants", [{}]):
            key = f"{lay['name']}/{variant.get('tag', 'fp32')}/delta"
            if key in res[0]:
                check_delta(res, key)


def check_delta(res: dict, key: str) -> None:
    """The receiver equals ``iter_full`` after every round; every round carries exactly the
    elements whose wire bytes changed (an anchor: all of them); rounds without change send nothing."""
    facts = {f["label"]: f for f in res[0][key]}
    assert list(facts) == ["anchor", "no change", "delta", "delta 2", "no change 2"], key
    for label, f in facts.items():
        assert f["mismatch"] == [], (key, label, f["mismatch"][:5])
        assert f["minimal"], (key, label)
        assert f["stats"]["anchor"] == (label == "anchor"), (key, label)
    for label in ("no change", "no change 2"):
        f = facts[label]
        assert f["yielded"] == 0 and f["stats"]["changed"] == 0 and f["changed_oracle"] == 0, (key, label, f)
    for label in ("delta", "delta 2"):
        f = facts[label]
        assert 0 < f["stats"]["changed"] == f["changed_oracle"] < f["stats"]["elements"], (key, label, f["stats"])
    for r in res:  # every rank took part in every round and agreed that each completed
        assert [f["stats"]["completed"] for f in res[r][key]] == [True] * 5, (key, r)


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(_world, 2, layouts=TWO_RANKS, timeout=900)


def test_two_ranks_pieces_tile_iter_full(two_ranks):
    _check(two_ranks, TWO_RANKS)
    kinds = set().union(*(f["kinds"] for f in two_ranks[0].values() if isinstance(f, dict) and "kinds" in f))
    from weightsync.sources.core.layouts.tp import KINDS

    # every layout kind but the indexer's other pairing (GLM-5) and the fused MLA down projection
    assert set(KINDS) - kinds <= {"indexer_rope_interleaved", "stack", "stack_column"}, sorted(set(KINDS) - kinds)
    assert two_ranks[0]["qwen35_tp2/bf16"]["shifted"] and two_ranks[0]["qwen3next_tp2/bf16"]["shifted"]
    assert two_ranks[0]["llama_tp2/bf16"]["uncast"]  # (a bf16 wire of fp32 parameters: the consumer casts)
    # both TP ranks answer for the TP2 layouts (pieces on rank 1 too); EP2's rank 1 answers experts only
    assert two_ranks[1]["llama_tp2/fp32"]["pieces"] > 0 and two_ranks[1]["qwen3moe_ep2/fused"]["pieces"] > 0


def test_four_ranks_tp2_ep2_etp2_and_tp2_dp2():
    res = run_world(_world, 4, layouts=FOUR_RANKS, timeout=900)
    _check(res, FOUR_RANKS)
    assert [res[r]["llama_tp2_dp2/fp32"]["pieces"] for r in (2, 3)] == [0, 0]  # the other DP replica
    assert all(res[r]["qwen3moe_tp2_ep2_etp2/per_expert"]["pieces"] > 0 for r in range(4))
