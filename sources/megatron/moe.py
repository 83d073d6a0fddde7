"""Megatron-core MoE layers -> Hugging Face checkpoint tensors, gathered to rank 0 with bounded memory.

One MoE layer of a ``GPTModel`` exports: router weight, the router linear's bias (``add_bias_linear``:
GPT-OSS), router expert bias (a buffer), the routed experts with their biases if any (``per_expert``
or ``fused`` wire layout, ``sources/core/hf/experts.py``), shared experts and the shared-expert gate. Names come from ``HFMoENames`` (transformers' own reversal), layout math from
``experts.py`` / ``layout.py``; this file only knows where Megatron keeps each piece:

* routed experts live on the expert-parallel (EP) x expert-tensor-parallel (ETP) grid: global expert
  ``e = ep_rank * E_local + j``; each ETP rank holds rows ``[gate_r; up_r]`` of ``linear_fc1`` and
  columns ``r`` of ``linear_fc2``. Three storage formats:
  ``SequentialMLP`` ``local_experts.{j}.linear_fc{1,2}.weight``; ``TEGroupedMLP``
  ``linear_fc1.weight{j}`` / ``linear_fc2.weight{j}`` (same shapes); legacy ``GroupedMLP``
  ``weight1`` ``[H, E_local * 2F/etp]`` and ``weight2`` ``[E_local * F/etp, H]``, input-by-output
  (its forward views them as ``[E_local, H, 2F/etp]`` / ``[E_local, F/etp, H]``). Expert biases
  (``add_bias_linear``, which megatron-core allows only at ETP 1): ``linear_fc1.bias`` ``[2F]``
  (``[gate; up]`` like the rows) and ``linear_fc2.bias`` ``[H]`` per expert (TE: ``bias{j}``).
* router weight and expert bias are replicated over TP and EP; shared experts are split over the
  dense TP group like a dense MLP (``glu`` fc1, ``row`` fc2); the shared gate is replicated.

Invariants:

* Gather to the sender only: every piece travels point-to-point from the one rank that holds it (in
  rank 0's replica: lowest global rank with those coordinates) to rank 0, cast to the wire dtype
  first (``wire.WirePolicy``, as every source: routers, shared-expert gate and expert bias keep
  their own dtype), through the mover the dense path uses (``p2p.gather_to``, bounded by
  ``timeout_s``). Non-zero ranks yield nothing and never hold another rank's shard.
* Bounded memory on rank 0: experts move in batches of at most ``expert_batch_bytes``. ``per_expert``
  holds one batch at a time; ``fused`` holds one layer's fused pair (preallocated, filled per batch)
  plus one batch -- never a ``torch.stack`` of separately materialized experts.
* Every rank walks the same plan (layers, batches, pieces) in the same order, computed from configs
  and one cached exchange of parallel coordinates; so sends and receives pair up, and ``entries``
  (metadata) is collective-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.ground.errors import UnmappedParameterError
from ..core.hf.experts import (
    DEFAULT_EXPERT_BATCH_BYTES,
    ExpertLayout,
    FusedExpertBuffer,
    check_expert_layout,
    default_expert_layout,
    expert_batches,
)
from ..core.comm.waits import DEFAULT_TIMEOUT_S
from ..core.layouts.tp import GLU_LAYOUT, ROW
from ..core.ground.logs import get_logger
from .moe_names import HFMoELayer, HFMoENames
from ..core.comm.p2p import Piece, gather_to
from ..core.ground.stats import PassStats
from ..core.ground.dtype_policy import WirePolicy

__all__ = [
    "expert_format",
    "local_expert_biases",
    "local_expert_weights",
    "Coords",
    "MegatronMoEExporter",
    "megatron_moe_suffixes",
]

logger = get_logger(__name__)


# ---- reading one rank's pieces ------------------------------------------------------------------


def expert_format(experts: torch.nn.Module) -> str:
    """``"sequential"`` | ``"te_grouped"`` | ``"grouped"`` for a Megatron experts module."""
    if hasattr(experts, "local_experts"):
        return "sequential"
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
        return "grouped"
    fc1 = getattr(experts, "linear_fc1", None)
    if fc1 is not None and hasattr(fc1, "weight0"):
        return "te_grouped"
    raise UnmappedParameterError(
        f"unknown Megatron experts module {type(experts).__name__}: expected SequentialMLP "
        "(local_experts), TEGroupedMLP (linear_fc1.weight{j}) or GroupedMLP (weight1/weight2)"
    )


def local_expert_weights(experts: torch.nn.Module, j: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [2F/etp, H], fc2 [H, F/etp])`` of local expert ``j`` in ``[out, in]`` orientation.

    Views where the storage allows (no copy); legacy ``GroupedMLP`` pieces are transposed views.
    """
    fmt = expert_format(experts)
    if fmt == "sequential":
        e = experts.local_experts[j]
        return e.linear_fc1.weight, e.linear_fc2.weight
    if fmt == "te_grouped":
        return getattr(experts.linear_fc1, f"weight{j}"), getattr(experts.linear_fc2, f"weight{j}")
    n = experts.num_local_experts
    w1 = experts.weight1.view(n, hidden, -1)[j].t()  # [2F/etp, H]
    w2 = experts.weight2.view(n, -1, hidden)[j].t()  # [H, F/etp]
    return w1, w2


