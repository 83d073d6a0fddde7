"""What one pass of a source does on every trainer rank, predicted without running it.

Invariant: every count here is a function of the source's own metadata (names, wire dtypes, full
shapes: ``FSDPSource`` / ``FP8Source`` built on a meta-device model, no collective), of the model's
module structure (in-memory shapes, FSDP units) and of the layout -- never of tensor values. Each
per-rank figure is the ``PassStats`` field a real pass reports on that rank (``tensors``, ``bytes``,
``collectives``, ``bytes_received``; steady state, i.e. the second and later passes), following the
rules the sources document:

* FSDP2 / HSDP (``sources/fsdp/plan.py``): consecutive in-memory tensors of one FSDP unit form one
  all-gather until the next would pass ``group_bytes`` of wire bytes; each all-gather over ``n > 1``
  shard ranks is one collective receiving ``(n - 1) x`` its send block (each tensor's
  ``ceil(rows / n)`` rows, 16-byte aligned). ``senders="owners"``: the tensors are cut into one
  contiguous run per replica balanced by wire bytes (``core/senders.split_contiguous``'s rule) and
  each replica gathers only its run.
* Megatron ``mode="full"``, one sender (``sources/megatron/source.py``, ``moe.py``, ``core/comm/p2p.py``):
  every unit (one Megatron parameter: q/k/v fused, gate/up fused; the family table says which) goes
  point to point from its holders to rank 0: one receive on rank 0 and one send on the holder per
  piece not already on rank 0; MoE layers' routers, routed experts (``etp`` pieces each of fc1, fc2)
  and shared experts likewise, from their lowest holder (Megatron's rank order ``tp-cp-ep-dp-pp``).

The FSDP unit policy is the one the CLI and most trainers use: each decoder layer (a module path
ending in ``layers.N``) is a unit, the root holds the rest. ``peak_extra_bytes`` is an estimate, not a
count: for FSDP the groups in flight (``fsdp_counts`` says which, per device);
for Megatron rank 0 the small tensors cast in one buffer plus the unit being yielded (pieces and
outputs) and the one posted ahead, or an expert batch and its assembled tensors; a peer one piece.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "RankCounts",
    "Item",
    "fsdp_items",
    "fsdp_counts",
    "megatron_counts",
    "decoder_layer_unit",
    "contiguous_bins",
    "output_bytes",
]

#: Send blocks of a batched all-gather are 16-byte aligned per tensor (``sources/fsdp/gather.py``).
GATHER_ALIGN = 16
#: Megatron pads the vocabulary to a multiple of this times TP (``make_vocab_size_divisible_by``).
VOCAB_DIVISIBLE_BY = 128
#: ``MegatronSource`` casts rank 0's small whole tensors in one buffer (``megatron/whole_units.py``).
PRECAST_MAX_NUMEL, PRECAST_CAP_BYTES = 1 << 20, 64 << 20
#: ``MegatronMoEExporter`` moves routed experts in batches of at most this many bytes (``core/hf/experts.py``).
EXPERT_BATCH_BYTES = 256 << 20
_LAYER = re.compile(r"^(.*?\blayers\.(\d+))\.")


@dataclass
class RankCounts:
    """One rank's pass, as ``PassStats`` reports it (``peak_extra_bytes``: an estimate)."""

    tensors: int = 0
    bytes: int = 0
    collectives: int = 0
    bytes_received: int = 0
    peak_extra_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Item:
    """One in-memory tensor a source gathers, and the checkpoint tensors it becomes."""

    path: str
    unit: str
    shape: tuple[int, ...]  # full in-memory shape
    wire_itemsize: int
    is_buffer: bool
    outputs: tuple[tuple[str, Any, tuple[int, ...]], ...]  # (name, wire dtype, full shape)

    @property
    def wire_bytes(self) -> int:
        return math.prod(self.shape) * self.wire_itemsize


