"""Megatron-core MoE layers -> Hugging Face checkpoint tensors, gathered to their sender with bounded memory.

One MoE layer of a ``GPTModel`` exports: router weight, the router linear's bias (``add_bias_linear``:
GPT-OSS), router expert bias (a buffer), the routed experts with their biases if any (``per_expert``
or ``fused`` wire layout, ``sources/core/hf/experts.py``), shared experts and the shared-expert gate.
Names come from ``HFMoENames`` (``moe_names.py``: transformers' own reversal), layout math from
``core/hf/experts.py`` / ``core/layouts/tp.py``; where Megatron keeps each tensor on a rank is
``moe_storage.py``'s, which rank holds and which sends it ``moe_placement.py``'s. This file is the
exporter that puts them together:

* routed experts live on the expert-parallel (EP) x expert-tensor-parallel (ETP) grid: global expert
  ``e = ep_rank * E_local + j``; each ETP rank holds rows ``[gate_r; up_r]`` of ``linear_fc1`` and
  columns ``r`` of ``linear_fc2`` (three storage formats: ``moe_storage.py``);
* router weight and expert bias are replicated over TP and EP; shared experts are split over the
  dense TP group like a dense MLP (``glu`` fc1, ``row`` fc2); the shared gate is replicated.

Invariants:

* Gather to the sender only: every tensor travels point-to-point (one ``MoEShard`` each) from the
  one rank that holds it (in rank 0's replica: lowest global rank with those coordinates) to its
  sender, cast to the wire dtype first (``WirePolicy``, as every source: routers, shared-expert gate
  and expert bias keep their own dtype), through the mover the dense path uses (``p2p.gather_to``,
  bounded by ``timeout_s``). Other ranks yield nothing and never hold another rank's shard.
* Bounded memory on the sender: experts move in batches of at most ``expert_batch_bytes``.
  ``per_expert`` holds one batch at a time; ``fused`` holds one layer's fused pair (preallocated,
  filled per batch) plus one batch -- never a ``torch.stack`` of separately materialized experts.
* Every rank walks the same plan (layers, batches, shards) in the same order, computed from configs
  and one cached exchange of parallel coordinates; so sends and receives pair up, and ``entries``
  (metadata) is collective-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.comm.p2p import Transfer, gather_to
from ..core.comm.waits import DEFAULT_TIMEOUT_S
from ..core.ground.dtype_policy import WirePolicy
from ..core.ground.errors import UnmappedParameterError
from ..core.ground.logs import get_logger
from ..core.ground.stats import PassStats
from ..core.hf.experts import (
    DEFAULT_EXPERT_BATCH_BYTES,
    ExpertLayout,
    FusedExpertBuffer,
    check_expert_layout,
    default_expert_layout,
    expert_batches,
)
from ..core.layouts.tp import GLU_LAYOUT, ROW
from .moe_names import HFMoELayer, HFMoENames
from .moe_placement import MoEPlacement
from .moe_storage import expert_biases, expert_full, local_expert_biases, local_expert_weights, moe_modules

__all__ = ["MegatronMoEExporter", "MoEShard"]

logger = get_logger(__name__)


@dataclass(frozen=True)
class MoEShard:
    """One tensor of a MoE layer as one rank holds it: who holds it, which tensor, and how its
    sender receives it -- what moves point-to-point (``export``) or is read in place (the pieces
    protocol, ``megatron/pieces.py``). Whole for the router, its biases and the shared gate (expert
    -1, shard 0); an expert's ETP shard for ``fc1`` / ``fc2``; a shared expert's TP shard."""

    src: int
    kind: str  # "router" | "rbias" | "bias" | "fc1" | "fc2" | "fc1b" | "fc2b" | "shared1" | "shared2" | "sgate"
    expert: int  # global expert (routed shards), else -1
    shard: int  # ETP / TP shard index, else 0
    shape: tuple[int, ...]
    dtype: torch.dtype


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


class MegatronMoEExporter:
    """Everything MegatronSource needs for the MoE layers of one model.

    ``entries(layer)`` -- the layer's wire ``(name, shape, dtype)`` in stream order, from configs only.
    ``export(layer)`` -- run on every rank, in the same global layer order; yields ``(name, tensor)``
    on each tensor's sender only (rank 0 unless ``plan_owners`` chose; full HF tensors, wire dtype,
    contiguous), nothing elsewhere.

    What the pieces protocol reads in place (``megatron/pieces.py``): ``exchange_coords``,
    ``placement`` (holders and coordinates), ``local`` and ``local_tensor``.
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
        #: global layer -> this rank's MoE MLP module of it (``moe_storage.moe_modules``)
        self.local: dict[int, torch.nn.Module] = moe_modules(self.chunks)
        #: who holds and who sends each MoE tensor (``moe_placement.py``; one cached exchange)
        self.placement = MoEPlacement(self.local, ep=self.ep, experts_per_rank=self.E_local)
        #: layers with no transformers counterpart (multi-token prediction): layer -> (the decoder
        #: layer whose names and shapes it shares, the HF prefix its tensors carry instead)
        self.aliases: dict[int, tuple[int, str]] = {}

    def layout_of(self, spec: Any) -> ExpertLayout:
        """The wire layout of experts ``spec``: the requested one, else the checkpoint's."""
        return self.layout or default_expert_layout(spec)

    # -- metadata (no collective) ----------------------------------------------------------------
    def hf_layer(self, layer: int) -> HFMoELayer:
        """``layer``'s HF names and shapes, checked against Megatron's config (raises naming the
        field that disagrees); a multi-token-prediction layer is renamed from the layer it is built like."""
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
        """Choose the sender of every MoE tensor (``MoEPlacement.plan_owners`` states each rule;
        ``stage_of``: MoE layer -> its pipeline stage). Collective (the one cached exchange of
        coordinates): call on every rank, at construction."""
        self.exchange_coords()
        self.placement.plan_owners(stage_of, topo, spread=spread)

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
        send = self.placement.sender
        out = [send(layer)] * head
        out += [send(layer) if per_expert is None else send(layer, i // per_expert) for i in range(len(experts))]
        return out + [send(layer)] * tail

    def exchange_coords(self) -> None:
        """The one cached exchange of every rank's coordinates (``MoEPlacement.exchange``, counted in
        ``stats``). Collective on its first call: every rank, in the same order."""
        self.placement.exchange(self.stats)

    # -- export (collective over all ranks) ------------------------------------------------------
    def export(self, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``layer``'s MoE tensors, in ``entries(layer)`` order, on their sender; nothing elsewhere.
        Collective over every rank (each sends what it holds)."""
        self.exchange_coords()
        hf = self.hf_layer(layer)
        wd = self.dtypes(hf)
        mlp = self.local.get(layer)
        # router weight / expert bias / shared gate: replicated, sent by the lowest holder.
        src = self.placement.holder(layer)

        dst = self.placement.sender(layer)

        def one(kind: str, entry: tuple[str, tuple[int, ...]], dtype: torch.dtype):
            return self._move(
                [MoEShard(src, kind, -1, 0, entry[1], dtype)], mlp, f"layer {layer}'s {entry[0]!r}",
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
        if self.layout_of(spec) == "fused" and dist.get_rank() == self.placement.sender(layer):
            buf = FusedExpertBuffer(spec, wd, device=self._device(mlp))
            self.stats.hold(buf.nbytes)
        for batch in self._batches(layer, spec.expert_bytes(wd)):
            dst = self.placement.sender(layer, batch[0])
            pieces = []
            for e in batch:
                ep_rank, _ = divmod(e, self.E_local)
                for r in range(self.etp):
                    h = self.placement.expert_source(layer, ep_rank) if self.etp == 1 else None
                    h = self.placement.holder(layer, ep=ep_rank, etp=r) if h is None else h  # (plan_owners)
                    pieces.append(MoEShard(h, "fc1", e, r, (2 * F // self.etp, H), wd))
                    pieces.append(MoEShard(h, "fc2", e, r, (H, F // self.etp), wd))
                if spec.bias:  # ETP 1 (hf_layer): one holder
                    h = self.placement.holder(layer, ep=ep_rank, etp=0)
                    pieces.append(MoEShard(h, "fc1b", e, 0, (2 * F,), wd))
                    pieces.append(MoEShard(h, "fc2b", e, 0, (H,), wd))

            def assemble(ps: list[MoEShard], ts: list[torch.Tensor], batch=batch):
                out = []
                n = 2 * self.etp + (2 if spec.bias else 0)
                for k, e in enumerate(batch):
                    mine = ts[k * n : (k + 1) * n]
                    gate, up, down = expert_full(mine[0 : 2 * self.etp : 2], mine[1 : 2 * self.etp : 2])
                    biases = expert_biases(mine[-2], mine[-1]) if spec.bias else None
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
            h = self.placement.holder(layer, tp=r)
            pieces.append(MoEShard(h, "shared1", -1, r, (2 * S // self.tp, H), wd))
            pieces.append(MoEShard(h, "shared2", -1, r, (H, S // self.tp), wd))

        def assemble_shared(ps, ts):
            gate, up = GLU_LAYOUT.concat(ts[0::2])
            (down,) = ROW.concat(ts[1::2])
            return [(hf.shared[0][0], gate), (hf.shared[1][0], up), (hf.shared[2][0], down)]

        yield from self._move(pieces, mlp, f"layer {layer}'s shared experts", assemble_shared, dst=self.placement.sender(layer))

    # -- moving pieces ---------------------------------------------------------------------------
    @staticmethod
    def _device(mlp: torch.nn.Module | None) -> torch.device:
        if mlp is None:
            return torch.device("cpu")
        return next(mlp.router.parameters()).device

    def local_tensor(self, mlp: torch.nn.Module, p: MoEShard, *, own_dtype: bool = False) -> torch.Tensor:
        """This rank's tensor of ``p`` (``p.src`` is this rank) read from ``mlp``, its module of the
        layer: shape checked against the config (raises naming the shard), in ``p.dtype``, contiguous;
        ``own_dtype``: a floating tensor as Megatron holds it instead, uncast and possibly a view
        (``iter_pieces``: its consumer casts, ``core/layouts/pieces.py``)."""
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
                if self.placement.sender(layer, e) != self.placement.sender(layer, start):
                    out.append(range(start, e))
                    start = e
            out.append(range(start, batch[-1] + 1))
        return out

    def _move(self, pieces: list[MoEShard], mlp, what: str, assemble, *, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """Send this rank's shards to ``dst`` (``p2p.gather_to``); on ``dst`` assemble and yield."""
        ts = gather_to(
            [Transfer(p.src, p.shape, p.dtype) for p in pieces], dst,
            local=lambda i: self.local_tensor(mlp, pieces[i]), device=self._device(mlp),
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