def local_expert_biases(experts: torch.nn.Module, j: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(fc1 bias [2F], fc2 bias [H])`` of local expert ``j`` (``add_bias_linear``), else Nones."""
    fmt = expert_format(experts)
    if fmt == "sequential":
        e = experts.local_experts[j]
        return e.linear_fc1.bias, e.linear_fc2.bias
    if fmt == "te_grouped":
        return getattr(experts.linear_fc1, f"bias{j}", None), getattr(experts.linear_fc2, f"bias{j}", None)
    return None, None  # legacy GroupedMLP: megatron-core builds it without biases


def megatron_moe_suffixes(num_local_experts: int, fmt: str) -> list[str]:
    """Layer-relative Megatron parameter names the exporter may read of one MoE MLP's routed experts
    (weights and, under ``add_bias_linear``, biases) and of its router's linear bias, for binding
    checks. A model without biases simply has no such parameters; the exporter checks that their
    presence matches the checkpoint (``hf_layer``)."""
    router = ["mlp.router.bias"]
    if fmt == "sequential":
        return router + [
            f"mlp.experts.local_experts.{j}.linear_fc{k}.{w}"
            for j in range(num_local_experts)
            for k in (1, 2)
            for w in ("weight", "bias")
        ]
    if fmt == "te_grouped":
        return router + [
            f"mlp.experts.linear_fc{k}.{w}{j}" for j in range(num_local_experts) for k in (1, 2) for w in ("weight", "bias")
        ]
    if fmt == "grouped":
        return router + ["mlp.experts.weight1", "mlp.experts.weight2"]
    raise ValueError(f"unknown expert format {fmt!r}")


def _expert_biases(fc1_bias: torch.Tensor, fc2_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(gate bias, up bias, down bias)`` of one expert (ETP 1: ``[gate; up]`` halves of fc1's)."""
    gate, up = torch.chunk(fc1_bias, 2, dim=0)
    return gate, up, fc2_bias


def _expert_full(fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Full ``(gate, up, down)`` of one expert from its ETP shards (``[gate_r; up_r]`` rows of fc1,
    column block ``r`` of fc2; ``layout.py``'s GLU/row invariants), with at most one copy each:
    with one shard, gate/up are contiguous row views and down is the shard itself (zero copy);
    with several, one ``torch.cat`` of views per output (``GLU_LAYOUT.concat`` would copy twice,
    which is what the per-expert memory bound cannot afford)."""
    if len(fc1) == 1:
        gate, up = torch.chunk(fc1[0], 2, dim=0)
        return gate, up, fc2[0].contiguous()
    halves = [torch.chunk(p, 2, dim=0) for p in fc1]
    return (
        torch.cat([h[0] for h in halves], dim=0),
        torch.cat([h[1] for h in halves], dim=0),
        torch.cat(fc2, dim=1),
    )


# ---- who holds what -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Coords:
    """One rank's Megatron coordinates (what the plan needs to find a piece's holder)."""

    rank: int
    pp: int
    tp: int
    ep: int
    etp: int

    @staticmethod
    def mine() -> Coords:
        from megatron.core import parallel_state as ps

        return Coords(
            rank=dist.get_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            tp=ps.get_tensor_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_rank(),
        )


def _moe_modules(chunks: list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """global layer (0-based, from ``layer_number``) -> local MoE MLP module (has ``.router``); the
    decoder layers of multi-token-prediction layers count too (megatron numbers them after the
    decoder's: ``num_layers + i``)."""
    out: dict[int, torch.nn.Module] = {}
    for chunk in chunks:
        mtp = getattr(getattr(chunk, "mtp", None), "layers", None) or []
        blocks = [getattr(m, "transformer_layer", None) for m in mtp]
        for layer in [*getattr(chunk.decoder, "layers", []), *[b for b in blocks if b is not None]]:
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and hasattr(mlp, "router") and hasattr(mlp, "experts"):
                out[int(layer.layer_number) - 1] = mlp
    return out


def _renamed(hf: HFMoELayer, layer: int, prefix: str) -> HFMoELayer:
    """``hf`` (decoder layer ``hf.layer``'s names) with ``model.layers.{hf.layer}.`` replaced by
    ``prefix``: a multi-token-prediction layer's MoE tensors, which transformers does not model."""
    import dataclasses

    old = f"model.layers.{hf.layer}."

    def one(entry: tuple[str, tuple[int, ...]] | None) -> tuple[str, tuple[int, ...]] | None:
        if entry is None:
            return None
        if not entry[0].startswith(old):
            raise UnmappedParameterError(f"MoE tensor {entry[0]!r} is not under {old!r}; cannot rename it to {prefix!r}")
        return prefix + entry[0][len(old):], entry[1]

    if not hf.experts.prefix.startswith(old):
        raise UnmappedParameterError(f"experts {hf.experts.prefix!r} are not under {old!r}; cannot rename them to {prefix!r}")
    return dataclasses.replace(
        hf,
        layer=layer,
        router=one(hf.router),
        router_bias=one(hf.router_bias),
        router_linear_bias=one(hf.router_linear_bias),
        experts=dataclasses.replace(hf.experts, prefix=prefix + hf.experts.prefix[len(old):]),
        shared=None if hf.shared is None else tuple(one(s) for s in hf.shared),
        shared_gate=one(hf.shared_gate),
    )


# ---- the exporter -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """One tensor moving to rank 0: who holds it and how rank 0 receives it."""

    src: int
    kind: str  # "router" | "rbias" | "bias" | "fc1" | "fc2" | "fc1b" | "fc2b" | "shared1" | "shared2" | "sgate"
    expert: int  # global expert (routed pieces), else -1
    shard: int  # ETP / TP shard index, else 0
    shape: tuple[int, ...]
    dtype: torch.dtype


class MegatronMoEExporter:
    """Everything MegatronSource needs for the MoE layers of one model.

    ``entries(layer)`` -- the layer's wire ``(name, shape, dtype)`` in stream order, from configs only.
    ``export(layer)`` -- run on every rank, in the same global layer order; yields ``(name, tensor)``
    on rank 0 only (full HF tensors, wire dtype, contiguous), nothing elsewhere.
    """

    def __init__(
        self,
        model: Any,
        hf_config: Any,
        mcfg: Any,
        *,
        expert_layout: ExpertLayout | None = None,
        dtype: torch.dtype | None = None,
        wire: WirePolicy | None = None,
        expert_batch_bytes: int = DEFAULT_EXPERT_BATCH_BYTES,
        stats: PassStats | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """``wire``: the source's wire-dtype policy (default: ``dtype``, else ``params_dtype``, with
        the default keep-fp32 names); ``timeout_s`` bounds every point-to-point wait."""
        from .walk import model_chunks

        #: the requested wire layout; None: each layer's checkpoint layout (``layout_of``)
        self.layout: ExpertLayout | None = check_expert_layout(expert_layout)
        if expert_batch_bytes <= 0:
            raise ValueError(f"expert_batch_bytes must be positive, got {expert_batch_bytes}")
        self.chunks = model_chunks(model)
        self.mcfg = mcfg
        self.names = HFMoENames(hf_config)
        self.wire = wire or WirePolicy.build(dtype or mcfg.params_dtype)
        self.timeout_s = timeout_s
        self.expert_batch_bytes = expert_batch_bytes
        self.stats = stats if stats is not None else PassStats()
        self.ep = mcfg.expert_model_parallel_size
        self.etp = mcfg.expert_tensor_parallel_size or mcfg.tensor_model_parallel_size
        self.tp = mcfg.tensor_model_parallel_size
        self.E = mcfg.num_moe_experts
        if self.E % self.ep:
            raise ValueError(f"num_moe_experts={self.E} is not divisible by expert_model_parallel_size={self.ep}")
        self.E_local = self.E // self.ep
        self.local = _moe_modules(self.chunks)
        self._coords: list[Coords] | None = None
        self._stage_of: dict[int, int] | None = None
        #: ``senders="owners"`` (``plan_owners``): layer -> its stage's sender (router, shared experts,
        #: fused experts), and (layer, ep rank) -> the rank sending those experts.
        self._layer_dst: dict[int, int] = {}
        self._expert_dst: dict[tuple[int, int], int] = {}
        #: (layer, ep rank) -> the rank whose experts go to ``_expert_dst`` (expert TP 1, ``plan_owners``)
        self._expert_src: dict[tuple[int, int], int] = {}
        #: layers with no transformers counterpart (multi-token prediction): layer -> (the decoder
        #: layer whose names and shapes it shares, the HF prefix its tensors carry instead)
        self.aliases: dict[int, tuple[int, str]] = {}

    def layout_of(self, spec: Any) -> ExpertLayout:
        return self.layout or default_expert_layout(spec)

    # -- metadata (no collective) ----------------------------------------------------------------
    def hf_layer(self, layer: int) -> HFMoELayer:
        if layer in self.aliases:
            return _renamed(self.hf_layer(self.aliases[layer][0]), layer, self.aliases[layer][1])
        hf = self.names.layer(layer)
        c = self.mcfg
        spec = hf.experts
        if (spec.num_experts, spec.hidden, spec.intermediate) != (self.E, c.hidden_size, c.moe_ffn_hidden_size):
            raise UnmappedParameterError(
                f"layer {layer}: hf_config experts (E={spec.num_experts}, hidden={spec.hidden}, "
                f"intermediate={spec.intermediate}) differ from Megatron's (num_moe_experts={self.E}, "
                f"hidden_size={c.hidden_size}, moe_ffn_hidden_size={c.moe_ffn_hidden_size})"
            )
        has_shared = bool(getattr(c, "moe_shared_expert_intermediate_size", None))
        if has_shared != (hf.shared is not None):
            raise UnmappedParameterError(
                f"layer {layer}: Megatron moe_shared_expert_intermediate_size="
                f"{getattr(c, 'moe_shared_expert_intermediate_size', None)} but the HF family "
                f"{'has' if hf.shared else 'has no'} shared experts"
            )
        if has_shared and hf.shared[0][1][0] != c.moe_shared_expert_intermediate_size:
            raise UnmappedParameterError(
                f"layer {layer}: shared expert size {hf.shared[0][1][0]} (hf_config) != "
                f"{c.moe_shared_expert_intermediate_size} (Megatron)"
            )
        if bool(getattr(c, "moe_shared_expert_gate", False)) != (hf.shared_gate is not None):
            raise UnmappedParameterError(
                f"layer {layer}: Megatron moe_shared_expert_gate={getattr(c, 'moe_shared_expert_gate', False)} "
                f"but the HF family {'has' if hf.shared_gate else 'has no'} shared_expert_gate"
            )
        if bool(getattr(c, "moe_router_enable_expert_bias", False)) != (hf.router_bias is not None):
            raise UnmappedParameterError(
                f"layer {layer}: Megatron moe_router_enable_expert_bias="
                f"{getattr(c, 'moe_router_enable_expert_bias', False)} but the HF family "
                f"{'has' if hf.router_bias else 'has no'} e_score_correction_bias"
            )
        biased = bool(getattr(c, "add_bias_linear", False))  # megatron: router and expert linears alike
        if biased != (hf.router_linear_bias is not None) or biased != spec.bias:
            raise UnmappedParameterError(
                f"layer {layer}: Megatron add_bias_linear={biased} (router and expert biases) but the HF "
                f"checkpoint has {'a' if hf.router_linear_bias else 'no'} router bias and "
                f"{'biased' if spec.bias else 'unbiased'} experts"
            )
        if spec.bias and self.etp != 1:
            raise UnmappedParameterError(
                f"layer {layer}: expert biases with expert_tensor_parallel_size={self.etp} (megatron-core "
                "supports MoE biases at expert_tensor_parallel_size=1 only)"
            )
        return hf

    def _wd(self, names: list[str], own: torch.dtype | None = None) -> torch.dtype:
        """Wire dtype of tensors Megatron holds as one (an expert's fc1 is gate and up): the policy's
        dtype for a tensor built in ``own`` (default ``params_dtype``; the expert bias is fp32)."""
        got = {self.wire.dtype_for(n, own or self.mcfg.params_dtype) for n in names}
        if len(got) > 1:
            raise ValueError(
                f"keep_fp32= keeps some but not all of {names[:4]}, which Megatron holds as one tensor; "
                "match all of them or none"
            )
        return got.pop()

    def dtypes(self, hf: HFMoELayer) -> dict[str, torch.dtype]:
        """Wire dtype per role of one layer: router, bias, experts, shared, sgate."""
        out = {"router": self._wd([hf.router[0]])}
        if hf.router_linear_bias is not None:
            out["rbias"] = self._wd([hf.router_linear_bias[0]])
        if hf.router_bias is not None:
            out["bias"] = self._wd([hf.router_bias[0]], torch.float32)
        out["experts"] = self._wd([n for n, _ in hf.experts.entries(self.layout_of(hf.experts))])
        if hf.shared is not None:
            out["shared"] = self._wd([n for n, _ in hf.shared])
        if hf.shared_gate is not None:
            out["sgate"] = self._wd([hf.shared_gate[0]])
        return out

    def entries(self, layer: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        hf = self.hf_layer(layer)
        wd = self.dtypes(hf)
        out = [(hf.router[0], hf.router[1], wd["router"])]
        if hf.router_linear_bias is not None:
            out.append((hf.router_linear_bias[0], hf.router_linear_bias[1], wd["rbias"]))
        if hf.router_bias is not None:
            out.append((hf.router_bias[0], hf.router_bias[1], wd["bias"]))
        out += [(n, s, wd["experts"]) for n, s in hf.experts.entries(self.layout_of(hf.experts))]
        if hf.shared is not None:
            out += [(n, s, wd["shared"]) for n, s in hf.shared]
        if hf.shared_gate is not None:
            out.append((hf.shared_gate[0], hf.shared_gate[1], wd["sgate"]))
        return out

    # -- who sends what (``senders="owners"``; default: rank 0 sends everything) --------------------
    def spreadable(self, layers: list[int]) -> bool:
        """Whether routed experts can leave from a rank holding them whole (expert TP 1, per-expert
        wire layout); otherwise they are gathered by replica 0's stage sender, and the dense units
        stay with replica 0 too, so that no rank serves two senders (``core/comm/senders.py``)."""
        return self.etp == 1 and all(self.layout_of(self.hf_layer(L).experts) != "fused" for L in layers)

    def plan_owners(self, stage_of: dict[int, int], topo: Any, *, spread: bool) -> None:
        """Choose the sender of every MoE tensor (``core/comm/senders.py`` says why each rule):

        * router, its biases, shared experts and gate: replica 0's stage sender (the stage's first
          rank), gathered from its TP peers as before;
        * routed experts of EP rank ``k`` with ``spread`` (expert TP 1, per-expert layout): the lowest
          rank holding them that is a stage sender of its own replica (``topo.replicas``: its TP
          group's first rank), so experts leave from where they live; when every holder is another
          rank's TP peer, the lowest holder sends them to its own replica's stage sender -- the
          sender it already serves, so it serves one sender only.
        * without ``spread`` (expert TP > 1, or the fused layout: one tensor for all experts):
          replica 0's stage sender gathers them, as with ``senders="rank0"``.

        Collective (one cached exchange of coordinates): call on every rank, at construction."""
        self._placement()
        assert self._coords is not None
        replica_of = {r: i for i, g in enumerate(topo.replicas) for row in g for r in row}
        for layer, stage in stage_of.items():
            first = topo.stage_ranks(stage)[0]
            self._layer_dst[layer] = first
            for k in range(self.ep):
                if not spread:
                    self._expert_dst[(layer, k)] = first
                    continue
                holders = [c.rank for c in self._coords if c.pp == stage and c.ep == k and c.etp == 0]
                senders = [h for h in holders if topo.stage_ranks(stage, replica_of[h])[0] == h]
                src = senders[0] if senders else holders[0]
                self._expert_dst[(layer, k)] = topo.stage_ranks(stage, replica_of[src])[0]
                self._expert_src[(layer, k)] = src

    def _dst(self, layer: int, expert: int = -1) -> int:
        """The rank that sends ``layer``'s tensor (``expert``: a routed expert's; -1: the rest)."""
        if expert < 0:
            return self._layer_dst.get(layer, 0)
        return self._expert_dst.get((layer, expert // self.E_local), self._layer_dst.get(layer, 0))

    def entry_senders(self, layer: int) -> list[int]:
        """The sending rank of each of ``entries(layer)``, in the same order (no collective after
        ``plan_owners``; all 0 without it)."""
        hf = self.hf_layer(layer)
        spec = hf.experts
        experts = spec.entries(self.layout_of(spec))
        head = 1 + (hf.router_linear_bias is not None) + (hf.router_bias is not None)
        tail = (len(hf.shared) if hf.shared is not None else 0) + (hf.shared_gate is not None)
        if self.layout_of(spec) == "fused":
            per_expert = None
        else:
            per_expert, rest = divmod(len(experts), self.E)
            assert rest == 0, (len(experts), self.E)
        out = [self._dst(layer)] * head
        out += [self._dst(layer) if per_expert is None else self._dst(layer, i // per_expert) for i in range(len(experts))]
        return out + [self._dst(layer)] * tail

    # -- placement (one cached exchange) ---------------------------------------------------------
    def _placement(self) -> None:
        if self._coords is not None:
            return
        from ..core.check.stream import control_group

        mine = Coords.mine()
        coords: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(coords, mine, group=control_group())
        self.stats.collectives += 1
        stage_of: dict[int, int] = {}
        for lay in self.local:
            stage_of[lay] = mine.pp
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(self.local), group=control_group())
        self.stats.collectives += 1
        for c, layers in zip(coords, gathered):
            for lay in layers:
                stage_of.setdefault(lay, c.pp)
        self._coords, self._stage_of = coords, stage_of

    def _holder(self, layer: int, **want: int) -> int:
        assert self._coords is not None and self._stage_of is not None
        if layer not in self._stage_of:
            raise UnmappedParameterError(f"MoE layer {layer} is held by no rank (expected from Megatron config)")
        stage = self._stage_of[layer]
        for c in self._coords:  # sorted by rank: the lowest rank is in rank 0's replica
            if c.pp == stage and all(getattr(c, k) == v for k, v in want.items()):
                return c.rank
        raise RuntimeError(f"no rank holds layer {layer} with coordinates {want}")

    # -- export (collective over all ranks) ------------------------------------------------------
    def export(self, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
        self._placement()
        hf = self.hf_layer(layer)
        wd = self.dtypes(hf)
        mlp = self.local.get(layer)
        # router weight / expert bias / shared gate: replicated, sent by the lowest holder.
        src = self._holder(layer)

        dst = self._dst(layer)

        def one(kind: str, entry: tuple[str, tuple[int, ...]], dtype: torch.dtype):
            return self._move(
                [_Piece(src, kind, -1, 0, entry[1], dtype)], mlp, f"layer {layer}'s {entry[0]!r}",
                lambda ps, ts: [(entry[0], ts[0])], dst=dst,
            )

        yield from one("router", hf.router, wd["router"])
        if hf.router_linear_bias is not None:
            yield from one("rbias", hf.router_linear_bias, wd["rbias"])
        if hf.router_bias is not None:
            yield from one("bias", hf.router_bias, wd["bias"])
        yield from self._export_experts(layer, hf, mlp, wd["experts"])
        if hf.shared is not None:
            yield from self._export_shared(layer, hf, mlp, wd["shared"])
        if hf.shared_gate is not None:
            yield from one("sgate", hf.shared_gate, wd["sgate"])

    def _export_experts(
        self, layer: int, hf: HFMoELayer, mlp: torch.nn.Module | None, wd: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The routed experts of ``layer``, in batches of at most ``expert_batch_bytes``."""
        H, F = self.mcfg.hidden_size, self.mcfg.moe_ffn_hidden_size
        spec = hf.experts
        buf = None
        if self.layout_of(spec) == "fused" and dist.get_rank() == self._dst(layer):
            buf = FusedExpertBuffer(spec, wd, device=self._device(mlp))
            self.stats.hold(buf.nbytes)
        for batch in self._batches(layer, spec.expert_bytes(wd)):
            dst = self._dst(layer, batch[0])
            pieces = []
            for e in batch:
                ep_rank, _ = divmod(e, self.E_local)
                for r in range(self.etp):
                    h = self._expert_src.get((layer, ep_rank)) if self.etp == 1 else None
                    h = self._holder(layer, ep=ep_rank, etp=r) if h is None else h  # (plan_owners)
                    pieces.append(_Piece(h, "fc1", e, r, (2 * F // self.etp, H), wd))
                    pieces.append(_Piece(h, "fc2", e, r, (H, F // self.etp), wd))
                if spec.bias:  # ETP 1 (hf_layer): one holder
                    h = self._holder(layer, ep=ep_rank, etp=0)
                    pieces.append(_Piece(h, "fc1b", e, 0, (2 * F,), wd))
                    pieces.append(_Piece(h, "fc2b", e, 0, (H,), wd))

            def assemble(ps: list[_Piece], ts: list[torch.Tensor], batch=batch):
                out = []
                n = 2 * self.etp + (2 if spec.bias else 0)
                for k, e in enumerate(batch):
                    mine = ts[k * n : (k + 1) * n]
                    gate, up, down = _expert_full(mine[0 : 2 * self.etp : 2], mine[1 : 2 * self.etp : 2])
                    biases = _expert_biases(mine[-2], mine[-1]) if spec.bias else None
                    if buf is not None:
                        buf.put(e, gate, up, down, biases)
                    else:
                        out += spec.expert_tensors(e, gate, up, down, biases)
                return out

            what = f"layer {layer}'s experts {batch[0]}..{batch[-1]}"
            yield from self._move(pieces, mlp, what, assemble, dst=dst)
        if buf is not None:
            for name, t in buf.take():
                self.stats.yielded(t.nbytes)
                yield name, t
            self.stats.hold(-buf.nbytes)

    def _export_shared(
        self, layer: int, hf: HFMoELayer, mlp: torch.nn.Module | None, wd: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The shared experts of ``layer``: split over the dense TP group like a dense GLU MLP."""
        H = self.mcfg.hidden_size
        S = hf.shared[0][1][0]
        pieces = []
        for r in range(self.tp):
            h = self._holder(layer, tp=r)
            pieces.append(_Piece(h, "shared1", -1, r, (2 * S // self.tp, H), wd))
            pieces.append(_Piece(h, "shared2", -1, r, (H, S // self.tp), wd))

        def assemble_shared(ps, ts):
            gate, up = GLU_LAYOUT.concat(ts[0::2])
            (down,) = ROW.concat(ts[1::2])
            return [(hf.shared[0][0], gate), (hf.shared[1][0], up), (hf.shared[2][0], down)]

        yield from self._move(pieces, mlp, f"layer {layer}'s shared experts", assemble_shared, dst=self._dst(layer))

    # -- moving pieces ---------------------------------------------------------------------------
    @staticmethod
    def _device(mlp: torch.nn.Module | None) -> torch.device:
        if mlp is None:
            return torch.device("cpu")
        return next(mlp.router.parameters()).device

    def _local_piece(self, mlp: torch.nn.Module, p: _Piece, *, own_dtype: bool = False) -> torch.Tensor:
        """This rank's tensor of ``p`` (shape checked) in ``p.dtype``, contiguous; ``own_dtype``: a
        floating tensor as Megatron holds it (``iter_pieces``: its consumer casts, ``core/layouts/pieces.py``)."""
        from megatron.core import parallel_state as ps

        if p.kind == "router":
            t = mlp.router.weight
        elif p.kind == "rbias":
            t = mlp.router.bias
        elif p.kind == "bias":
            t = mlp.router.expert_bias
        elif p.kind in ("fc1", "fc2"):
            j = p.expert - ps.get_expert_model_parallel_rank() * self.E_local
            fc1, fc2 = local_expert_weights(mlp.experts, j, self.mcfg.hidden_size)
            t = fc1 if p.kind == "fc1" else fc2
        elif p.kind in ("fc1b", "fc2b"):
            j = p.expert - ps.get_expert_model_parallel_rank() * self.E_local
            fc1b, fc2b = local_expert_biases(mlp.experts, j)
            t = fc1b if p.kind == "fc1b" else fc2b
            if t is None:
                raise UnmappedParameterError(
                    f"rank {dist.get_rank()}: Megatron expert {p.expert} has no {p.kind[:3]} bias "
                    f"({type(mlp.experts).__name__}), the checkpoint's experts have biases"
                )
        elif p.kind == "shared1":
            t = mlp.shared_experts.linear_fc1.weight
        elif p.kind == "shared2":
            t = mlp.shared_experts.linear_fc2.weight
        else:
            t = mlp.shared_experts.gate_weight
        if tuple(t.shape) != p.shape:
            raise UnmappedParameterError(
                f"rank {dist.get_rank()}: Megatron {p.kind} piece (expert {p.expert}, shard {p.shard}) "
                f"has shape {tuple(t.shape)}, expected {p.shape} from the config"
            )
        if own_dtype and t.is_floating_point() and p.dtype.is_floating_point:
            return t.detach()
        return t.detach().to(p.dtype).contiguous()

    def _batches(self, layer: int, expert_bytes: int) -> list[range]:
        """``expert_batches`` of the layer's experts, cut where the sending rank changes."""
        out: list[range] = []
        for batch in expert_batches(self.E, expert_bytes, self.expert_batch_bytes):
            start = batch[0]
            for e in batch[1:]:
                if self._dst(layer, e) != self._dst(layer, start):
                    out.append(range(start, e))
                    start = e
            out.append(range(start, batch[-1] + 1))
        return out

    def _move(self, pieces: list[_Piece], mlp, what: str, assemble, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """Send this rank's pieces to ``dst`` (``p2p.gather_to``); on ``dst`` assemble and yield."""
        ts = gather_to(
            [Piece(p.src, p.shape, p.dtype) for p in pieces], dst,
            local=lambda i: self._local_piece(mlp, pieces[i]), device=self._device(mlp),
            timeout_s=self.timeout_s, what=what, stats=self.stats,
        )
        if ts is None:
            return
        held = sum(t.nbytes for t in ts)
        self.stats.hold(held)
        out = assemble(pieces, ts)
        storages = {x.untyped_storage().data_ptr() for x in ts}
        made = sum(t.nbytes for _, t in out if t.untyped_storage().data_ptr() not in storages)
        self.stats.hold(made)
        for name, t in out:
            self.stats.yielded(t.nbytes)
            yield name, t
        del out, ts
        self.stats.hold(-held - made)
