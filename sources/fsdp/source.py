"""``FSDPSource``: a vLLM ``WeightSource`` over a plain, FSDP2, HSDP or FSDP+TP ``nn.Module``.

(Over 500 lines: one class whose three passes -- full, local, pieces -- share one cached item
state; its LoRA items, expert choice, pieces producer, gathers and plan already live apart.)

Invariants (each is tested multi-rank in ``tests/test_fsdp.py``):

* **Names** are Hugging Face checkpoint names (``naming.checkpoint_entries``): wrappers stripped,
  tied duplicates dropped exactly where ``save_pretrained`` drops them, transformers' own save-time
  conversions reverted with its code (``core/hf/conversions.py``); what cannot be reverted while
  streaming raises ``UnmappedParameterError`` at ``metadata`` time, on every rank.
* **Metadata** is computed from global shapes and module structure only: no collective, no tensor
  data, identical on every rank. ``dtype`` is the wire dtype (``wire.WirePolicy``), ``shape`` the
  full shape; ``owners``/``mesh_shape``/``placements`` follow vLLM's ``ModuleSource`` so this is a
  drop-in wherever vLLM takes ``ModuleSource(model)``.
* **Gathers** are batched per FSDP unit and mesh (``plan``): one all-gather per contiguous
  run of a unit's tensors in checkpoint order (split at ``group_bytes``, 64 MiB by default), each shard
  cast to the wire dtype before it moves (``gather.BatchedGather``). ``_StridedShard`` and other exotic
  placements fall back to ``full_tensor()`` per tensor (``shards.fallback_full``).
* **Lifetime**: every gathered tensor is a fresh allocation owned by the consumer -- it stays
  valid after the next yield and after the pass (vLLM's unpacked IPC path keeps them all). Tensors
  that need no gather (plain parameters, ignored parameters, Replicate-only DTensors already in
  the wire dtype) are yielded as detached aliases of the module's storage (no copy): valid until
  the trainer next updates the module. The source itself never writes to the module.
* **Overlap** (``overlap=True``, the default; ``prefetch.GatherPipeline``): the next gather group's
  collective is posted (packed and issued, not waited for) before the current group's tensors are
  yielded, so it runs while the consumer handles them. The collectives, their order, the names,
  bytes and checks are exactly those of ``overlap=False``; posting happens in the iterating thread at
  the same plan points on every rank. On CUDA the packing and the collective run on a side stream
  that first waits for the default stream (the optimizer's writes) and for the caller's current
  stream; the consumer's stream waits for the gather's event before a tensor is unpacked on it
  (``gather.BatchedGather``). A pass stopped early (the consumer raised, or closed the generator)
  waits out the gathers it posted ahead (bounded) before returning: when every rank stops at the
  same point the groups stay aligned and the next pass works (``prefetch``'s docstring says what
  happens when ranks stop at different points). ``overlap=None`` reads ``WEIGHTSYNC_OVERLAP``
  (``0`` turns it off; for debugging and A/B runs).
* **Memory**: beyond what the consumer keeps, the source holds the gather group being yielded and the
  groups posted ahead: per group the send buffer (this rank's share, ~1/n of the group) + the
  gathered buffer (the group's wire bytes, rows padded to a multiple of n), plus the tensor being
  unpacked. Ahead: one group by default, or groups of at most ``prefetch_bytes`` together (the next
  group always, whatever its size); ``overlap=False``: none. On CPU, overlap also packs the send
  block of the group after those ahead and unpacks one tensor ahead of the consumer on a helper
  thread (``prefetch``): one more send block (~1/n of a group) and one more tensor. Units are not held across other
  units: a unit split by checkpoint order is gathered once per run instead. With
  ``CPUOffloadPolicy`` the packing copy stages each shard to the gather device; the module's
  parameters stay where they were.
* **Ownership**: like ``ModuleSource``, a DTensor is owned by its mesh's ranks -- except a DTensor
  on a sub-mesh that does not span the world (FSDP over the data-parallel dim of an FSDP+TP world),
  which is declared owned by every rank and replicated, so metadata stays identical across ranks.
* **Bounded**: on gloo each batched gather waits through ``groups.wait_bounded`` (``timeout_s``):
  a rank that stops iterating becomes a ``SyncTimeoutError`` naming it, not a hang. The
  ``full_tensor()`` fallback and device backends rely on the process group's own timeout.
* **Checks**: each pass checks its stream against ``metadata`` on every rank (``check=True``), and
  the first pass verifies cross-rank metadata agreement before any gather (``agree=True``).
* **Many senders** (``senders="owners"``, vLLM 0.34's NCCL engine; HSDP only, ``plan.hsdp_replicas``):
  each replica's shard group gathers and its first rank sends one contiguous, byte-balanced run of
  the stream; no gather crosses replicas; plain FSDP is refused (``core/comm/senders.py`` says why).
* **PEFT LoRA** (``lora.LoraPlan``): a PEFT model exports its base checkpoint, merged. The tensors
  gathered are *items* (``lora_items.LoraItems``: each LoRA-merged base weight followed by its A/B,
  merged in fp32 or wider before the cast to the wire dtype); metadata lists base names and shapes
  only, so the first pass's cross-rank agreement also covers every gathered item (ranks with other
  adapters raise instead of posting mismatched gathers). Without PEFT, items are the entries and
  the pass runs exactly the code it always ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..core.check.stream import DEFAULT_TIMEOUT_S, check_stream, local_shape, verify_metadata_agreement
from ..core.comm.senders import Senders, check_senders, require_many_senders
from ..core.ground.dtype_policy import WirePolicy
from ..core.ground.logs import current_rank, get_logger
from ..core.ground.overlap import overlap_default
from ..core.ground.stats import PassStats
from ..core.hf.experts import expert_transform_for
from ..core.hf.naming import CheckpointEntry, TensorTransform, checkpoint_entries
from ..core.hf.receiver_writes import copy_written, written_by_receiver
from ..core.layouts.pieces import Piece
from .gather import BatchedGather, GatherShard, after_default_stream, side_stream
from .lora import LoraPlan
from .lora_items import LoraItems
from .pieces import FSDPPiecesView, fsdp_pieces
from .plan import dtensor_layout, fsdp_units, hsdp_replicas, is_dtensor, is_member, item_replicas, plan_steps
from .prefetch import GatherPipeline
from .shards import fallback_full, gather_device, local_of

__all__ = ["FSDPSource", "DEFAULT_GROUP_BYTES"]

#: Default bound on one gather group's wire bytes (``FSDPSource(group_bytes=)``): a unit larger
#: than this gathers in several groups, so the overlap pipeline never waits for one huge gather.
DEFAULT_GROUP_BYTES = 64 << 20

logger = get_logger(__name__)


class FSDPSource(WeightSource):
    """Hugging Face checkpoint tensors of ``module``, gathered per FSDP unit.

    Args:
        module: the trainer's model: plain, ``fully_shard``-ed (FSDP2 / HSDP), FSDP+TP, possibly
            wrapped by ``torch.compile`` / activation checkpointing / DDP-style wrappers.
        dtype: wire dtype for floating tensors (None: each tensor's own dtype). Cast happens on
            the local shard, before the gather.
        keep_fp32: extra regular expressions (``re.search`` on the checkpoint name) of tensors
            that keep their own dtype, on top of ``core.ground.dtype_policy.DEFAULT_KEEP_FP32`` (MoE routers/gates).
        group_bytes: split a unit's gather into groups of at most this many wire bytes (default
            ``DEFAULT_GROUP_BYTES``, 64 MiB; None: one gather per contiguous run of a unit; a
            single larger tensor still gathers alone). The bound is what overlap pipelines: the
            first group's gather and the gather of the group after a small one are exposed, so
            few, wide units (one all-gather per wide layer) overlapped their consumer less than
            bounded groups do (docs/evidence.md has the measurement); models whose layers are
            under the bound gather exactly as before.
        include_buffers: also send persistent buffers (they are in the checkpoint).
        transforms: ``naming.TensorTransform`` hooks for tensors whose checkpoint form differs
            from their in-memory form (applied after the gather).
        expert_layout: wire layout of transformers-5 fused MoE experts
            (``experts.gate_up_proj`` / ``down_proj``): ``"per_expert"`` (what ``save_pretrained``
            writes) or ``"fused"`` (the fused names vLLM 0.33 and 0.34 load). None: the target checkpoint's
            layout (``experts.default_expert_layout``: per expert, except GPT-OSS's fused experts),
            applied only when the module has fused experts that ``transforms`` does not already
            handle; models without experts are unaffected. Fused experts transformers cannot map
            back to checkpoint names raise ``UnmappedParameterError`` (naming the parameter and
            rank) at construction, on every rank, before any collective.
        overlap: post the next gather group before yielding this one's tensors (see the module
            docstring). None: on unless the environment sets ``WEIGHTSYNC_OVERLAP=0``.
        prefetch_bytes: with overlap, the most bytes (send + gathered buffers) of gather groups
            posted ahead of the group being yielded; the next group is always posted, whatever its
            size. None: exactly one group ahead (peak extra memory ~ two groups).
        check: check each pass's stream against metadata on this rank.
        agree: verify on the first pass that every rank holds the same metadata.
        rank: this trainer rank (default: the default process group's rank).
        senders: ``"rank0"`` (default: every rank iterates every tensor, rank 0 sends) or
            ``"owners"`` (vLLM 0.34's NCCL engine; HSDP only): the tensors, in stream order, are cut
            into one contiguous run per replica, balanced by wire bytes
            (``core.comm.senders.split_contiguous``); each replica's shard group gathers only its own
            run, among its own ranks, and the replica's first rank sends it -- no gather across
            replicas. Metadata owners are that replica's ranks. Plain FSDP, FSDP+TP or per-parameter
            meshes raise ``ValueError`` naming HSDP (``plan.hsdp_replicas`` says why); so does a
            vLLM without many senders (0.33). Construction is then collective (the cross-rank
            agreement runs here: vLLM pulls each sender's pass only on its own turn).

    A PEFT LoRA model (``get_peft_model(...)``, wrapped and sharded like any model) exports the
    merged base checkpoint -- what ``merge_and_unload().save_pretrained()`` writes -- without
    modifying the model; unsupported adapters (DoRA, LoRA on embeddings, other tuners, ...) raise
    ``lora.UnsupportedAdapterError`` here, on every rank. See ``sources/fsdp/lora.py``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        keep_fp32: str | Iterable[str] = (),
        group_bytes: int | None = DEFAULT_GROUP_BYTES,
        include_buffers: bool = True,
        transforms: Sequence[TensorTransform] = (),
        expert_layout: str | None = None,
        overlap: bool | None = None,
        prefetch_bytes: int | None = None,
        check: bool = True,
        agree: bool = True,
        rank: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        senders: Senders = "rank0",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module= must be a torch.nn.Module, got {type(module).__name__}")
        if group_bytes is not None and (
            isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes <= 0
        ):
            raise ValueError(f"group_bytes= must be a positive int or None, got {group_bytes!r}")
        if prefetch_bytes is not None and (
            isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int) or prefetch_bytes < 0
        ):
            raise ValueError(f"prefetch_bytes= must be a non-negative int or None, got {prefetch_bytes!r}")
        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"overlap= must be a bool or None, got {overlap!r}")
        for t in transforms:
            if not isinstance(t, TensorTransform):
                raise TypeError(
                    f"transforms= entries must implement TensorTransform "
                    f"(handles/entries/apply), got {type(t).__name__}"
                )
        self._module = module
        self.lora = LoraPlan.for_module(module, rank=rank)  # unsupported adapters raise here
        self.wire = WirePolicy.build(dtype, keep_fp32)
        self.group_bytes = group_bytes
        self.overlap = overlap_default() if overlap is None else overlap
        self.prefetch_bytes = prefetch_bytes
        self.include_buffers = include_buffers
        self.transforms = tuple(transforms)
        hf = module if self.lora is None else self.lora.hf_model
        self.expert_transform = expert_transform_for(hf, expert_layout, self.transforms, rank=rank, who="FSDPSource")
        if self.expert_transform is not None:
            self.transforms += (self.expert_transform,)
        self.check = check
        self.agree = agree
        self._rank = rank
        self.timeout_s = timeout_s
        self._agreed = False
        self.last_pass = PassStats()
        #: who sends each tensor (``core/comm/senders.py``)
        self.senders: Senders = check_senders(senders, rank=self.rank, who="FSDPSource")
        if senders == "owners":
            require_many_senders(rank=self.rank, who="FSDPSource")
            #: HSDP replicas, each its shard group's global ranks (``plan.hsdp_replicas``)
            self.replicas = hsdp_replicas(self._resolve(), rank=self.rank)
            if self.agree:  # collective at construction: no exchange can run inside a pass
                verify_metadata_agreement(
                    self._agreement_metas(self.metadata), timeout_s=self.timeout_s, what="FSDPSource metadata"
                )
                self._agreed = True

    # ---- metadata (no collective) -------------------------------------------------------------

    @property
    def checks_stream(self) -> bool:
        """Every pass checks its own stream against ``metadata`` (``CheckedSource`` relies on it)."""
        return self.check

    @property
    def rank(self) -> int:
        return current_rank() if self._rank is None else self._rank

    @cached_property
    def entries(self) -> list[CheckpointEntry]:
        """Checkpoint entries (one per in-memory tensor sent), in checkpoint order."""
        if self.lora is None:
            return checkpoint_entries(
                self._module, include_buffers=self.include_buffers, transforms=self.transforms
            )
        return checkpoint_entries(
            self._module,
            include_buffers=self.include_buffers,
            transforms=self.transforms,
            rename=self.lora.rename,
            root=self.lora.hf_model,
        )

    @cached_property
    def _lora_items(self) -> LoraItems | None:
        """A PEFT model's gathered items and their merge (``lora_items.LoraItems``); None without
        PEFT, where the items are the entries."""
        if self.lora is None:
            return None
        return LoraItems.build(self.entries, self.lora, rank=self.rank)

    @cached_property
    def _items(self) -> list[tuple[str, bool]]:
        """``(in-memory path, is_buffer)`` of every tensor a pass gathers, in stream order: the
        entries, each LoRA-merged base weight followed by its A, B per adapter."""
        if self._lora_items is None:
            return [(e.path, e.is_buffer) for e in self.entries]
        return list(self._lora_items.paths)

    @cached_property
    def _item_keys(self) -> list[str]:
        """Each item's name in gather messages: its checkpoint name (an A/B: its in-memory path)."""
        if self._lora_items is None:
            return [e.name for e in self.entries]
        return self._lora_items.keys(self.entries)

    def _entry_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._lora_items is None:
            return tensors
        return self._lora_items.entry_tensors(tensors)

    @cached_property
    def _slots(self) -> list[tuple[dict, str]]:
        """Where each item's tensor is registered: ``(module._parameters or _buffers, attr)``.

        Read afresh every pass (FSDP2 re-registers parameters when it unshards / reshards), at the
        cost of one dict lookup per tensor instead of a walk of the module tree.
        """
        slots = []
        for path, is_buffer in self._items:
            owner_path, _, attr = path.rpartition(".")
            owner = self._module.get_submodule(owner_path) if owner_path else self._module
            slots.append((owner._buffers if is_buffer else owner._parameters, attr))
        return slots

    def _resolve(self) -> list[torch.Tensor]:
        return [table[attr] for table, attr in self._slots]

    @cached_property
    def _units(self) -> dict[int, int]:
        return fsdp_units(self._module)

    def _plan(self, tensors: list[torch.Tensor]):
        """Steps for this pass; reused while the registered tensors are the same objects."""
        cached = getattr(self, "_plan_cache", None)
        if cached is not None and len(cached[0]) == len(tensors) and all(
            a is b for a, b in zip(cached[0], tensors)
        ):
            return cached[1]
        owned = [t if is_member(t) and self._sends_item(i) else None for i, t in enumerate(tensors)]
        steps = plan_steps(owned, self._wire_dtypes, self._units, self.group_bytes)
        self._plan_cache = (list(tensors), steps)
        return steps

    @cached_property
    def _item_replica(self) -> list[int]:
        """``senders="owners"``: the replica that gathers and sends each item (``plan.item_replicas``);
        a LoRA base travels with its A/B."""
        tensors = self._resolve()
        sizes = [t.numel() * wd.itemsize for t, wd in zip(tensors, self._wire_dtypes)]
        atoms = list(range(len(tensors))) if self._lora_items is None else self._lora_items.atoms()
        return item_replicas(sizes, atoms, len(self.replicas))

    @cached_property
    def _my_replica(self) -> int:
        return next(r for r, row in enumerate(self.replicas) if self.rank in row)

    def _sends_item(self, i: int) -> bool:
        return self.senders == "rank0" or self._item_replica[i] == self._my_replica

    @cached_property
    def _out_dtypes(self) -> list[torch.dtype]:
        """Wire dtype of each entry (what metadata declares)."""
        return [
            self.wire.dtype_for(e.name, t.dtype)
            for e, t in zip(self.entries, self._entry_tensors(self._resolve()))
        ]

    @cached_property
    def _wire_dtypes(self) -> list[torch.dtype]:
        """Dtype each item is gathered in: its wire dtype (cast before the gather), except a
        LoRA-merged base weight and its A/B, which travel in their own dtype (merged, then cast)."""
        if self._lora_items is None:
            return self._out_dtypes
        return self._lora_items.wire_dtypes(self._resolve(), self._out_dtypes)

    @property
    def module(self) -> nn.Module:
        """The module this source streams, as it was passed (wrappers included); never modified."""
        return self._module

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas: list[ParamMeta] = []
        merged = frozenset() if self._lora_items is None else self._lora_items.merged_entries
        tensors = self._entry_tensors(self._resolve())
        for k, (e, t, wd) in enumerate(zip(self.entries, tensors, self._out_dtypes)):
            layout = dtensor_layout(t)
            if self.senders == "owners":  # the entry's replica: its shard group, first rank sends
                row = self.replicas[self._item_replica[k if self._lora_items is None else self._lora_items.entry_item[k]]]
                shard = None if layout is None or layout[2] is None or k in merged else (layout[2][-1],)
                layout = (tuple(row), (len(row),), shard)
            if layout is not None and k in merged:
                # The merged tensor exists in full only: iter_local gathers it (placements None).
                layout = (layout[0], layout[1], None)
            shape = tuple(t.shape)  # a DTensor's global shape: no communication
            if e.transform is not None:  # owned like the entry, no placements
                where = {} if layout is None else {"owners": layout[0], "mesh_shape": layout[1]}
                metas += [ParamMeta(name, wd, tuple(oshape), **where) for name, oshape in e.transform.entries(e.name)]
                continue
            if layout is None:
                metas.append(ParamMeta(e.name, wd, shape))
            else:
                owners, mesh_shape, placements = layout
                metas.append(
                    ParamMeta(e.name, wd, shape, owners=owners, mesh_shape=mesh_shape, placements=placements)
                )
        return metas

    def _expected(self) -> list[ParamMeta]:
        r = self.rank
        return [m for m in self.metadata if m.owners is None or r in m.owners]

    def _start_pass(self) -> PassStats:
        stats = self.last_pass.start()
        if self.lora is not None:
            self.lora.check_state()  # before any collective
        meta = self.metadata  # raises UnmappedParameterError etc. before any collective
        if self.agree and not self._agreed:
            verify_metadata_agreement(
                self._agreement_metas(meta), timeout_s=self.timeout_s, what="FSDPSource metadata"
            )
            self._agreed = True
        return stats

    def _agreement_metas(self, meta: list[ParamMeta]) -> list[ParamMeta]:
        """What ranks must agree on before the first gather: the metadata, and for a PEFT model
        every gathered item as it travels (LoRA A/B, merged bases in their own dtype) -- ranks
        with other adapters (rank, targets, active/disabled state) would otherwise post gathers of
        different sizes under identical metadata."""
        if self.lora is None:
            return meta
        tensors = self._resolve()
        items = [
            ParamMeta(f"[gathered] {key}", wd, tuple(t.shape))
            for key, t, wd in zip(self._item_keys, tensors, self._wire_dtypes)
        ]
        return meta + items

    # ---- passes -------------------------------------------------------------------------------

    def _emit(self, i: int, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        e = self.entries[i]
        if e.transform is None:
            yield e.name, tensor
        else:
            yield from e.transform.apply(e.name, tensor)

    def _plain(self, t: torch.Tensor, wd: torch.dtype) -> torch.Tensor:
        return t.detach().to(dtype=wd).contiguous()

    def _raw_full(self, stats: PassStats) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = self._resolve()
        wds = self._wire_dtypes
        steps = self._plan(tensors)
        emit = self._emit if self._lora_items is None else self._lora_items.merger(self._emit, self._out_dtypes, stats)
        keys = self._item_keys

        def make(k: int) -> BatchedGather:
            step = steps[k]
            mesh, axis = step.mesh, step.axis
            shards = [
                GatherShard(keys[i], local_of(tensors[i]), tuple(tensors[i].shape), wds[i])
                for i in step.indices
            ]
            return BatchedGather(
                shards,
                group=mesh.get_group(axis),
                n=mesh.size(axis),
                index=mesh.get_local_rank(axis),
                device=step.device,
                stats=stats,
                timeout_s=self.timeout_s,
                stream=side_stream(step.device) if self.overlap else None,
            )

        pipe = GatherPipeline(steps, make, overlap=self.overlap, prefetch_bytes=self.prefetch_bytes)
        try:
            for k, step in enumerate(steps):
                if step.kind == "plain":
                    i = step.indices[0]
                    pipe.ahead(k)
                    yield from emit(i, self._plain(tensors[i], wds[i]))
                elif step.kind == "full":
                    i = step.indices[0]
                    full = fallback_full(tensors[i], wds[i], step.device, stats)
                    stats.hold(full.numel() * full.element_size())
                    pipe.ahead(k)  # after the fallback's collective: never in flight across it
                    yield from emit(i, full)
                    stats.hold(-full.numel() * full.element_size())
                elif step.mesh.size(step.axis) == 1:
                    # A one-rank shard axis holds the whole tensor: nothing to gather. Cast/stage it
                    # (an alias when already in the wire dtype on the gather device, like a plain
                    # tensor), so a world-size-1 FSDP2 model costs what a plain module does.
                    pipe.ahead(k)
                    after_default_stream(step.device)
                    for i in step.indices:
                        local = local_of(tensors[i]).to(device=step.device, dtype=wds[i])
                        yield from emit(i, local.contiguous())
                else:
                    gather = pipe.take(k)
                    pipe.ahead(k)
                    index_of = {keys[i]: i for i in step.indices}
                    for name, full in gather:
                        yield from emit(index_of[name], full)
        finally:
            pipe.close()
            stats.ahead_peak_bytes = max(stats.ahead_peak_bytes, pipe.peak_ahead_bytes)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors of every owned name, in metadata order (collective over each mesh)."""
        stats = self._start_pass()
        raw = self._raw_full(stats)
        stream = check_stream(raw, self._expected(), rank=self.rank) if self.check else raw
        try:
            for name, tensor in copy_written(stream, self._receiver_writes):
                stats.yielded(tensor.numel() * tensor.element_size())
                yield name, tensor
        finally:
            # A pass stopped early (consumer raised / closed us, or a check failed): close the raw
            # pass now, not at garbage collection, so the gathers it posted ahead are waited out
            # before this generator returns (``prefetch.GatherPipeline.close``).
            stream.close()
            raw.close()
        stats.stop()
        logger.debug("iter_full pass: %s", stats.as_dict())

    def _raw_local(self, stats: PassStats) -> Iterator[tuple[str, torch.Tensor]]:
        all_tensors = self._resolve()
        tensors = self._entry_tensors(all_tensors)
        wds = self._out_dtypes
        lora = self._lora_items
        for i, (e, t, wd) in enumerate(zip(self.entries, tensors, wds)):
            if not is_member(t):
                continue
            merged = None if lora is None else lora.merged_item(i)
            if merged is not None:
                yield from self._emit(i, lora.merged_full(merged, all_tensors, wds, stats))
                continue
            if not is_dtensor(t):
                yield from self._emit(i, self._plain(t, wd))
                continue
            layout = dtensor_layout(t)
            device = gather_device(t.device_mesh)
            if layout is None or layout[2] is None or e.transform is not None:
                yield from self._emit(i, fallback_full(t, wd, device, stats))
            else:
                local = local_of(t)
                yield e.name, local.to(device=device, dtype=wd).contiguous()

    def implements_iter_local(self) -> bool:
        return self.senders == "rank0"

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's piece of every owned name per ``placements`` (cast, staged to the mesh's
        device); tensors without plain placements are gathered in full."""
        if self.senders != "rank0":
            raise NotImplementedError("FSDPSource(senders='owners') implements iter_full() (vLLM's NCCL engine) only")
        stats = self._start_pass()
        stream = self._raw_local(stats)
        if self.check:
            expected = self._expected()
            shapes = [local_shape(m, self.rank) for m in expected]
            stream = check_stream(stream, expected, rank=self.rank, what="iter_local", local_shapes=shapes)
        for name, tensor in copy_written(stream, self._receiver_writes):
            stats.yielded(tensor.numel() * tensor.element_size())
            yield name, tensor
        stats.stop()

    def iter_pieces(self) -> Iterator[Piece]:
        """This rank's shard of every checkpoint tensor as boxes in checkpoint coordinates, cast to
        the wire dtype, gathering only what cannot be cut into boxes (``fsdp/pieces.py``; the
        protocol: ``core/layouts/pieces.py``). What ``DeltaSource`` diffs where the shard lives."""
        stats = self._start_pass()
        yield from fsdp_pieces(self._pieces_view, stats, self.rank)
        stats.stop()

    @cached_property
    def _pieces_view(self) -> FSDPPiecesView:
        """What ``fsdp_pieces`` reads of this source (kept: its box cache lasts across passes)."""
        return FSDPPiecesView(self.entries, self._out_dtypes, self._resolve, self._lora_items)

    @cached_property
    def _receiver_writes(self) -> frozenset[str]:
        """Names yielded as copies because a vLLM loader writes into them (``core/receiver_writes``)."""
        return written_by_receiver(m.name for m in self.metadata)

    def __repr__(self) -> str:
        return (
            f"FSDPSource({type(self._module).__name__}, dtype={self.wire.dtype}, "
            f"group_bytes={self.group_bytes}, overlap={self.overlap})"
        )
