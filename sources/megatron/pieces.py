"""``MegatronSource.iter_pieces``: each rank's Megatron shards as boxes of the checkpoint tensors.

The protocol is ``core/layouts/pieces.py``'s: a collective call; every rank passes every metadata name, in
metadata order, as its pieces of that name or one ``marker``; over all ranks the pieces of a name
tile it exactly once; values in the wire dtype; the same boxes every pass. How the plan's units
become pieces:

* **Dense units** (embedding, attention, dense MLP, norms, output layer): only ranks of the
  model-parallel replica that contains rank 0 answer (``Topology.grid``, the ranks ``iter_full``
  reads) -- other data-parallel / context-parallel replicas hold the same values. A rank answers
  for the units of its own pipeline stage (VPP chunks included); a kind with ``dim is None``
  (norms, duplicated linears, shifted norms, DSA indexer rows) only from TP rank 0. Its shard,
  vocabulary-trimmed and through the kind's ``to_wire`` (cast, or shift then cast), is cut by the
  kind itself: ``Layout.boxes`` (``core/layouts/tp.py``) says where each piece of the shard's split sits
  in the HF tensors -- the one place that layout math lives, next to ``concat``. No collective.
* **A kind that cannot place its shards** (``Layout.boxed`` False; none today): the point-to-point
  gather to rank 0 that ``iter_full`` uses (``DenseUnits.gather_to``, ``p2p.gather_to``);
  rank 0 yields each HF tensor whole, the others markers. Every rank runs it while producing the
  unit's first item -- the one place the protocol allows a collective.
* **MoE layers**, right after the layer's last dense unit (as metadata lists them): the router, its
  bias and its expert bias from the rank ``MegatronMoEExporter`` reads them from
  (``MoEPlacement.holder``: the lowest rank of the layer's stage); routed expert ``e``'s ETP shard
  ``r`` from ``holder(ep=e // E_local, etp=r)`` -- the expert-data-parallel copy the exporter reads;
  shared experts' TP shard ``r`` from ``holder(tp=r)``; the shared-expert gate like the router. Expert and
  shared-expert shards are cut by ``GLU_LAYOUT.boxes`` (fc1 ``[gate_r; up_r]``) and ``ROW.boxes``
  (fc2). ``per_expert``: boxes of ``experts.{e}.gate_proj`` ...; ``fused``: expert ``e``'s boxes
  sit at ``(e, ...)`` of ``gate_up_proj`` ``[E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``:
  ``ExpertLayerSpec.fill_expert``'s layout) and ``down_proj`` ``[E, H, I]``. Checkpoints whose
  experts are transposed or gate/up-interleaved (GPT-OSS) give each expert's whole per-expert
  tensors / fused slice ``[e]`` through the spec's own ``expert_tensors`` / ``fill_expert``; such
  experts have biases, which megatron-core allows at ETP 1 only (``hf_layer`` checks), so an ETP
  split of them is never cut (it would raise, naming the layer). The exporter's one cached
  coordinate exchange (``exchange_coords``) runs on every rank before the first pass's first item.
* Values: the bytes ``iter_full`` sends, or -- for floating tensors -- the values in the
  parameter's own floating dtype, whose plain cast to the wire dtype gives those bytes (the
  protocol lets the consumer cast, into memory it reuses): splits only move elements and a cast is
  elementwise, so cut-then-cast equals ``iter_full``'s cast-then-cut. A kind whose ``to_wire``
  changes values (``shifts_values``: the zero-centered norms) is sent through it here, in the wire
  dtype. Boxes depend on configs and this rank's coordinates only, so they are the same every pass.

Pieces may alias the model's parameters (column / row / GLU / vocabulary / expert pieces are views
when uncast); anything this module allocates for a piece is new every pass.

What this module reads of the source is one explicit ``MegatronPiecesView`` the source builds (its
plan, where MoE layers follow, its ``DenseUnits``, its MoE exporter and its metadata agreement), and
of the exporter only its public methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.ground.logs import get_logger
from ..core.ground.stats import PassStats
from ..core.layouts.pieces import Piece, marker, whole_piece
from ..core.layouts.tp import GLU_LAYOUT, ROW, Box
from .moe import MegatronMoEExporter, MoEShard
from .moe_storage import expert_biases, expert_full
from .plan import Unit
from .units import DenseUnits

__all__ = ["MegatronPiecesView", "megatron_pieces"]

logger = get_logger(__name__)

#: ``take(kind, expert, shard, shape, dtype)``: this rank's MoE tensor as the exporter sends it
Take = Callable[[str, int, int, tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class MegatronPiecesView:
    """Everything ``megatron_pieces`` reads of a ``MegatronSource``, handed over explicitly (the
    source builds it in ``iter_pieces``); nothing else of the source is read."""

    #: the export plan, in metadata order
    plan: Sequence[Unit]
    #: plan index -> the MoE layer whose tensors follow that unit in metadata
    moe_after: Mapping[int, int]
    #: this rank's dense units: parameters, wire dtypes, vocabulary rows, layout kwargs, the gather
    units: DenseUnits
    #: the MoE layers' exporter (None: a dense model)
    moe: MegatronMoEExporter | None
    #: the source's cross-rank metadata agreement: collective on the first pass, a no-op after
    agree: Callable[[], None]


def megatron_pieces(view: MegatronPiecesView) -> Iterator[Piece]:
    """This rank's pieces (or a marker) of every tensor of the source's metadata, in metadata order.

    Collective: every rank of the world calls it (the first pass runs the source's metadata
    agreement and the MoE exporter's coordinate exchange before its first item; a gathered unit is
    a point-to-point transfer before that unit's first item)."""
    stats = PassStats().start()
    try:
        view.agree()
        if view.moe is not None:
            view.moe.exchange_coords()  # cached: a collective on the first pass only, on every rank
        for i, unit in enumerate(view.plan):
            per_name = _gathered(view.units, unit, stats) if not unit.kind.boxed else _unit_boxes(view.units, unit)
            for name, pieces in zip(unit.names, per_name):
                yield from pieces or (marker(name),)
            layer = view.moe_after.get(i)
            if layer is not None:
                assert view.moe is not None
                yield from _moe_pieces(view.moe, layer)
    finally:
        stats.stop()
        logger.debug("rank %d: iter_pieces %s", view.units.topo.rank, stats.as_dict())


def _unit_boxes(units: DenseUnits, unit: Unit) -> list[list[Piece]]:
    """This rank's boxes of each of ``unit``'s HF tensors (empty lists unless it answers for them)."""
    topo, kind = units.topo, unit.kind
    out: list[list[Piece]] = [[] for _ in unit.names]
    ranks = topo.stage_ranks(unit.stage)
    if topo.rank not in ranks:
        return out  # another stage, or another data-parallel replica: the sender replica answers
    tp_rank = ranks.index(topo.rank)
    if kind.dim is None and tp_rank != 0:
        return out  # every TP rank holds all of it: TP rank 0 answers
    bound = units.bound.get(unit.key)
    if bound is None:
        raise RuntimeError(
            f"rank {topo.rank}: no Megatron parameter bound for {list(unit.names)} on pipeline stage {unit.stage}"
        )
    param = bound.param.detach()
    rows = units.piece_rows(unit, tp_rank)
    if rows is not None:
        if rows == 0:
            return out  # a vocabulary shard of padding only
        param = param[:rows]
    wd = units.wire_dtypes[unit.key]
    # A plain cast is the consumer's (core/layouts/pieces.py: it casts into memory it reuses); a kind whose
    # to_wire changes values (a shifted norm) applies it here, as iter_full does.
    plain = not kind.shifts_values and param.is_floating_point() and wd.is_floating_point
    shard = param if plain else kind.to_wire(param, wd)
    boxes = kind.boxes(
        shard, full=unit.shapes, tp=topo.tp, tp_rank=tp_rank, padded_vocab=units.geometry.padded_vocab,
        **units.geometry_kw(unit),
    )
    for box in boxes:
        out[box.index].append(Piece(unit.names[box.index], box.offsets, box.tensor))
    return out


def _gathered(units: DenseUnits, unit: Unit, stats: PassStats) -> list[list[Piece]]:
    """Fallback for a kind ``boxes`` cannot place: ``iter_full``'s point-to-point gather of the
    unit's shards to rank 0 (every rank calls it, in plan order, before the unit's first item; only
    the stage's TP ranks of the sender replica send); rank 0 holds each HF tensor whole."""
    got = units.gather_to(unit, 0, stats)
    if got is None:
        return [[] for _ in unit.names]
    outs = unit.kind.concat(got, **units.geometry_kw(unit))
    return [[whole_piece(name, t)] for name, t in zip(unit.names, outs)]


# ---- MoE layers ---------------------------------------------------------------------------------


def _moe_pieces(ex: MegatronMoEExporter, layer: int) -> Iterator[Piece]:
    """One MoE layer's pieces (or markers) on this rank, in the exporter's stream (metadata) order."""
    hf = ex.hf_layer(layer)
    wd = ex.dtypes(hf)
    me = dist.get_rank()
    mlp = ex.local.get(layer)

    def take(kind: str, e: int, shard: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if mlp is None:
            raise RuntimeError(f"rank {me}: holds no module of MoE layer {layer} but is the holder of its {kind}")
        return ex.local_tensor(mlp, MoEShard(me, kind, e, shard, shape, dtype), own_dtype=True)

    first = ex.placement.holder(layer)  # router, its biases and the shared-expert gate: as the exporter reads them

    def whole(entry: tuple[str, tuple[int, ...]], kind: str, dtype: torch.dtype) -> Piece:
        return whole_piece(entry[0], take(kind, -1, 0, entry[1], dtype)) if first == me else marker(entry[0])

    yield whole(hf.router, "router", wd["router"])
    if hf.router_linear_bias is not None:
        yield whole(hf.router_linear_bias, "rbias", wd["rbias"])
    if hf.router_bias is not None:
        yield whole(hf.router_bias, "bias", wd["bias"])
    yield from _expert_pieces(ex, layer, hf, wd["experts"], take)
    if hf.shared is not None:
        S, H, tp = hf.shared[0][1][0], ex.mcfg.hidden_size, ex.tp
        boxes: list[Box] = []
        c = ex.placement.coords_of(me)  # (the holder of TP shard r has TP rank r: only this rank's can be ours)
        r = c.tp
        if ex.placement.stage_of(layer) == c.pp and ex.placement.holder(layer, tp=r) == me:
            s1 = take("shared1", -1, r, (2 * S // tp, H), wd["shared"])
            boxes += GLU_LAYOUT.boxes(s1, full=(hf.shared[0][1], hf.shared[1][1]), tp=tp, tp_rank=r)
            s2 = take("shared2", -1, r, (H, S // tp), wd["shared"])
            (down,) = ROW.boxes(s2, full=(hf.shared[2][1],), tp=tp, tp_rank=r)
            boxes.append(down._replace(index=2))
        for i, (name, _) in enumerate(hf.shared):  # gate, up, down
            yield from [Piece(name, b.offsets, b.tensor) for b in boxes if b.index == i] or (marker(name),)
    if hf.shared_gate is not None:
        yield whole(hf.shared_gate, "sgate", wd["sgate"])


def _expert_pieces(ex: MegatronMoEExporter, layer: int, hf: Any, wd: torch.dtype, take: Take) -> Iterator[Piece]:
    """The routed experts this rank answers for (``holder(ep, etp)``), every name of the wire
    layout in its order: ``per_expert`` expert-major (gate, up, down of each expert); ``fused``
    part-major (``spec.parts``: every expert's ``gate_up`` boxes, then ``down`` ...)."""
    spec = hf.experts
    me = dist.get_rank()
    F, H, etp = ex.mcfg.moe_ffn_hidden_size, ex.mcfg.hidden_size, ex.etp
    # The holder of (ep, etp) has those coordinates: only this rank's own can be ours (one lookup per
    # layer, not one per expert and ETP rank over every rank's coordinates).
    c = ex.placement.coords_of(me)
    holder = ex.placement.stage_of(layer) == c.pp and ex.placement.holder(layer, ep=c.ep, etp=c.etp) == me
    held = {e: c.etp for e in range(c.ep * ex.E_local, (c.ep + 1) * ex.E_local)} if holder else {}
    layout = ex.layout_of(spec)
    plain = not (spec.transposed or spec.interleaved)
    if not plain and etp != 1:
        raise NotImplementedError(
            f"rank {me}: layer {layer}: transposed / interleaved experts at expert_tensor_parallel_size={etp} "
            "have no boxes (their ETP rows of gate and up interleave); megatron-core builds them at ETP 1"
        )

    def gate_up(e: int, r: int) -> tuple[Box, ...]:
        fc1 = take("fc1", e, r, (2 * F // etp, H), wd)
        return GLU_LAYOUT.boxes(fc1, full=((F, H), (F, H)), tp=etp, tp_rank=r)

    def down(e: int, r: int) -> Box:
        (box,) = ROW.boxes(take("fc2", e, r, (H, F // etp), wd), full=((H, F),), tp=etp, tp_rank=r)
        return box

    def biases(e: int) -> tuple[torch.Tensor, ...] | None:
        if not spec.bias:  # (biased experts are ETP 1: hf_layer checked)
            return None
        return expert_biases(take("fc1b", e, 0, (2 * F,), wd), take("fc2b", e, 0, (H,), wd))

    def expert_whole(e: int) -> tuple:
        fc1, fc2 = take("fc1", e, 0, (2 * F, H), wd), take("fc2", e, 0, (H, F), wd)
        return (*expert_full([fc1], [fc2]), biases(e))

    if layout == "per_expert":
        per = len(spec.entries("per_expert")) // ex.E  # names per expert, in entries order
        names = [n for n, _ in spec.entries("per_expert")]
        for e in range(ex.E):
            of_e = names[e * per : (e + 1) * per]
            if e not in held:
                yield from (marker(n) for n in of_e)
            elif spec.saved == "per_expert":  # gate, up, down: the ETP shard's boxes of each
                r = held[e]
                g, u = gate_up(e, r)
                for name, box in zip(of_e, (g, u, down(e, r))):
                    yield Piece(name, box.offsets, box.tensor)
            else:  # a fused checkpoint's streamed per-expert slices, built by the spec (ETP 1)
                for name, t in spec.expert_tensors(e, *expert_whole(e)):
                    yield whole_piece(name, t)
        return
    for part in spec.parts:
        name = spec.fused_name(part)
        if not held:
            yield marker(name)
            continue
        for e, r in held.items():
            if not plain:  # expert e's slice [e] in the spec's own layout (rebuilt per part: no layer held)
                gate, up, dn, bs = expert_whole(e)
                slots = {p: gate.new_empty(spec.fused_shape(p)[1:]) for p in spec.parts}
                spec.fill_expert(slots, gate, up, dn, bs)
                yield Piece(name, (e,) + (0,) * slots[part].dim(), slots[part].unsqueeze(0))
            elif part == "gate_up":  # [gate; up]: gate rows [0, F), up rows [F, 2F) of slice [e]
                g, u = gate_up(e, r)
                yield Piece(name, (e, *g.offsets), g.tensor.unsqueeze(0))
                yield Piece(name, (e, F + u.offsets[0], u.offsets[1]), u.tensor.unsqueeze(0))
            elif part == "down":
                d = down(e, r)
                yield Piece(name, (e, *d.offsets), d.tensor.unsqueeze(0))
            else:  # gate_up_bias [E, 2F] = [gate; up] (fc1's bias as it is) / down_bias [E, H] (ETP 1)
                gb, ub, db = biases(e)
                t = torch.cat([gb, ub]) if part == "gate_up_bias" else db
                yield Piece(name, (e, 0), t.unsqueeze(0))
