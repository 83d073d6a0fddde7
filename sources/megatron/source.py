"""``MegatronSource``: a megatron-core ``GPTModel`` (TP / PP / VPP / EP, dense and MoE) as Hugging Face tensors.

Invariants:

* ``metadata`` is computed from ``hf_config``, Megatron's config and the parallel sizes
  (``sources/megatron/plan.py``): no collective, no export pass, identical on every rank.
* ``mode="full"`` (vLLM's NCCL broadcast engine; the default): every parameter's ``owners`` is
  ``(0,)`` -- rank 0, the only sender, is the only rank that yields. Every trainer rank still calls
  ``iter_full()`` (vLLM's trainer engines do, on every rank): inside it the ranks of rank 0's
  model-parallel replica send their TP shards, cast to the wire dtype first, point-to-point to
  rank 0 and yield nothing, so **no non-sender ever materializes a full tensor**; ranks of other
  data-parallel / context-parallel replicas return at once. Rank 0 splits each shard (QKV per query
  group, GLU per shard, vocabulary trimmed) and concatenates the pieces. Units rank 0 holds whole
  (all of its stage at tp=1, replicated norms at any tp) skip all of that: a loop planned at
  construction (``sources/megatron/whole_units.py``) exports them, because such an export is bound by
  host work per tensor, not by bytes. The units that move are ``megatron/gathered.py``'s, each
  unit's shards and senders ``megatron/units.py``'s.
* ``senders="owners"`` (vLLM 0.34's NCCL engine, ``core/comm/senders.py``): each unit is gathered by the
  TP group of one model-parallel replica and sent by that replica's first rank of the unit's stage
  (owners ``(that rank,)``); each stage's units are split in contiguous, byte-balanced runs over the
  data-parallel replicas; MoE experts follow ``moe.MegatronMoEExporter.plan_owners``. Rank 0 yields
  only its own share and receives nothing from another stage. Construction is collective then (the
  agreement and the MoE placement exchange run there: vLLM pulls each sender's pass on its turn only).
* ``mode="local"`` (vLLM's ``nccl_m2n`` engine): each TP rank of the sender's replica yields its own
  piece of each HF tensor, no communication. After the local split a TP shard is a plain
  ``torch.chunk`` piece (``Shard(0)`` for q/k/v/gate/up/embedding, ``Shard(1)`` for o/down), owners
  are that stage's TP ranks in TP order. A vocabulary whose padding makes the pieces differ from
  ``torch.chunk`` falls back to one owner (the stage's first TP rank), which gathers the trimmed
  rows from its TP peers. Under PP the owners of later stages do not start at rank 0, which vLLM's
  NCCL engine rejects -- that is why the mode is a constructor choice.
* Overlap (``overlap=True``, the default; ``mode="full"``): the next units' point-to-point gathers
  (``p2p.post_gather``: rank 0's receives) are posted before the current unit's tensors are handed
  on, so the peers' next sends run while the consumer sends -- within a byte budget
  (``ahead_bytes``; peers: one cast piece, as without overlap), never across a MoE layer's export
  (its transfers keep their place; ``megatron/gathered.py``). Both sides of every pair post in plan
  order, so transfers pair up as without overlap; names, bytes, order and checks are unchanged. A
  pass stopped early on rank 0 waits out what it posted; its
  peers, which yield nothing, still send the later units -- as without overlap, a pass abandoned on
  rank 0 alone leaves them to time out (``timeout_s`` on gloo), and the process groups must be
  rebuilt before the next pass. ``overlap=False`` (or ``WEIGHTSYNC_OVERLAP=0``): the sequential pass.
* Every pass checks this rank's stream against ``metadata`` (``check_stream``) and the first pass
  verifies that all ranks hold the same metadata before any byte moves; construction checks the
  model against ``hf_config`` and the arguments on every rank (``megatron/checks.py``).
* Tied embeddings export ``model.embed_tokens.weight`` only (from the first stage); the last
  stage's ``output_layer.weight`` copy under PP is never read.
* Multi-head latent attention (``multi_latent_attention``, DeepSeek-V3 / Kimi-K2) exports as
  transformers DeepseekV3 attention (``sources/megatron/mla.py``: what was verified, what raises).
  The down projections' TP layout differs between Megatron's specs, so every unit's kind is read
  from its module; the first pass also has every rank agree on the plan's TP layout (kind and
  shard shape of every unit), so a stage built with another spec raises before any transfer.
* MoE layers (``num_moe_experts``; dense and MoE layers may mix, e.g. first-k dense): the plan holds a
  MoE layer's attention units and its pre-MLP norm; right after them, ``MegatronMoEExporter``
  (``sources/megatron/moe.py``) streams the router, its expert bias, the routed experts
  (``expert_layout``: ``"per_expert"`` as checkpoints hold them, or ``"fused"``) and the shared
  experts, in that order, all owned by rank 0. Its metadata comes from configs (no collective).
  Its export is collective over **every** rank -- including ranks outside the sender's dense
  replica, because with expert parallelism they hold other experts -- so every rank walks the MoE
  layers in the same order even when it has no dense unit to send. ``mode="local"`` does not
  support MoE (raises ``NotImplementedError`` naming the MoE layers at construction).
* ``iter_pieces()`` (delta sync; ``megatron/pieces.py``, protocol ``core/layouts/pieces.py``): every rank
  yields its own shards as boxes of the checkpoint tensors, in the wire dtype -- the replica
  ``iter_full`` reads answers, one element once -- with no collective after the first pass. The
  source hands its producer one explicit ``MegatronPiecesView``.
* Parts (``part=``): ``"policy"`` (default) streams the model as transformers holds it and ignores a
  multi-token-prediction block (``mtp.layers.*``, and the embedding copy megatron keeps on the MTP
  stage under PP) -- the MTP block is never a reason to refuse a model. ``"mtp"`` streams the
  speculative draft only, in the checkpoint names of the family's ``MTPNames``
  (``plan.build_mtp_plan``): what vLLM's ``start_draft_weight_update`` is followed by. Both parts
  move bytes the same way (same units, same gathers, same checks); a family without MTP names, a
  model without ``mtp_num_layers`` or an ``hf_config`` count that disagrees raise at construction
  on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, Replicate, Shard, WeightSource

from ..core.check.stream import DEFAULT_TIMEOUT_S, check_stream, local_shape, verify_metadata_agreement
from ..core.comm.senders import Senders, split_contiguous
from ..core.ground.dtype_policy import WirePolicy
from ..core.ground.errors import UnmappedParameterError
from ..core.ground.logs import get_logger
from ..core.ground.overlap import overlap_default
from ..core.ground.stats import PassStats
from ..core.hf.experts import DEFAULT_EXPERT_BATCH_BYTES, ExpertLayout
from ..core.layouts import pieces as checkpoint_pieces
from ..core.layouts.rows import vocab_is_chunked
from ..core.layouts.tp import VOCAB
from ..families.base import Entry
from .ahead import default_ahead_bytes
from .checks import (
    attention_entries,
    bind_units,
    check_arguments,
    check_chunks,
    check_local_mode,
    family_of,
    hf_geometry,
    moe_error,
    mtp_moe_layers,
    unit_dtype,
)
from .gathered import GatheredPass, Step
from .moe import MegatronMoEExporter
from .pieces import MegatronPiecesView, megatron_pieces
from .plan import Unit, build_mtp_plan, build_plan, mlp_kind
from .topology import Topology, megatron_topology
from .units import DenseUnits, unit_bytes
from .walk import model_chunks, part_params, walk_chunks
from .whole_units import LocalStep, WholePass, mark_precast

__all__ = ["MegatronSource"]

logger = get_logger(__name__)

Mode = Literal["full", "local"]
Part = Literal["policy", "mtp"]


class MegatronSource(WeightSource):
    """Hugging Face checkpoint tensors from a megatron-core ``GPTModel`` under TP / PP / VPP / DP.

    Args:
        model: this rank's ``GPTModel`` or the list of its virtual-pipeline chunks (wrappers such
            as DDP / ``Float16Module`` are unwrapped). ``parallel_state`` must be initialized.
        hf_config: the transformers config of the target checkpoint (decides names and shapes).
        dtype: wire dtype; default Megatron's ``params_dtype``. Shards are cast before they move.
        keep_fp32: extra regular expressions (``re.search`` on the checkpoint name) of tensors that
            keep their own dtype, on top of ``core.ground.dtype_policy.DEFAULT_KEEP_FP32`` (routers, shared-expert gate,
            expert bias): the same policy as ``FSDPSource``. A Megatron tensor's own dtype is the
            one its config builds it in (``params_dtype``; the router's expert bias: fp32), so every
            rank declares it without holding the tensor.
        mode: ``"full"`` (``iter_full``, vLLM NCCL broadcast: owners ``(0,)``) or ``"local"``
            (``iter_local``, vLLM ``nccl_m2n``: owners are each stage's TP ranks; dense models only).
        expert_layout: MoE routed experts on the wire: ``"per_expert"``
            (``...experts.{e}.gate_proj.weight``) or ``"fused"`` (``experts.gate_up_proj``
            ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``), both accepted by vLLM 0.33 and 0.34;
            None (default): the checkpoint's (per expert; fused for GPT-OSS, ``core/hf/experts.py``).
        expert_batch_bytes: bound on the expert bytes rank 0 receives at once (MoE only).
        check: check each pass's stream against ``metadata`` on this rank.
        timeout_s: bound on the first pass's cross-rank metadata agreement.
        overlap: post the next unit's transfer before yielding this one's tensors (``mode="full"``;
            module docstring). None: on unless the environment sets ``WEIGHTSYNC_OVERLAP=0``.
        senders: ``"rank0"`` (default: rank 0 sends every tensor, as above) or ``"owners"`` (vLLM
            0.34's NCCL engine: each pipeline stage's first rank of rank 0's replica sends its
            stage's tensors, VPP chunks included, gathered from its TP peers only; routed experts are
            sent by a rank holding them -- see ``moe.MegatronMoEExporter.plan_owners`` --, so rank 0
            never receives another stage's tensors). Needs ``mode="full"`` and vLLM 0.34+ (raises
            ``ValueError`` naming the installed version otherwise). Construction is then collective
            (every rank, same order): the cross-rank agreement and the MoE placement exchange run
            here, because vLLM pulls each sender's pass only on its own turn.
        ahead_bytes: with overlap, rank 0 keeps posting receives while what it posted ahead holds less
            than this many bytes of HF tensors (``megatron/ahead.py``). None: 128 MiB where each local
            rank has 4 or more cores, else 64 MiB (``default_ahead_bytes``).
        part: ``"policy"`` (default: the model, ignoring any multi-token-prediction block) or
            ``"mtp"`` (the speculative draft's tensors only, for ``start_draft_weight_update``;
            module docstring).

    Raises at construction (on every rank, before any byte moves; ``megatron/checks.py``): ``UnmappedParameterError`` for an
    unknown architecture, an MLA variant DeepseekV3 cannot express (``megatron.mla``), a Megatron
    parameter the checkpoint has no name for, or MoE settings ``hf_config`` disagrees with;
    ``ValueError`` when the model and ``hf_config`` disagree on a shape; ``NotImplementedError``
    for ``mode="local"`` with MoE layers.
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        *,
        hf_config: Any,
        dtype: torch.dtype | None = None,
        keep_fp32: str | Iterable[str] = (),
        mode: Mode = "full",
        check: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        expert_layout: ExpertLayout | None = None,
        expert_batch_bytes: int = DEFAULT_EXPERT_BATCH_BYTES,
        overlap: bool | None = None,
        ahead_bytes: int | None = None,
        senders: Senders = "rank0",
        part: Part = "policy",
    ) -> None:
        #: who sends each tensor (``core/comm/senders.py``): ``"rank0"`` or ``"owners"``
        self.senders: Senders = check_arguments(
            mode=mode, part=part, senders=senders, overlap=overlap, ahead_bytes=ahead_bytes
        )
        #: ``"policy"`` or ``"mtp"`` (the speculative draft; module docstring)
        self.part: Part = part
        #: post the next unit's transfer before yielding this one's tensors (module docstring)
        self.overlap: bool = overlap_default() if overlap is None else overlap
        #: the lookahead's byte budget on rank 0 (``megatron/ahead.py``)
        self.ahead_bytes: int = default_ahead_bytes() if ahead_bytes is None else ahead_bytes
        self.mode: Mode = mode
        self.check = check
        self.timeout_s = timeout_s
        self.last_pass = PassStats()
        self._agreed = False
        self._topo: Topology = megatron_topology()
        rank = self._topo.rank
        chunks = model_chunks(model)
        check_chunks(chunks, self._topo)
        mcfg = chunks[0].config
        #: the transformers config the names and shapes come from (``save_safetensors`` writes it as
        #: config.json and takes transformers' shard order from it).
        self.hf_config = hf_config
        self.family = family_of(hf_config, rank)
        #: keyword arguments the family's layout kinds need (e.g. the gated delta net's heads).
        self._layout_kw: dict[str, Any] = self.family.layout_kw(hf_config, mcfg)
        #: global layers (0-based) whose MLP is MoE, from Megatron's config (part "mtp": the MTP
        #: layers' decoder blocks, numbered after the decoder's, that are MoE).
        self.moe_layers: list[int] = [i for i in range(mcfg.num_layers) if mlp_kind(mcfg, i) == "moe"]
        has_dense = len(self.moe_layers) < mcfg.num_layers
        #: MTP layer -> (the decoder layer it is built like, the HF prefix its MoE tensors carry)
        self._mtp_alias: dict[int, tuple[int, str]] = {}
        if part == "mtp":
            self.moe_layers, self._mtp_alias = mtp_moe_layers(self.family, hf_config, mcfg, rank)
        check_local_mode(mode, self.moe_layers, mcfg, rank)
        self.geometry = hf_geometry(hf_config, mcfg, chunks[0], self._topo.tp, rank, has_dense, self.family)
        self.dtype: torch.dtype = dtype or mcfg.params_dtype
        #: the wire-dtype policy every source shares (``wire.WirePolicy``).
        self.wire = WirePolicy.build(self.dtype, keep_fp32)
        bound, unmapped, layer_names = walk_chunks(chunks)
        attention = attention_entries(self.family, hf_config, bound, layer_names, rank) if self.geometry.mla else None
        self._moe: MegatronMoEExporter | None = None
        if self.moe_layers:
            try:
                self._moe = MegatronMoEExporter(
                    chunks, hf_config, mcfg, expert_layout=expert_layout, wire=self.wire,
                    expert_batch_bytes=expert_batch_bytes, stats=self.last_pass, timeout_s=timeout_s,
                )
                self._moe.aliases.update(self._mtp_alias)
            except UnmappedParameterError as e:
                raise self._moe_error(e, layer_names) from e
        self._plan(hf_config, mcfg, layer_names, attention)
        mine = part_params(bound, part, num_layers=mcfg.num_layers, pp_rank=self._topo.pp_rank,
                           tied=self.geometry.tied, plan=self.plan)
        self._bound = bind_units(self.plan, mine, unmapped, topo=self._topo, tied=self.geometry.tied,
                                 family=self.family, moe=self._moe)
        self._device = next(iter(self._bound.values())).param.device if self._bound else torch.device("cpu")
        #: this rank's dense units: shards, senders, the point-to-point moves (``megatron/units.py``)
        self._units = DenseUnits(
            topo=self._topo, geometry=self.geometry, layout_kw=self._layout_kw, bound=self._bound,
            wire_dtypes=self._wd, senders=self.senders, unit_replica=self._unit_replica,
            device=self._device, timeout_s=timeout_s,
        )
        if self._moe is not None:
            try:
                self.metadata  # noqa: B018  (validates hf_config's MoE layers on every rank, no collective)
            except UnmappedParameterError as e:
                raise self._moe_error(e, layer_names) from e
        self._vocab_chunked = vocab_is_chunked(self.geometry.vocab, self.geometry.padded_vocab, self._topo.tp)
        #: per plan unit: (unit, its local export on this rank or None, MoE layer that follows or None).
        local = mark_precast([self._units.local_step(u) for u in self.plan], self.dtype)
        self._steps: list[Step] = [(u, s, self._moe_after.get(i)) for i, (u, s) in enumerate(zip(self.plan, local))]
        self._precast: list[LocalStep] = [s for s in local if s is not None and s.precast]
        if self.senders == "owners":
            self._start()  # collective at construction: vLLM pulls each sender's pass on its turn only

    # ---- construction -----------------------------------------------------------------------

    def _plan(
        self, hf_config: Any, mcfg: Any, layer_names: dict[int, list[str]], attention: dict[str, Entry] | None
    ) -> None:
        """The export plan (``plan.build_plan``), each unit's wire dtype and where MoE layers follow."""
        try:
            if self.part == "mtp":
                self.plan: list[Unit] = build_mtp_plan(
                    family=self.family, hf_config=hf_config, mcfg=mcfg, geometry=self.geometry,
                    pp=self._topo.pp, vpp=self._topo.vpp, attention=attention,
                )
            else:
                self.plan = build_plan(
                    family=self.family,
                    hf_config=hf_config,
                    mcfg=mcfg,
                    geometry=self.geometry,
                    pp=self._topo.pp,
                    vpp=self._topo.vpp,
                    local_layer_names=layer_names,
                    attention=attention,
                )
        except UnmappedParameterError as e:
            raise UnmappedParameterError(f"rank {self._topo.rank}: {e}") from e
        self._wd: dict[tuple, torch.dtype] = {
            u.key: unit_dtype(u, mcfg.params_dtype, self.wire, self._topo.rank) for u in self.plan
        }
        # plan index of each MoE layer's last unit -> that layer: its MoE tensors follow that unit.
        last_unit = {u.key[1]: i for i, u in enumerate(self.plan) if u.key[0] == "layer"}
        self._moe_after: dict[int, int] = {last_unit[L]: L for L in self.moe_layers}
        #: ``senders="owners"``: the model-parallel replica (``Topology.replicas``) whose stage-first
        #: rank gathers and sends each unit; a unit not listed: replica 0 (rank 0's).
        self._unit_replica: dict[tuple, int] = {}
        if self.senders == "owners":
            # Data-parallel replicas hold the same dense weights: each stage's units are cut into one
            # contiguous run per replica, balanced by bytes (core.comm.senders.split_contiguous), unless
            # experts must travel to replica 0 (expert TP > 1, fused layout: moe.spreadable).
            spread = self._moe is None or self._moe.spreadable(self.moe_layers)
            if spread and len(self._topo.replicas) > 1:
                for stage in range(self._topo.pp):
                    units = [u for u in self.plan if u.stage == stage]
                    runs = split_contiguous([self._unit_bytes(u) for u in units], len(self._topo.replicas))
                    self._unit_replica.update({u.key: run for u, run in zip(units, runs)})
            if self._moe is not None:
                stage_of = {L: self.plan[last_unit[L]].stage for L in self.moe_layers}
                self._moe.plan_owners(stage_of, self._topo, spread=spread)

    def _moe_error(self, e: Exception, layer_names: dict[int, list[str]]) -> UnmappedParameterError:
        return moe_error(e, layer_names, moe_layers=self.moe_layers, family=self.family, rank=self._topo.rank)

    def _unit_bytes(self, unit: Unit) -> int:
        """Bytes of ``unit``'s HF tensors in its wire dtype (what its sender holds once concatenated)."""
        return unit_bytes(unit, self._wd[unit.key])

    # ---- metadata ---------------------------------------------------------------------------

    def _unit_metas(self, unit: Unit) -> list[ParamMeta]:
        if self.mode == "full":
            owner = (self._units.dst(unit),)
            return [ParamMeta(n, self._wd[unit.key], s, owners=owner) for n, s in zip(unit.names, unit.shapes)]
        ranks = self._topo.stage_ranks(unit.stage)
        dim = unit.kind.dim
        if (unit.kind is VOCAB and not self._vocab_chunked) or not unit.kind.chunked:
            ranks, dim = ranks[:1], None
        placement = Replicate() if dim is None else Shard(dim)
        return [
            ParamMeta(n, self._wd[unit.key], s, owners=tuple(ranks), mesh_shape=(len(ranks),), placements=(placement,))
            for n, s in zip(unit.names, unit.shapes)
        ]

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        out: list[ParamMeta] = []
        for i, unit in enumerate(self.plan):
            out += self._unit_metas(unit)
            if i in self._moe_after:
                assert self._moe is not None
                layer = self._moe_after[i]
                owners = self._moe.entry_senders(layer)
                out += [ParamMeta(n, d, s, owners=(o,)) for (n, s, d), o in zip(self._moe.entries(layer), owners)]
        return out

    @property
    def checks_stream(self) -> bool:
        """Every pass checks its own stream against ``metadata`` (``CheckedSource`` relies on it)."""
        return self.check

    def implements_iter_full(self) -> bool:
        return self.mode == "full"

    def implements_iter_local(self) -> bool:
        return self.mode == "local"

    # ---- passes -----------------------------------------------------------------------------

    def _expected(self) -> list[ParamMeta]:
        return self._expected_metas

    @cached_property
    def _expected_metas(self) -> list[ParamMeta]:
        r = self._topo.rank
        return [m for m in self.metadata if m.owners is None or r in m.owners]

    @cached_property
    def _layout_metas(self) -> list[ParamMeta]:
        """Every unit's Megatron-side layout (kind, TP-shard shape, holders) as entries the
        cross-rank agreement can digest: kinds read from modules (MLA) must agree across stages."""
        out = []
        for unit in self.plan:
            dim = unit.kind.dim
            out.append(ParamMeta(
                f"[megatron {unit.kind} shard] {unit.names[0]}", self._wd[unit.key], unit.shard_shape,
                owners=self._topo.stage_ranks(unit.stage), placements=(Replicate() if dim is None else Shard(dim),),
            ))
        return out

    def _start(self) -> None:
        if not self._agreed:
            verify_metadata_agreement(
                self.metadata + self._layout_metas, timeout_s=self.timeout_s,
                what="MegatronSource metadata and TP layout",
            )
            self._agreed = True

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0 yields every HF tensor; its model-parallel peers send shards; others do nothing."""
        if self.mode != "full":
            raise NotImplementedError("MegatronSource(mode='local') implements iter_local(), not iter_full()")
        pairs = self._full_pass()
        if self.check:
            pairs = check_stream(pairs, self._expected(), rank=self._topo.rank)
        yield from pairs

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each TP rank of the sender's replica yields its piece of each HF tensor of its stage."""
        if self.mode != "local":
            raise NotImplementedError("MegatronSource(mode='full') implements iter_full(), not iter_local()")
        pairs = self._local_pass()
        if self.check:
            expected = self._expected()
            shapes = [local_shape(m, self._topo.rank) for m in expected]
            pairs = check_stream(pairs, expected, rank=self._topo.rank, what="iter_local", local_shapes=shapes)
        yield from pairs

    def iter_pieces(self) -> Iterator[checkpoint_pieces.Piece]:
        """This rank's shards as boxes of the checkpoint tensors, in the wire dtype, in metadata
        order; collective over every rank (``core/layouts/pieces.py`` is the protocol,
        ``megatron/pieces.py`` how units, experts and vocabulary padding become boxes). What
        ``DeltaSource`` diffs where the shard lives."""
        view = MegatronPiecesView(
            plan=self.plan, moe_after=self._moe_after, units=self._units, moe=self._moe, agree=self._start
        )
        yield from megatron_pieces(view)

    # ---- the passes ---------------------------------------------------------------------------

    @cached_property
    def _is_gatherer(self) -> bool:
        """This rank receives TP pieces of some unit (rank 0; with ``senders="owners"`` each stage's first rank)."""
        return any(self._units.dst(u) == self._topo.rank for u in self.plan)

    def _full_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``mode="full"``: each step of the plan, by who holds it -- rank 0's units held whole
        (``WholePass``, no communication), the units that move (``GatheredPass``), then the MoE
        layer that follows the step, if any (``MegatronMoEExporter.export``, collective on every rank)."""
        stats = self.last_pass = PassStats().start()
        if self._moe is not None:
            self._moe.stats = stats
        whole = WholePass(self._precast, self.dtype)
        moving: GatheredPass | None = None
        try:
            self._start()
            # Ranks of other data-parallel replicas have no dense unit to send, but with expert
            # parallelism they hold other experts: they still walk every MoE layer's export.
            dense = self._topo.in_sender_replica or bool(self._unit_replica)
            if not dense and self._moe is None:
                return
            whole.start()
            transfers = self.overlap and any(s[1] is None for s in self._steps)  # none at TP1 on rank 0
            moving = GatheredPass(
                self._units, self._steps, stats, overlap=self.overlap, ahead_bytes=self.ahead_bytes,
                timeout_s=self.timeout_s,
                # rank 0's concatenation / splits off this thread on CPU (megatron/ahead.py)
                helper=transfers and self._is_gatherer and self._device.type == "cpu",
            )
            for k, (unit, local, moe_layer) in enumerate(self._steps):
                if local is not None:
                    yield from whole.export(unit.names, local)
                    if transfers:
                        moving.look_ahead(k)  # (after the yields: a whole unit is host work)
                elif dense:
                    yield from moving.export(k, unit)
                if moe_layer is not None:
                    yield from self._moe.export(moe_layer)  # type: ignore[union-attr]
        finally:
            if moving is not None:
                moving.close()
            whole.account(stats)
            stats.stop()

    def _local_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``mode="local"``: each TP rank of the sender's replica yields its piece of each HF tensor
        of its stage; a kind whose pieces are not ``torch.chunk`` pieces is gathered to the stage's
        first TP rank, which yields it whole."""
        stats = self.last_pass = PassStats().start()
        units = self._units
        try:
            self._start()
            if not self._topo.in_sender_replica:
                return
            for unit in self.plan:
                if unit.stage != self._topo.pp_rank:
                    continue
                if (unit.kind is VOCAB and not self._vocab_chunked) or not unit.kind.chunked:
                    # Fallback: the stage's first TP rank owns the whole (trimmed) tensor.
                    pieces = units.gather_to(unit, self._topo.stage_ranks(unit.stage)[0], stats)
                    if pieces is None:
                        continue
                    outs = unit.kind.concat(pieces, **units.geometry_kw(unit))
                else:
                    outs = unit.kind.split(units.shard(unit, stats), **units.geometry_kw(unit))
                for name, out in zip(unit.names, outs):
                    stats.yielded(out.numel() * out.element_size())
                    yield name, out
                del outs
                stats.hold(-stats.held_bytes)
        finally:
            stats.stop()