def output_bytes(dtype: Any, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def decoder_layer_unit(path: str) -> str:
    """The FSDP unit of in-memory tensor ``path`` under the usual policy: its decoder layer
    (``...layers.N``), else the root."""
    m = _LAYER.match(path)
    return m.group(1) if m else "<root>"


def contiguous_bins(sizes: Sequence[int], bins: int) -> list[int]:
    """Replica of each item under ``senders="owners"``: ``bins`` contiguous runs in item order,
    item ``i`` in the run its start offset falls in -- the rule of ``core/senders.split_contiguous``
    (``tests/test_plan.py`` checks this against a real HSDP pass)."""
    total = sum(sizes)
    out, start = [], 0
    for size in sizes:
        out.append(min(bins - 1, start * bins // total) if total else 0)
        start += size
    return out


def fsdp_items(source: Any, module: Any, unit_of: Callable[[str], str] = decoder_layer_unit) -> list[Item]:
    """The items of ``source`` (an ``FSDPSource`` over ``module``, typically on the meta device), in
    stream order, from its public ``entries``, ``wire`` policy and ``metadata``."""
    metas = list(source.metadata)
    items: list[Item] = []
    k = 0
    for e in source.entries:
        t = module.get_buffer(e.path) if e.is_buffer else module.get_parameter(e.path)
        n = 1 if e.transform is None else len(list(e.transform.entries(e.name)))
        outs = tuple((m.name, m.dtype, tuple(m.shape)) for m in metas[k:k + n])
        k += n
        wd = source.wire.dtype_for(e.name, t.dtype)
        items.append(Item(e.path, unit_of(e.path), tuple(t.shape), wd.itemsize, bool(e.is_buffer), outs))
    if k != len(metas):
        raise ValueError(f"source entries cover {k} of {len(metas)} metadata tensors: cannot plan this source")
    return items


def _block_bytes(items: Sequence[Item], n: int) -> int:
    total = 0
    for it in items:
        rows = it.shape[0] if it.shape else 1
        row_numel = math.prod(it.shape[1:])
        nbytes = -(-rows // n) * row_numel * it.wire_itemsize
        total += -(-nbytes // GATHER_ALIGN) * GATHER_ALIGN
    return total


def _groups(items: Sequence[Item], owned: Sequence[bool], group_bytes: int | None) -> list[list[Item]]:
    """The batched all-gathers of one rank, in order (``fsdp.plan.plan_steps``' grouping)."""
    groups: list[list[Item]] = []
    last_key, cur_bytes = None, 0
    for it, mine in zip(items, owned):
        if not mine or it.is_buffer:  # not owned, or a plain tensor (buffers are never sharded)
            last_key = None
            continue
        if it.unit == last_key and (group_bytes is None or cur_bytes + it.wire_bytes <= group_bytes):
            groups[-1].append(it)
            cur_bytes += it.wire_bytes
            continue
        groups.append([it])
        last_key, cur_bytes = it.unit, it.wire_bytes
    return groups


def fsdp_counts(
    items: Sequence[Item],
    *,
    shard: int,
    replicas: int = 1,
    senders: str = "rank0",
    group_bytes: int | None = 64 << 20,
    device: str = "gpu",
) -> dict[int, RankCounts]:
    """Per global rank: an FSDP2 (``replicas == 1``) or HSDP (mesh ``replicas x shard``, rank
    ``r * shard + s``) pass of ``FSDPSource`` (overlap on, its default). ``device`` picks the memory
    estimate: ``"cpu"`` gathers recycle host buffers through pools that keep idle buffers and a helper
    thread packs and unpacks ahead (a loose bound), ``"gpu"`` holds one group ahead."""
    if senders not in ("rank0", "owners"):
        raise ValueError(f"senders= must be 'rank0' or 'owners', got {senders!r}")
    if senders == "owners" and replicas < 2:
        raise ValueError("senders='owners' needs HSDP (replicas >= 2): plain FSDP cannot send from many ranks")
    bins = contiguous_bins([it.wire_bytes for it in items], replicas) if senders == "owners" else [0] * len(items)
    out: dict[int, RankCounts] = {}
    for r in range(replicas):
        owned = [senders == "rank0" or b == r for b in bins]
        c = RankCounts()
        for it, mine in zip(items, owned):
            if mine:
                c.tensors += len(it.outputs)
                c.bytes += sum(output_bytes(d, s) for _, d, s in it.outputs)
        groups = _groups(items, owned, group_bytes)
        held, largest = [], 0
        for g in groups:
            block = _block_bytes(g, shard)
            if shard > 1:
                c.collectives += 1
                c.bytes_received += (shard - 1) * block
            largest = max([largest] + [sum(output_bytes(d, s) for _, d, s in it.outputs) for it in g])
            held.append((shard + 1) * block if shard > 1 else 0)
        if device == "cpu" and shard > 1:
            # host buffer pools (fsdp/buffers.py): per pool up to 3 buffers in use (the group yielded,
            # the one ahead, the send block packed after it) and 2 idle, each holding up to the
            # largest group's size; + the tensor yielded and the one unpacked ahead
            c.peak_extra_bytes = 5 * max(held, default=0) + 2 * largest
        else:  # the group yielded and the one posted ahead, + the tensor yielded
            c.peak_extra_bytes = max((held[k] + (held[k + 1] if k + 1 < len(held) else 0)
                                      for k in range(len(held))), default=0) + largest
        for s in range(shard):
            out[r * shard + s] = RankCounts(**c.as_dict())
    return out


# ---- Megatron -------------------------------------------------------------------------------------


def _padded_vocab(vocab: int, tp: int) -> int:
    m = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab // m) * m


def _vocab_rows(vocab: int, tp: int, r: int) -> int:
    per = _padded_vocab(vocab, tp) // tp
    return max(0, min(vocab, (r + 1) * per) - r * per)


def megatron_counts(
    metadata: Sequence[Any],
    *,
    hf_config: Any,
    layer_keys: dict[str, Any],
    tp: int,
    pp: int,
    vpp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    world: int | None = None,
    ahead_bytes: int = 128 << 20,
) -> dict[int, RankCounts]:
    """Per global rank: a ``MegatronSource(mode="full")`` pass with one sender (rank 0).

    ``metadata``: the checkpoint tensors (name, wire dtype, full shape) in stream order -- the same
    list ``MegatronSource.metadata`` declares, here taken from ``FSDPSource`` over the meta HF
    model; ``layer_keys``: the family's Megatron layer table (``Family.layer_keys``: Megatron
    suffix -> ``Entry(kind, hf names)``), which says which HF tensors one Megatron parameter holds
    and how it is split over TP; ``ahead_bytes``: ``MegatronSource``'s overlap budget (128 MiB where
    each local rank has 4 cores or more, else 64 MiB: ``megatron/ahead.py``)."""
    world = world or tp * pp * ep
    L = hf_config.num_hidden_layers
    etp = tp if etp is None else etp
    if world % (tp * pp) or world % (etp * ep * pp):
        raise ValueError(f"world={world} is not a multiple of tp*pp={tp * pp} and etp*ep*pp={etp * ep * pp}")
    if L % (pp * vpp):
        raise ValueError(f"num_hidden_layers={L} does not divide into pp*vpp={pp * vpp} equal chunks")
    per_chunk = L // (pp * vpp)
    stage_width = world // pp  # ranks per pipeline stage (Megatron's pp is the outermost dimension)
    by_name = {m.name: m for m in metadata}
    counts = {r: RankCounts() for r in range(world)}
    r0 = counts[0]
    r0.tensors = len(metadata)
    r0.bytes = sum(output_bytes(m.dtype, m.shape) for m in metadata)
    hidden = hf_config.hidden_size
    vocab = hf_config.vocab_size

    moved: list[tuple[str, int]] = []  # rank 0, in order: ("unit", HF bytes) received / ("moe", expert batch)
    precast = 0  # rank 0: small tensors it holds whole, cast in one buffer per pass

    def move(src: int, nbytes: int, held: bool = False) -> None:
        if src == 0 or nbytes == 0:
            return
        r0.collectives += 1
        r0.bytes_received += nbytes
        counts[src].collectives += 1
        if held:  # a dense unit's piece, cast and held until sent (MoE pieces are not counted)
            counts[src].peak_extra_bytes = max(counts[src].peak_extra_bytes, nbytes)

    def stage_rank(stage: int, tp_rank: int) -> int:  # the sender replica's rank (dp rank 0)
        return stage * stage_width + tp_rank

    covered: set[str] = set()

    def unit(names: Sequence[str], kind: str, stage: int) -> None:
        nonlocal precast
        metas = [by_name[n] for n in names if n in by_name]
        if not metas:
            return
        covered.update(m.name for m in metas)
        total = sum(output_bytes(m.dtype, m.shape) for m in metas)
        if stage == 0 and (kind == "replicated" or tp == 1):
            if all(math.prod(m.shape) <= PRECAST_MAX_NUMEL for m in metas):
                precast = min(PRECAST_CAP_BYTES, precast + total)
            return  # rank 0 holds it whole: no transfer
        moved.append(("unit", total))
        if kind == "replicated":
            move(stage_rank(stage, 0), total, True)
        elif kind == "vocab":
            row = total // vocab
            for r in range(tp):
                move(stage_rank(stage, r), _vocab_rows(vocab, tp, r) * row, True)
        else:
            for r in range(tp):
                move(stage_rank(stage, r), total // tp, True)

    unit(["model.embed_tokens.weight"], "vocab", 0)
    for layer in range(L):
        stage = (layer // per_chunk) % pp
        pre = f"model.layers.{layer}."
        moe = any(n.startswith(pre + "mlp.experts.") for n in by_name)
        for suffix, entry in layer_keys.items():
            if moe and suffix.startswith("mlp."):
                continue
            unit([pre + h for h in entry.hf], entry.kind, stage)
        if moe:
            moved.append(("moe", _moe_layer(by_name, pre, stage, stage_width, tp, etp, ep, hidden, move, covered)))
    unit(["model.norm.weight"], "replicated", pp - 1)
    unit(["lm_head.weight"], "vocab", pp - 1)
    missing = [m.name for m in metadata if m.name not in covered]
    if missing:
        raise ValueError(
            f"layout='megatron': {len(missing)} checkpoint tensor(s) of this model are not modelled by the "
            f"planner (e.g. {missing[:3]}); its counts would be wrong, so it refuses"
        )
    # rank 0: the unit being yielded (its pieces + its outputs) and the units posted ahead (pieces or
    # outputs, while less than ahead_bytes is posted; never past a MoE layer), or an expert batch and
    # the tensors assembled from it
    peak = 0
    for k, (what, nbytes) in enumerate(moved):
        if what == "moe":
            peak = max(peak, 2 * nbytes)
            continue
        posted = largest = 0
        for what2, n2 in moved[k + 1:]:
            if what2 == "moe" or posted >= ahead_bytes:
                break
            posted, largest = posted + n2, max(largest, n2)
        # + one posted unit being concatenated on the helper thread (CPU): its pieces and outputs at once
        peak = max(peak, 2 * nbytes + posted + largest)
    r0.peak_extra_bytes = precast + peak
    return counts


def _moe_layer(by_name, pre: str, stage: int, width: int, tp: int, etp: int, ep: int, hidden: int, move,
               covered: set[str]) -> int:
    """A MoE layer's export to rank 0 (``MegatronMoEExporter``): router and its biases from the
    stage's lowest rank, each routed expert's ``etp`` fc1/fc2 pieces from its lowest holder, shared
    experts from each TP rank of the stage, the shared gate from the lowest rank."""
    base = stage * width
    for name in (pre + "mlp.gate.weight", pre + "mlp.gate.e_score_correction_bias", pre + "mlp.router.bias",
                 pre + "mlp.shared_expert_gate.weight"):
        if name in by_name:
            move(base, output_bytes(by_name[name].dtype, by_name[name].shape))
            covered.add(name)
    experts = [n for n in by_name if n.startswith(pre + "mlp.experts.")]
    if any("bias" in n for n in experts):
        raise ValueError(f"layout='megatron': routed experts with biases ({pre}mlp.experts.*bias*) are not modelled yet")
    covered.update(experts)
    per_expert = sorted({int(m.group(1)) for n in experts if (m := re.match(re.escape(pre) + r"mlp\.experts\.(\d+)\.", n))})
    if per_expert:
        E = len(per_expert)
        gate = by_name[f"{pre}mlp.experts.0.gate_proj.weight"]
        F, dtype = gate.shape[0], gate.dtype
    else:  # fused layout: experts.gate_up_proj [E, 2F, H]
        gu = by_name[pre + "mlp.experts.gate_up_proj"]
        E, F, dtype = gu.shape[0], gu.shape[1] // 2, gu.dtype
    e_local = E // ep
    one = 3 * F * hidden * dtype.itemsize  # one expert's gate, up and down
    batch = min(E * one, max(one, EXPERT_BATCH_BYTES // one * one))
    for e in range(E):
        k = e // e_local
        for r in range(etp):
            src = base + etp * k + r
            move(src, 2 * F // etp * hidden * dtype.itemsize)
            move(src, hidden * (F // etp) * dtype.itemsize)
    for shared in ("mlp.shared_expert.", "mlp.shared_experts."):
        gate = by_name.get(pre + shared + "gate_proj.weight")
        if gate is None:
            continue
        S = gate.shape[0]
        covered.update(pre + shared + f"{w}_proj.weight" for w in ("gate", "up", "down"))
        for r in range(tp):
            move(base + r, 2 * S // tp * hidden * gate.dtype.itemsize)
            move(base + r, hidden * (S // tp) * gate.dtype.itemsize)
    return batch
