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
  host work per tensor, not by bytes.
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
* Overlap (``overlap=True``, the default; ``mode="full"``): the next unit's point-to-point gather
  (``p2p.post_gather``: rank 0's receives) is posted before the current unit's tensors are handed
  on, so the peers' next sends run while the consumer sends. Exactly one unit ahead (extra memory
  on rank 0: two units' pieces; peers: one cast piece, as without overlap), never across a MoE
  layer's export (its transfers keep their place). Both sides of every pair post in plan order, so
  transfers pair up as without overlap; names, bytes, order and checks are unchanged. A pass stopped early on rank 0 waits out what it posted; its
  peers, which yield nothing, still send the later units -- as without overlap, a pass abandoned on
  rank 0 alone leaves them to time out (``timeout_s`` on gloo), and the process groups must be
  rebuilt before the next pass. ``overlap=False`` (or ``WEIGHTSYNC_OVERLAP=0``): the sequential pass.
* Every pass checks this rank's stream against ``metadata`` (``check_stream``) and the first pass
  verifies that all ranks hold the same metadata before any byte moves.
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
  ``iter_full`` reads answers, one element once -- with no collective after the first pass.
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
from functools import cached_property, partial
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, Replicate, Shard, WeightSource

from ..core.check.stream import DEFAULT_TIMEOUT_S, check_stream, local_shape, verify_metadata_agreement
from ..core.ground.errors import UnmappedParameterError
from ..families import Family, family_for
from ..families.base import DENSE_MLP, Entry
from ..core.layouts.tp import VOCAB, vocab_is_chunked, vocab_rows
from ..core.ground.logs import get_logger
from .whole_units import LocalStep, local_step, mark_precast, nbytes, precast
from .ahead import SplitAhead, default_ahead_bytes
from .moe import MegatronMoEExporter, expert_format, megatron_moe_suffixes
from .mla import mla_geometry, resolve_kinds
from .plan import Geometry, Unit, build_mtp_plan, build_plan, mlp_kind, mtp_layers
from .pieces import megatron_pieces
from .topology import Topology, megatron_topology
from .walk import Bound, model_chunks, walk_chunks
from ..core.ground.overlap import overlap_default
from ..core.comm.p2p import Piece, PostedGather, gather_to, post_gather
from ..core.layouts import pieces as checkpoint_pieces
from ..core.hf.experts import DEFAULT_EXPERT_BATCH_BYTES, ExpertLayout
from ..core.ground.stats import PassStats
from ..core.ground.dtype_policy import WirePolicy
from ..core.comm.senders import Senders, check_senders, require_many_senders, split_contiguous

__all__ = ["MegatronSource"]

logger = get_logger(__name__)

Mode = Literal["full", "local"]
Part = Literal["policy", "mtp"]


def _hf_geometry(
    hf_config: Any,
    mcfg: Any,
    chunk: torch.nn.Module,
    tp: int,
    rank: int,
    has_dense: bool,
    family: Family,
) -> Geometry:
    """Read the shapes from ``hf_config``; raise naming every field Megatron disagrees with.

    ``intermediate_size`` is compared only when some layer has a dense MLP: an all-MoE model never
    builds ``ffn_hidden_size`` (Mixtral's ``intermediate_size`` is the expert size, which the MoE
    exporter checks against ``moe_ffn_hidden_size``). MLA attention is checked by
    ``mla.mla_geometry`` instead of query groups / ``kv_channels``. The expected values are
    the family's own ``TransformerConfig`` table (``Family.megatron_fields``), the one the builder
    builds from."""
    mla = mla_geometry(hf_config, mcfg, family_is_mla=family.attention == "mla", rank=rank)
    want = family.megatron_fields(hf_config)
    heads = want["num_attention_heads"].value
    groups = heads if mla else want["num_query_groups"].value
    head_dim = want["kv_channels"].value if "kv_channels" in want else hf_config.hidden_size // heads
    g = Geometry(
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=want["ffn_hidden_size"].value,
        vocab=hf_config.vocab_size,
        padded_vocab=int(chunk.vocab_size),
        layers=hf_config.num_hidden_layers,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tp=tp,
        mla=mla,
    )
    fields = [
        "hidden_size", "num_attention_heads", *([] if mla else ["num_query_groups", "kv_channels"]),
        *(["ffn_hidden_size"] if has_dense else []), "num_layers",
    ]
    have = {f: getattr(mcfg, f) for f in fields}
    if not mla:
        have["num_query_groups"] = have["num_query_groups"] or mcfg.num_attention_heads
    checks = [(want[f].hf, want[f].value, f, have[f]) for f in fields]
    tie = family.gpt_model_fields(hf_config)["share_embeddings_and_output_weights"]
    checks += [
        (tie.hf, tie.value, "share_embeddings_and_output_weights",
         bool(getattr(chunk, "share_embeddings_and_output_weights", False))),
        (want["gated_linear_unit"].hf, want["gated_linear_unit"].value, "gated_linear_unit", bool(mcfg.gated_linear_unit)),
    ]
    bad = [f"hf_config.{h}={hv!r} but Megatron {m}={mv!r}" for h, hv, m, mv in checks if hv != mv]
    if g.vocab > g.padded_vocab:
        bad.append(f"hf_config.vocab_size={g.vocab} exceeds Megatron's padded vocabulary {g.padded_vocab}")
    if g.groups % tp:
        what = "num_attention_heads" if mla else "num_key_value_heads"
        bad.append(f"{what}={g.groups} is not divisible by tp={tp}")
    if bad:
        raise ValueError(f"rank {rank}: MegatronSource: the model does not match hf_config: " + "; ".join(bad))
    return g


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

    Raises at construction (on every rank, before any byte moves): ``UnmappedParameterError`` for an
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
        if mode not in ("full", "local"):
            raise ValueError(f"MegatronSource mode must be 'full' or 'local', got {mode!r}")
        if part not in ("policy", "mtp"):
            raise ValueError(f"MegatronSource part must be 'policy' or 'mtp', got {part!r}")
        #: ``"policy"`` or ``"mtp"`` (the speculative draft; module docstring)
        self.part: Part = part
        _rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        #: who sends each tensor (``core/comm/senders.py``): ``"rank0"`` or ``"owners"``
        self.senders: Senders = check_senders(senders, rank=_rank, who="MegatronSource")
        if senders == "owners":
            if mode != "full":
                raise ValueError(
                    f"rank {_rank}: MegatronSource(senders='owners') needs mode='full' (vLLM's NCCL "
                    f"broadcast engine); mode={mode!r} already sends each stage's TP pieces from their ranks"
                )
            require_many_senders(rank=_rank, who="MegatronSource")
        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"overlap= must be a bool or None, got {overlap!r}")
        if ahead_bytes is not None and (isinstance(ahead_bytes, bool) or not isinstance(ahead_bytes, int)
                                        or ahead_bytes <= 0):
            raise ValueError(f"ahead_bytes= must be a positive int or None, got {ahead_bytes!r}")
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
        if len(chunks) != self._topo.vpp:
            raise ValueError(
                f"rank {rank}: got {len(chunks)} model chunk(s) but virtual pipeline size is "
                f"{self._topo.vpp}; pass every virtual-pipeline chunk of this rank, in order"
            )
        mcfg = chunks[0].config
        #: the transformers config the names and shapes come from (``save_safetensors`` writes it as
        #: config.json and takes transformers' shard order from it).
        self.hf_config = hf_config
        try:
            self.family = family_for(hf_config)
        except UnmappedParameterError as e:
            raise UnmappedParameterError(f"rank {rank}: {e}") from e
        #: keyword arguments the family's layout kinds need (e.g. the gated delta net's heads).
        self._layout_kw: dict[str, Any] = self.family.layout_kw(hf_config, mcfg)
        #: global layers (0-based) whose MLP is MoE, from Megatron's config (part "mtp": the MTP
        #: layers' decoder blocks, numbered after the decoder's, that are MoE).
        self.moe_layers: list[int] = [i for i in range(mcfg.num_layers) if mlp_kind(mcfg, i) == "moe"]
        has_dense = len(self.moe_layers) < mcfg.num_layers
        self._mtp_alias: dict[int, tuple[int, str]] = {}
        if part == "mtp":
            try:
                depth = mtp_layers(self.family, hf_config, mcfg)
                names = self.family.mtp
                assert names is not None
                proxy = names.proxy_layer(hf_config)
            except (UnmappedParameterError, ValueError) as e:
                raise type(e)(f"rank {rank}: {e}") from e
            moe = mlp_kind(mcfg, proxy) == "moe"
            self.moe_layers = [mcfg.num_layers + i for i in range(depth)] if moe else []
            self._mtp_alias = {mcfg.num_layers + i: (proxy, names.fill(names.layer, hf_config, i)) for i in range(depth)}
        if self.moe_layers and mode == "local":
            raise NotImplementedError(
                f"rank {rank}: MegatronSource(mode='local') does not support MoE layers "
                f"{self.moe_layers} (num_moe_experts={mcfg.num_moe_experts}); use mode='full'"
            )
        self.geometry = _hf_geometry(hf_config, mcfg, chunks[0], self._topo.tp, rank, has_dense, self.family)
        self.dtype: torch.dtype = dtype or mcfg.params_dtype
        #: the wire-dtype policy every source shares (``wire.WirePolicy``).
        self.wire = WirePolicy.build(self.dtype, keep_fp32)
        bound, unmapped, layer_names = walk_chunks(chunks)
        attention = self._attention(hf_config, bound, layer_names) if self.geometry.mla else None
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
        self._bound = self._bind(self._part_of(bound, mcfg.num_layers), unmapped)
        if self._moe is not None:
            try:
                self.metadata  # noqa: B018  (validates hf_config's MoE layers on every rank, no collective)
            except UnmappedParameterError as e:
                raise self._moe_error(e, layer_names) from e
        self._device = next(iter(self._bound.values())).param.device if self._bound else torch.device("cpu")
        self._vocab_chunked = vocab_is_chunked(self.geometry.vocab, self.geometry.padded_vocab, self._topo.tp)
        #: per plan unit: (unit, its local export on this rank or None, MoE layer that follows or None).
        local = mark_precast([self._local_step(u) for u in self.plan], self.dtype)
        self._steps: list[tuple[Unit, LocalStep | None, int | None]] = [
            (u, s, self._moe_after.get(i)) for i, (u, s) in enumerate(zip(self.plan, local))
        ]
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
        self._wd: dict[tuple, torch.dtype] = {u.key: self._unit_dtype(u, mcfg.params_dtype) for u in self.plan}
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

    def _attention(
        self, hf_config: Any, bound: dict[tuple, Bound], layer_names: dict[int, list[str]]
    ) -> dict[str, Entry]:
        """MLA attention entries with each kind read from this rank's modules (``resolve_kinds``).

        Every local layer must declare the same split for a tensor; a fused ``linear_qkv_down_proj``
        (megatron-core 0.17+) replaces the two down projections."""
        rank = self._topo.rank
        dims: dict[str, set] = {}
        for key, b in bound.items():
            if key[0] == "layer":
                dims.setdefault(key[2], set()).add(b.tp_dim)
        mixed = {k: sorted(v, key=str) for k, v in dims.items() if len(v) > 1}
        if mixed:
            raise UnmappedParameterError(
                f"rank {rank}: Megatron layers on this rank split the same tensor differently over TP: {mixed}"
            )
        fused = any("self_attention.linear_qkv_down_proj.weight" in names for names in layer_names.values())
        try:
            keys = self.family.layer_keys(hf_config, fused_down=fused)
        except UnmappedParameterError as e:
            raise UnmappedParameterError(f"rank {rank}: {e}") from e
        entries = {k: e for k, e in keys.items() if k not in DENSE_MLP}
        return resolve_kinds(entries, {k: next(iter(v)) for k, v in dims.items()}, rank=rank)

    def _part_of(self, bound: dict[tuple, Bound], num_layers: int) -> dict[tuple, Bound]:
        """The walked parameters this part exports (``_bind`` then requires every one of them to be
        in the plan): ``"policy"`` drops the MTP block (``("mtp", ...)`` and decoder layers numbered
        past ``num_layers``) and, off the first stage, the embedding copy megatron keeps for MTP;
        ``"mtp"`` keeps only the MTP block, plus the shared embedding / output head under the plan's
        copy keys (``("mtp_embed", i)`` / ``("mtp_head", i)``; tied: the embedding for both)."""
        def is_mtp(key: tuple) -> bool:
            return key[0] == "mtp" or (key[0] == "layer" and key[1] >= num_layers)

        if self.part == "policy":
            out = {k: b for k, b in bound.items() if not is_mtp(k)}
            if self._topo.pp_rank != 0:
                out.pop(("embed",), None)
            return out
        out = {k: b for k, b in bound.items() if is_mtp(k)}
        embed = bound.get(("embed",))
        head = embed if self.geometry.tied else bound.get(("lm_head",))
        for unit in self.plan:
            shared = {"mtp_embed": embed, "mtp_head": head}.get(unit.key[0])
            if shared is not None and unit.stage == self._topo.pp_rank:
                out[unit.key] = shared
        return out

    def _bind(self, bound: dict[tuple, Bound], unmapped: list[str]) -> dict[tuple, Bound]:
        """Every plan unit of this stage gets its local parameter; anything left over is an error."""
        topo, rank = self._topo, self._topo.rank
        mine: dict[tuple, Bound] = {}
        problems: list[str] = []
        for unit in self.plan:
            if unit.stage != topo.pp_rank:
                continue
            b = bound.pop(unit.key, None)
            if b is None:
                problems.append(f"missing Megatron parameter for {list(unit.names)} (pp stage {unit.stage}, chunk {unit.chunk})")
                continue
            if b.chunk != unit.chunk:
                problems.append(f"{b.name} is on chunk {b.chunk}, Megatron's layer offsets put it on chunk {unit.chunk}")
            if tuple(b.param.shape) != unit.shard_shape:
                problems.append(
                    f"{b.name} has shape {tuple(b.param.shape)}, hf_config and tp={topo.tp} imply {unit.shard_shape}"
                )
            mine[unit.key] = b
        if self.geometry.tied:
            bound.pop(("lm_head",), None)  # the last stage's copy of the tied embedding
        self._claim_moe(bound)
        for key, b in bound.items():
            where = "this pipeline stage" if key[0] != "layer" else f"layer {key[1]} (not placed on this stage)"
            unmapped.append(f"chunk{b.chunk}:{b.name} ({where})")
        if unmapped:
            raise UnmappedParameterError(
                f"rank {rank}: Megatron parameters with no tensor in the {self.family.name} checkpoint "
                f"for this hf_config: {unmapped}"
            )
        if problems:
            raise ValueError(f"rank {rank}: MegatronSource cannot export this model: " + "; ".join(problems))
        return mine

    def _unit_dtype(self, unit: Unit, own: torch.dtype) -> torch.dtype:
        """The wire dtype of ``unit``'s HF tensors (one Megatron tensor: one dtype for all of them)."""
        got = {self.wire.dtype_for(n, own) for n in unit.names}
        if len(got) > 1:
            raise ValueError(
                f"rank {self._topo.rank}: keep_fp32= keeps some but not all of {list(unit.names)}, which "
                f"Megatron holds as one tensor ({unit.key[-1]}); match all of them or none"
            )
        return got.pop()

    def _moe_error(self, e: Exception, layer_names: dict[int, list[str]]) -> UnmappedParameterError:
        """``e`` from the MoE side, naming this rank, the MoE layers and their Megatron parameters."""
        local = sorted(L for L in layer_names if L in self.moe_layers)
        shown = [
            f"decoder.layers.<{L}>.{n}" for L in local[:1] for n in layer_names[L] if n.startswith("mlp.")
        ][:6] or ["mlp.router.weight", "mlp.experts.*"]
        return UnmappedParameterError(
            f"rank {self._topo.rank}: Megatron layers {self.moe_layers} are MoE but the {self.family.name} "
            f"checkpoint for this hf_config has no tensors for them (e.g. {shown}): {e}"
        )

    def _claim_moe(self, bound: dict[tuple, Bound]) -> None:
        """Remove from ``bound`` exactly the ``mlp.*`` parameters the MoE exporter reads on this rank
        (router, this rank's routed experts in their storage format, shared experts and gate as the
        config declares them); any other ``mlp.*`` parameter of a MoE layer stays and is unmapped."""
        if self._moe is None:
            return
        c = self._moe.mcfg
        for layer, mlp in self._moe.local.items():
            want = {"mlp.router.weight"}
            want |= set(megatron_moe_suffixes(self._moe.E_local, expert_format(mlp.experts)))
            if getattr(c, "moe_shared_expert_intermediate_size", None):
                want |= {"mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"}
                if getattr(c, "moe_shared_expert_gate", False):
                    want.add("mlp.shared_experts.gate_weight")
            for suffix in want:
                bound.pop(("layer", layer, suffix), None)

    # ---- metadata ---------------------------------------------------------------------------

    def _dst(self, unit: Unit) -> int:
        """The global rank that sends ``unit``'s HF tensors (and gathers its TP pieces): rank 0, or
        with ``senders="owners"`` the first rank of its stage in rank 0's replica."""
        return 0 if self.senders == "rank0" else self._stage_ranks(unit)[0]

    def _stage_ranks(self, unit: Unit) -> tuple[int, ...]:
        """The TP ranks (in TP order) that gather ``unit`` for its sender: its stage in its replica."""
        return self._topo.stage_ranks(unit.stage, self._unit_replica.get(unit.key, 0))

    def _unit_metas(self, unit: Unit) -> list[ParamMeta]:
        if self.mode == "full":
            owner = (self._dst(unit),)
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
        yield from megatron_pieces(self)

    # ---- pieces -----------------------------------------------------------------------------

    def _piece_rows(self, unit: Unit, tp_rank: int) -> int | None:
        """Rows of TP shard ``tp_rank`` that are real vocabulary (None: not a vocab unit)."""
        if unit.kind is not VOCAB:
            return None
        start, stop = vocab_rows(self.geometry.vocab, self.geometry.padded_vocab, self._topo.tp, tp_rank)
        return stop - start

    def _piece_shape(self, unit: Unit, tp_rank: int) -> tuple[int, ...]:
        rows = self._piece_rows(unit, tp_rank)
        return unit.shard_shape if rows is None else (rows, *unit.shard_shape[1:])

    def _piece(self, unit: Unit, stats: PassStats) -> torch.Tensor:
        """This rank's shard of ``unit`` in the wire dtype, vocabulary padding cut, contiguous."""
        param = self._bound[unit.key].param.detach()
        rows = self._piece_rows(unit, self._topo.tp_rank)
        if rows is not None:
            param = param[:rows]
        piece = unit.kind.to_wire(param, self._wd[unit.key]).contiguous()
        if piece.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            stats.hold(piece.numel() * piece.element_size())
        return piece

    def _geometry_kw(self, unit: Unit) -> dict[str, Any]:
        return {
            "heads_per_group": self.geometry.heads_per_group,
            "head_dim": self.geometry.head_dim,
            "stack_rows": tuple(s[0] for s in unit.shapes),
            **self._layout_kw,
        }

    def _senders(self, unit: Unit) -> tuple[int, ...]:
        """Global ranks whose piece of ``unit`` the gatherer needs, in TP order (empty pieces dropped)."""
        ranks = self._stage_ranks(unit)
        if unit.kind.dim is None:  # every TP rank holds all of it (norms, duplicated linears)
            return ranks[:1]
        if unit.kind is VOCAB:
            return tuple(r for t, r in enumerate(ranks) if self._piece_rows(unit, t) > 0)
        return ranks

    def _local_step(self, unit: Unit) -> LocalStep | None:
        """How rank 0 exports ``unit`` when it alone holds all of it, or None (``megatron.whole_units``).

        That is every unit of rank 0's stage at tp=1, and replicated ones (norms) at any tp."""
        topo = self._topo
        dst = self._dst(unit)
        if topo.rank != dst or unit.stage != topo.pp_rank or self._senders(unit) != (dst,) or unit.key not in self._bound:
            return None
        return local_step(
            self._bound[unit.key].param,
            kind=unit.kind,
            rows=self._piece_rows(unit, 0),
            piece_shape=self._piece_shape(unit, 0),
            out_shapes=unit.shapes,
            dtype=self._wd[unit.key],
            names=unit.names,
            **self._geometry_kw(unit),
        )

    def _gather_to(self, unit: Unit, dst: int, stats: PassStats) -> list[torch.Tensor] | None:
        """Point-to-point gather of ``unit``'s pieces to global rank ``dst`` (``p2p.gather_to``).

        Returns the pieces in TP order on ``dst``; on a sender returns None after its send has
        completed. Every participant walks the plan in the same order, so sends and receives pair up.
        """
        rank = self._topo.rank
        stage_ranks = self._stage_ranks(unit)
        wd = self._wd[unit.key]
        pieces = [Piece(src, self._piece_shape(unit, stage_ranks.index(src)), wd) for src in self._senders(unit)]
        got = gather_to(
            pieces, dst, local=lambda i: self._piece(unit, stats), device=self._device,
            timeout_s=self.timeout_s, what=repr(unit.names[0]), stats=stats,
        )
        if got is None:
            if any(p.src == rank for p in pieces):
                stats.hold(-stats._extra)
            return None
        stats.hold(sum(t.numel() * t.element_size() for t, p in zip(got, pieces) if p.src != rank))
        return got

    def _post(self, unit: Unit, stats: PassStats) -> PostedGather:
        """``unit``'s gather to rank 0, posted (``p2p.post_gather``); its ``held_bytes`` is the
        memory it holds until finished (receive buffers, pieces cast for sending), already in ``stats``."""
        stage_ranks = self._stage_ranks(unit)
        wd = self._wd[unit.key]
        pieces = [Piece(src, self._piece_shape(unit, stage_ranks.index(src)), wd) for src in self._senders(unit)]
        before = stats._extra
        posted = post_gather(
            pieces, self._dst(unit), local=lambda i: self._piece(unit, stats), device=self._device,
            what=repr(unit.names[0]), stats=stats,
        )
        stats.hold(posted.held_bytes)
        posted.held_bytes = stats._extra - before
        return posted

    def _ahead(self, k: int, posted: dict[int, PostedGather], stats: PassStats) -> None:
        """Overlap, on rank 0 (the receiver) only: post the receives of the next steps that move
        anything -- steps rank 0 holds whole (norms at TP > 1) move nothing and are looked past --
        while the units already posted ahead hold less than ``ahead_bytes`` of HF tensor bytes (so
        less than ``ahead_bytes`` + one unit ahead; a unit larger than the budget still goes ahead
        once what is before it is under the budget), never past a MoE layer's export (its
        transfers keep their place). Peers post each send at its own step, as without overlap: rank 0's receives being
        posted is what lets the next sends run while rank 0's consumer handles this unit, and a peer
        never has more than one cast piece out. Between any two ranks the transfers are posted in
        plan order on both sides, so they pair up as without overlap (``ahead.py`` says why the
        budget is in bytes, not units)."""
        rank = self._topo.rank
        if not self.overlap or rank != self._dst(self._steps[k][0]) or self._steps[k][2] is not None:
            return
        held = sum(self._unit_bytes(self._steps[i][0]) for i in posted)
        j = k + 1
        while j < len(self._steps):
            unit, local, moe_layer = self._steps[j]
            if local is None and j not in posted and self._dst(unit) == rank:
                if held >= self.ahead_bytes:
                    return
                posted[j] = self._post(unit, stats)
                held += self._unit_bytes(unit)
                stats.ahead_peak_bytes = max(
                    stats.ahead_peak_bytes, sum(g.held_bytes for g in posted.values())
                )
            if moe_layer is not None:
                return
            j += 1

    @cached_property
    def _is_gatherer(self) -> bool:
        """This rank receives TP pieces of some unit (rank 0; with ``senders="owners"`` each stage's first rank)."""
        return any(self._dst(u) == self._topo.rank for u in self.plan)

    def _unit_bytes(self, unit: Unit) -> int:
        """Bytes of ``unit``'s HF tensors in its wire dtype (what rank 0 holds once it is concatenated)."""
        wd = self._wd[unit.key]
        return sum(nbytes(shape, wd) for shape in unit.shapes)

    # ---- full mode ----------------------------------------------------------------------------

    def _full_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        stats = self.last_pass = PassStats().start()
        if self._moe is not None:
            self._moe.stats = stats
        tensors = sent = peak = held = 0
        posted: dict[int, PostedGather] = {}  # step -> its transfer, posted ahead (overlap)
        split_ahead: SplitAhead | None = None
        try:
            self._start()
            # Ranks of other data-parallel replicas have no dense unit to send, but with expert
            # parallelism they hold other experts: they still walk every MoE layer's export.
            dense = self._topo.in_sender_replica or bool(self._unit_replica)
            if not dense and self._moe is None:
                return
            casts, peak = precast(self._precast, self.dtype) if self._precast else (iter(()), 0)
            transfers = self.overlap and any(s[1] is None for s in self._steps)  # none at TP1 on rank 0
            if transfers and self._is_gatherer and self._device.type == "cpu":
                split_ahead = SplitAhead()  # rank 0's concatenation / splits off this thread (megatron/ahead.py)
            for k, (unit, local, moe_layer) in enumerate(self._steps):
                if local is not None and local.views is not None and local.param.data_ptr() == local.ptr:
                    tensors += len(local.views)
                    sent += local.total
                    yield from local.views  # split at construction: views of the parameter (whole_units)
                elif local is not None and local.identity:
                    tensors += 1
                    sent += local.total
                    yield unit.names[0], next(casts)  # its piece of the batched cast is the HF tensor
                elif local is not None:
                    if local.precast:
                        t = next(casts)
                    else:
                        t = local.param.detach()
                        if local.rows is not None:
                            t = t[: local.rows]
                        if t.dtype != local.dtype:
                            t = t.to(local.dtype)
                    outs = local.split(t)
                    del t
                    held = max(held, local.extra)
                    for name, out, size in zip(unit.names, outs, local.sizes):
                        tensors += 1
                        sent += size
                        yield name, out
                    del outs
                elif dense:
                    mine = posted.pop(k, None) or self._post(unit, stats)
                    self._ahead(k, posted, stats)
                    done = split_ahead.take(k) if split_ahead is not None else None  # waited + concatenated
                    pieces = mine.finish(self.timeout_s)  # bounded wait (nothing left if the helper waited)
                    if split_ahead is not None:  # rank 0, CPU: the units posted ahead on the helper
                        for j in sorted(posted):
                            split_ahead.start(j, posted[j], partial(self._concat, self._steps[j][0], stats=stats, gather=posted[j]),
                                              self.timeout_s)
                    copies = 0
                    if pieces is not None or done is not None:
                        outs, copies = done if done is not None else self._concat(unit, pieces, stats=stats)
                        del pieces, done
                        for name, out in zip(unit.names, outs):
                            stats.yielded(nbytes(out.shape, out.dtype))
                            yield name, out
                        del outs
                    stats.hold(-(mine.held_bytes + copies))
                    del mine
                if local is not None and transfers:
                    self._ahead(k, posted, stats)  # (after the yields: a whole unit is host work)
                if moe_layer is not None:
                    yield from self._moe.export(moe_layer)  # type: ignore[union-attr]
        finally:
            if split_ahead is not None:
                split_ahead.close()
            for g in posted.values():  # a consumer stopped early: wait out what was posted ahead
                g.drain(self.timeout_s)
                stats.hold(-g.held_bytes)
            stats.tensors += tensors
            stats.bytes += sent
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, peak + held)
            stats.stop()

    def _concat(
        self, unit: Unit, pieces: list[torch.Tensor], *, stats: PassStats, gather: PostedGather | None = None
    ) -> tuple[tuple, int]:
        """``unit``'s HF tensors from its received pieces, and the bytes of those that are copies
        (held from now on; outputs that are views of a piece are held already). With ``gather``
        (the helper, ``megatron/ahead.py``), pieces no output is a view of are dropped at once and
        no longer counted: ahead of the unit being yielded rank 0 holds its pieces or its outputs."""
        outs = unit.kind.concat(pieces, **self._geometry_kw(unit))
        have = {p.untyped_storage().data_ptr() for p in pieces}
        copies = sum(nbytes(o.shape, o.dtype) for o in outs if o.untyped_storage().data_ptr() not in have)
        stats.hold(copies)
        if gather is not None and copies and not any(o.untyped_storage().data_ptr() in have for o in outs):
            stats.hold(-gather.held_bytes)
            gather.held_bytes = 0
            gather.release_pieces()
        return outs, copies

    # ---- local mode ---------------------------------------------------------------------------

    def _local_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        stats = self.last_pass = PassStats().start()
        try:
            self._start()
            if not self._topo.in_sender_replica:
                return
            for unit in self.plan:
                if unit.stage != self._topo.pp_rank:
                    continue
                if (unit.kind is VOCAB and not self._vocab_chunked) or not unit.kind.chunked:
                    # Fallback: the stage's first TP rank owns the whole (trimmed) tensor.
                    pieces = self._gather_to(unit, self._topo.stage_ranks(unit.stage)[0], stats)
                    if pieces is None:
                        continue
                    outs = unit.kind.concat(pieces, **self._geometry_kw(unit))
                else:
                    outs = unit.kind.split(self._piece(unit, stats), **self._geometry_kw(unit))
                for name, out in zip(unit.names, outs):
                    stats.yielded(out.numel() * out.element_size())
                    yield name, out
                del outs
                stats.hold(-stats._extra)
        finally:
            stats.stop()
