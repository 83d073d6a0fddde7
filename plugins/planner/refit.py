"""``plan(...)``: what one refit of a model moves and costs, before anyone runs it.

Invariant: nothing here runs a collective, allocates a weight or needs a process group. The model is
built on the meta device from its config (a preset of ``plugins/testbed/presets.py`` or a ``config.json``);
the checkpoint tensors, their wire dtypes and shapes are ``FSDPSource(model).metadata`` (and
``FP8Source``'s over it for FP8) -- the sources' own metadata code, run in one process. What the
layout adds (gathers, point-to-point pieces, per-rank bytes) follows the sources' documented rules
(``counts.py``); ``tests/test_plan.py`` holds every count against a real pass of the same model and
layout. Times multiply those counts by ``constants.py``, and a plan lists every assumption and
every extrapolation it made.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .constants import Constant, constant
from .counts import RankCounts, fsdp_counts, fsdp_items, megatron_counts, output_bytes
from .units import human_bytes

__all__ = ["plan", "RefitPlan", "SourcePlan", "BACKENDS", "DEFAULT_WIRE_GBPS"]

BACKENDS = ("ipc", "nccl", "sparse")
#: The trainer -> inference link of one sender when the caller gives none: one 200 Gb/s NIC.
DEFAULT_WIRE_GBPS = 25.0
#: The largest GPU refit behind the constants, per backend (tensors, bytes per sender): IPC from the
#: session-12 real-size runs, the rest from the Qwen3-1.7B runs (constants.py names both). A refit more
#: than 10x beyond them gets a note saying the estimate extrapolates.
_MEASURED = {"ipc": (4_719, 16_384_000_000)}
_MEASURED_DEFAULT = (310, 3_441_149_952)


@dataclass
class SourcePlan:
    """One source of the stack (innermost first): the checkpoint tensors and bytes one refit delivers
    (``tensors``, ``bytes``), what each sending rank sends, and per rank what ``PassStats`` would
    report."""

    source: str
    tensors: int
    bytes: int
    bytes_per_sender: dict[int, int]
    per_rank: dict[int, RankCounts]

    def roles(self) -> list[tuple[list[int], RankCounts]]:
        """Ranks grouped by identical counts, in rank order (a 64-rank FSDP world is one row)."""
        rows: dict[tuple, list[int]] = {}
        keep: dict[tuple, RankCounts] = {}
        for r in sorted(self.per_rank):
            key = tuple(self.per_rank[r].as_dict().values())
            rows.setdefault(key, []).append(r)
            keep[key] = self.per_rank[r]
        return [(ranks, keep[k]) for k, ranks in rows.items()]

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "tensors": self.tensors, "bytes": self.bytes,
            "bytes_per_sender": {str(k): v for k, v in self.bytes_per_sender.items()},
            "per_rank": [{"ranks": ranks, **c.as_dict()} for ranks, c in self.roles()],
        }


@dataclass
class RefitPlan:
    """A refit's prediction: the model, the layout and backend, each source's counts, and a time
    split into trainer gathers, per-tensor host work, wire, receiver apply (+ quantize / diff)."""

    model: str
    parameters: int
    layout: dict[str, Any]
    backend: dict[str, Any]
    sources: list[SourcePlan]
    time_s: dict[str, float]
    constants: list[Constant]
    notes: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(self.time_s.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "parameters": self.parameters, "layout": self.layout, "backend": self.backend,
            "sources": [s.as_dict() for s in self.sources],
            "time_s": {**self.time_s, "total": self.total_s},
            "constants": [c.as_dict() for c in self.constants],
            "notes": self.notes,
        }


def _pos(name: str, value: Any, *, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"{name}= must be a {'non-negative' if zero else 'positive'} int, got {value!r}")
    return value


def _config(model: Any) -> tuple[str, Any]:
    """``(label, transformers config)`` of a preset name, a config.json (file or folder) or a config."""
    from ..testbed.presets import PRESETS, load_config

    if not isinstance(model, str):
        if not hasattr(model, "model_type"):
            raise TypeError(f"model= must be a preset name, a config.json path or a transformers config, got {type(model).__name__}")
        return type(model).__name__, model
    if model in PRESETS:
        return model, load_config(model, None)
    if os.path.exists(model):
        config = load_config(None, model)
        return f"{model} ({config.model_type})", config
    raise ValueError(f"model={model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path to a config.json")


def _meta_model(config: Any, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)


def plan(
    model: Any,
    *,
    layout: str = "fsdp",
    world: int | None = None,
    replicas: int = 1,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    backend: str = "nccl",
    senders: str = "rank0",
    changed: float | None = None,
    fp8: bool = False,
    dtype: str | None = "bfloat16",
    expert_layout: str | None = None,
    device: str = "gpu",
    wire_gbps: float | None = None,
    gather_gbps: float | None = None,
    group_bytes: int | None = 64 << 20,
    ipc_packed: bool = False,
) -> RefitPlan:
    """Predict one refit of ``model`` (a preset name, a config.json file or folder, or a transformers
    config) from a trainer in ``layout`` into vLLM over ``backend``.

    Args:
        layout: ``"fsdp"`` (FSDP2 over ``world`` ranks; HSDP with ``replicas`` > 1: ``world`` =
            replicas x shard ranks) or ``"megatron"`` (``tp`` / ``pp`` / ``vpp`` / ``ep``;
            ``world`` defaults to tp x pp x ep, more ranks are data-parallel replicas).
        backend: ``"ipc"`` (colocated: every trainer rank hands its GPU's engine the full tensors),
            ``"nccl"`` (``senders="rank0"``: one sender; ``"owners"``: each HSDP replica's first rank)
            or ``"sparse"`` (vLLM's ``sparse_nccl``: ``DeltaSource`` rounds, ``changed`` the fraction
            of elements that changed since the last round).
        fp8: wrap the source in ``FP8Source`` (block-FP8 weights + ``weight_scale_inv``).
        dtype: the wire dtype (``None``: the model's own, fp32 on the meta device).
        device: ``"gpu"`` or ``"cpu"``: which constants the time estimate uses.
        wire_gbps: GB/s of one sender's link to the inference engines (default ``DEFAULT_WIRE_GBPS``,
            an assumption the plan says it made); ``gather_gbps``: the trainer's gather bandwidth.
        ipc_packed: ``backend="ipc"`` with vLLM's packed buffers (default False, vLLM's default: one
            IPC handle per tensor).
    Raises ``ValueError`` naming the argument for a layout or backend it cannot plan.
    """
    import torch

    if layout not in ("fsdp", "megatron"):
        raise ValueError(f"layout= must be 'fsdp' or 'megatron', got {layout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend= must be one of {BACKENDS}, got {backend!r}")
    if senders not in ("rank0", "owners"):
        raise ValueError(f"senders= must be 'rank0' or 'owners', got {senders!r}")
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device= must be 'gpu' or 'cpu', got {device!r}")
    for n, v in (("replicas", replicas), ("tp", tp), ("pp", pp), ("ep", ep)):
        _pos(n, v)
    vpp = 1 if vpp is None else _pos("vpp", vpp)
    if backend == "sparse":
        if changed is None or not (0.0 <= float(changed) <= 1.0):
            raise ValueError(f"changed= must be a fraction in [0, 1] with backend='sparse', got {changed!r}")
        if senders != "rank0":
            raise ValueError("senders='owners' with backend='sparse': vLLM's sparse_nccl has a single sender")
    if senders == "owners" and backend != "nccl":
        raise ValueError(f"senders='owners' needs backend='nccl' (vLLM 0.34's many senders), got backend={backend!r}")
    if layout == "megatron" and senders == "owners":
        raise ValueError("senders='owners' is planned for FSDP/HSDP only; MegatronSource(senders='owners') is not modelled yet")
    if layout == "megatron" and backend == "ipc":
        raise ValueError("backend='ipc' needs every rank to own every tensor; MegatronSource(mode='full') sends from rank 0 only")
    wd = None if dtype is None else getattr(torch, dtype, None)
    if dtype is not None and not isinstance(wd, torch.dtype):
        raise ValueError(f"dtype= must name a torch dtype such as 'bfloat16', got {dtype!r}")

    if layout == "fsdp":
        world = 1 if world is None else _pos("world", world)
        if world % replicas:
            raise ValueError(f"world={world} is not a multiple of replicas={replicas} (HSDP: replicas x shard ranks)")
    else:
        world = tp * pp * ep if world is None else _pos("world", world)
        if world % (tp * pp * ep):
            raise ValueError(f"world={world} is not a multiple of tp*pp*ep={tp * pp * ep}")
    label, config = _config(model)
    if layout == "megatron":
        from ..testbed.layout_rules import check_megatron_layout, facts_of

        # the rules ``weightsync check`` applies: a layout that cannot exist is refused, never planned
        check_megatron_layout(facts_of(config), tp=tp, pp=pp, vpp=None if vpp == 1 else vpp, ep=ep, world=world,
                              world_flag="world", spelling="kwargs")
    from weightsync.sources import FSDPSource

    # fp32, as trainers hold master weights: tensors that keep their own dtype on the wire (MoE routers)
    # travel in fp32, the rest in ``dtype``
    meta = _meta_model(config, torch.float32)
    base = FSDPSource(meta, dtype=wd, expert_layout=expert_layout, group_bytes=group_bytes, check=False, agree=False)
    parameters = sum(math.prod(p.shape) for p in meta.parameters())
    notes: list[str] = []

    if layout == "fsdp":
        shard = world // replicas
        per_rank = fsdp_counts(fsdp_items(base, meta), shard=shard, replicas=replicas, senders=senders,
                               group_bytes=group_bytes, device=device)
        inner = "FSDPSource" if replicas == 1 else "FSDPSource (HSDP)"
        lay = {"kind": "fsdp", "world": world, "replicas": replicas, "shard": shard,
               "units": "each decoder layer + the root"}
    else:
        from weightsync.sources.toolkit import family_for

        family = family_for(config)
        if family.hybrid is not None or family.attention != "dense":
            raise ValueError(f"layout='megatron': plan models fused-QKV families; {family.name} is not modelled yet")
        per_rank = megatron_counts(base.metadata, hf_config=config, layer_keys=family.layer_keys(config),
                                   tp=tp, pp=pp, vpp=vpp, ep=ep, world=world,
                                   ahead_bytes=(128 if device == "gpu" else 64) << 20)
        inner = "MegatronSource"
        lay = {"kind": "megatron", "world": world, "tp": tp, "pp": pp, "vpp": vpp, "ep": ep,
               "dp": world // (tp * pp)}

    if senders == "owners":
        firsts = [r * (world // replicas) for r in range(replicas)]
        per_sender = {r: per_rank[r].bytes for r in firsts}
    elif backend == "ipc":
        per_sender = {r: c.bytes for r, c in per_rank.items()}
    else:
        per_sender = {0: per_rank[0].bytes}
    sources = [_source_plan(inner, per_rank, per_sender, many=senders == "owners")]
    metas = list(base.metadata)
    dense_bytes = sum(output_bytes(m.dtype, m.shape) for m in metas)
    out_metas, quant_in = metas, 0
    if fp8:
        from weightsync.sources import FP8Source

        out_metas = list(FP8Source(base, check=False).metadata)
        by_name = {m.name: m for m in out_metas}
        scaled = {m.name for m in metas if m.name.endswith(".weight") and m.name[: -len(".weight")] + ".weight_scale_inv" in by_name}
        quant_in = sum(output_bytes(m.dtype, m.shape) for m in metas if m.name in scaled)
        owned = _owned_names(base, meta, metas, per_rank, layout=layout, replicas=replicas, senders=senders)
        fp8_rank = {}
        for r, c in per_rank.items():
            outs = [by_name[n] for n in owned[r]] + [by_name[n[: -len(".weight")] + ".weight_scale_inv"] for n in owned[r] if n in scaled]
            fp8_rank[r] = RankCounts(len(outs), sum(output_bytes(m.dtype, m.shape) for m in outs),
                                     c.collectives, c.bytes_received, c.peak_extra_bytes)
        sources.append(_source_plan("FP8Source", fp8_rank, {r: fp8_rank[r].bytes for r in per_sender},
                                    many=senders == "owners"))
    top = sources[-1]
    if backend == "sparse":
        elements = sum(math.prod(m.shape) for m in out_metas)
        changed_elements = round(float(changed) * elements)
        wire = round(float(changed) * sum(math.prod(m.shape) * (4 + m.dtype.itemsize) for m in out_metas))
        tensors = top.tensors if changed_elements else 0
        sources.append(SourcePlan(f"DeltaSource({top.source})", tensors, wire, {0: wire},
                                  {0: RankCounts(tensors=tensors, bytes=wire)}))
        notes.append(f"sparse: {changed_elements:,} of {elements:,} elements changed ({float(changed):.2%}), spread over "
                     "every tensor; wire = an int32 index + the value per changed element (docs/evidence.md: 6.00 bytes "
                     "per element in bf16); the round's trainer-side exchanges are not counted")

    time_s, used = _estimate(sources, per_rank, backend=backend, senders=senders, layout=layout, device=device, fp8=fp8,
                             quant_in=quant_in, dense_bytes=dense_bytes, world=world,
                             wire_gbps=wire_gbps, gather_gbps=gather_gbps, notes=notes, ipc_packed=ipc_packed)
    if wire_gbps is None and backend != "ipc":
        notes.append(f"wire: {DEFAULT_WIRE_GBPS} GB/s per sender assumed (one 200-gigabit NIC); pass wire_gbps / --wire-gbps")
    mt, mb = _MEASURED.get(backend, _MEASURED_DEFAULT)
    if device == "gpu" and (top.tensors > 10 * mt or top.bytes > 10 * mb):
        notes.append(f"outside what was measured: the GPU per-tensor and copy constants come from one GPU, "
                     f"up to {mt:,} tensors, {human_bytes(mb)}; this refit is {top.tensors:,} tensors, "
                     f"{human_bytes(top.bytes)} per sender (extrapolated linearly)")
    bk = {"kind": backend, "senders": senders, "fp8": fp8, "changed": changed, "wire_dtype": str(wd).removeprefix("torch."),
          "device": device, "wire_gbps": wire_gbps or DEFAULT_WIRE_GBPS, "expert_layout": expert_layout}
    return RefitPlan(label if isinstance(model, str) else getattr(config, "model_type", label), parameters, lay, bk,
                     sources, time_s, used, notes)


def _estimate(sources, per_rank, *, backend, senders, layout, device, fp8, quant_in, dense_bytes, world, wire_gbps,
              gather_gbps, notes, ipc_packed=False) -> tuple[dict[str, float], list[Constant]]:
    """Seconds per part: a serial sum (the sources overlap gathers with the consumer by default,
    so the total is an upper estimate)."""
    used: dict[str, Constant] = {}

    def c(name: str) -> float:
        k = constant(name)
        used[name] = k
        return k.value

    gpu = device == "gpu"
    top = sources[-1]
    inner = sources[0]
    cpu_megatron = not gpu and layout == "megatron"
    gather_rate = gather_gbps * 1e9 if gather_gbps else c(
        "gather_rate" if gpu else ("cpu_megatron_p2p_rate" if cpu_megatron else "cpu_gather_rate"))
    worst = max(per_rank.values(), key=lambda r: (r.bytes_received, r.collectives))
    t: dict[str, float] = {}
    t["trainer_gathers"] = worst.bytes_received / gather_rate + worst.collectives * c(
        "collective_latency" if gpu else "cpu_collective_latency")
    ipc_kind = "ipc_packed" if ipc_packed else "ipc_unpacked"
    if gpu and backend == "ipc":
        # fitted engine to engine with FSDPSource as the source: its own per-tensor work is inside
        per_tensor, engine = 0.0, c(f"{ipc_kind}_per_tensor")
    else:
        per_tensor = c(("megatron_source_per_tensor" if layout == "megatron" else "fsdp_source_per_tensor")
                       if gpu else ("cpu_megatron_per_tensor" if cpu_megatron else "cpu_source_per_tensor"))
        engine = c("nccl_per_tensor") if gpu else 0.0
    # senders work in parallel: the busiest one's tensors
    t["host_per_tensor"] = _sender_tensors(inner) * per_tensor + _sender_tensors(top) * engine
    if fp8:
        t["quantize"] = quant_in / len(inner.bytes_per_sender if senders == "owners" else [0]) / c("fp8_quantize_rate" if gpu else "cpu_quantize_rate")
    wire_rate = (wire_gbps or DEFAULT_WIRE_GBPS) * 1e9
    copy = c("d2d_copy_rate" if gpu else "cpu_copy_rate")
    sender_bytes = max(top.bytes_per_sender.values()) if top.bytes_per_sender else 0
    if backend == "ipc":
        t["wire"] = sender_bytes / (c(f"{ipc_kind}_rate") if gpu else copy)
        t["receiver_apply"] = 0.0 if gpu else _sender_tensors(top) * c("cpu_apply_per_tensor")
        if gpu:
            notes.append(f"ipc ({'packed' if ipc_packed else 'unpacked'}): the source's and the receiver's work are "
                         f"inside {ipc_kind}_per_tensor and {ipc_kind}_rate (fitted engine to engine with FSDPSource)")
    elif backend == "sparse":
        t["diff"] = dense_bytes / world / c("delta_diff_rate" if gpu else "cpu_diff_rate")
        t["wire"] = sender_bytes / wire_rate
        t["receiver_apply"] = dense_bytes / c("sparse_apply_rate" if gpu else "cpu_copy_rate")
    else:
        t["wire"] = sender_bytes / wire_rate
        t["receiver_apply"] = _sender_tensors(top) * c("apply_per_tensor" if gpu else "cpu_apply_per_tensor") + sender_bytes / copy
    return t, list(used.values())


def _sender_tensors(src: SourcePlan) -> int:
    return max((src.per_rank[r].tensors for r in src.bytes_per_sender if r in src.per_rank), default=src.tensors)


def _source_plan(name: str, per_rank: dict[int, RankCounts], per_sender: dict[int, int], *, many: bool) -> SourcePlan:
    """The refit's totals: with many senders, the sum of what each sends (each tensor once); with one
    sender (or IPC, where every rank hands its own engine the whole checkpoint) what one sends."""
    if many:
        return SourcePlan(name, sum(per_rank[r].tensors for r in per_sender), sum(per_sender.values()), per_sender, per_rank)
    first = next(iter(per_sender))
    return SourcePlan(name, per_rank[first].tensors, per_rank[first].bytes, per_sender, per_rank)


def _owned_names(base, meta, metas, per_rank, *, layout, replicas, senders) -> dict[int, list[str]]:
    """The checkpoint names each rank yields: every name on every FSDP rank (one sender) or on
    Megatron's rank 0; with ``senders="owners"`` each HSDP replica's run (``counts.contiguous_bins``)."""
    from .counts import contiguous_bins

    every = [m.name for m in metas]
    if senders != "owners":
        return {r: (every if (layout == "fsdp" or r == 0) else []) for r in per_rank}
    items = fsdp_items(base, meta)
    bins = contiguous_bins([it.wire_bytes for it in items], replicas)
    shard = len(per_rank) // replicas
    return {r: [n for it, b in zip(items, bins) if b == r // shard for n, _, _ in it.outputs] for r in per_rank}
