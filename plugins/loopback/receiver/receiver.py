"""The inference side of the loopback backend: a model that receives weights like a vLLM worker.

``LoopbackReceiver(model)`` implements vLLM's four-phase weight-sync protocol
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``) plus the pause routes, for any ``torch.nn.Module`` -- typically a
Hugging Face model, whose ``state_dict`` names are the checkpoint names vLLM's loaders accept.

Invariants:

* Strict, ``load_state_dict(strict=True)``-style: every name in an update must be one of the
  model's state-dict names (tied aliases such as ``lm_head.weight`` included) with the same dtype
  and shape, or the update is rejected *before any byte moves* (the receiver answers the sender's
  go/no-go handshake with "no"); at ``finish_weight_update`` every state-dict entry (a tied group
  counts once) must have been received in this round, or finish raises listing what is missing and
  ``weight_version`` does not advance.
* The receiver consumes exactly the byte stream the update info declares, through the same
  ``plan_chunks`` as the sender -- even when loading a parameter fails (the error is raised after
  the stream) -- so it never leaves the sender blocked mid-stream and the transport stays aligned
  for the next round of the same engine. Handshake, chunk plan and checksums are
  ``receiving.receive_dense``, shared with the worker engine inside a real vLLM server
  (``loopback/worker/engine.py``).
* With ``checksums`` on, ``weightsync.sources.core.check.integrity.checksum_tensor`` of every received
  parameter (its bytes as received, before loading) is compared with the sender's after the stream;
  a mismatch raises ``ChecksumMismatchError`` (an ``IntegrityError``) naming the parameter(s) and
  marks the round failed. The receiver also reports them (``weight_checksums()``, the
  ``ReportsChecksums`` protocol) for trainer-side comparison.

vLLM's own receivers verify nothing end to end: the NCCL/IPC engines load whatever bytes arrive.
The closest vLLM 0.33 / 0.34 offer is the dev-mode ``/weight_checker`` route, a SHA-256 per *vLLM-layout*
parameter computed after loading (fused ``qkv_proj`` etc.), which a trainer cannot compute from its
checkpoint-named tensors without re-doing vLLM's fusion (see ``weightsync.sources.core.check.integrity``). The
loopback checksums cover the wire.

**Sparse mode** (the sender's ``LoopbackSparseTrainerInitInfo``; delta rounds): each
``update_weights`` carries patches in vLLM ``sparse_nccl``'s form (``transport.plan_sparse``). The
same validation, go/no-go handshake and "consume the whole stream even when loading fails" rules
apply; the received chunk is then applied through **vLLM's own**
``load_checkpoint_weight_patches`` (NaN-masked full-shape staging, the model's ``load_weights``
whose final ``copy_`` vLLM wraps), with the receiver's ``CheckpointLoader`` as the model's
``load_weights`` (a copy by checkpoint name). A round carries only changed tensors, so ``finish``
does not require every tensor; ``weight_checksums()`` reports the *full* tensors the round
patched, after the apply, and ``full_checksums(names)`` any tensors as held now: what a trainer
compares with a dense pass of its source. Like vLLM's apply, a sparse round is in place and not
transactional: a failed round leaves the model in an unknown state until a covering (anchor) round.
vLLM's loader module is imported only when sparse mode is initialised.

**Draft model** (``LoopbackReceiver(model, draft=...)``: the speculative-decoding draft, e.g. a
``TensorsModel`` holding the MTP tensors ``MegatronSource(part="mtp")`` declares). Like vLLM 0.33+'s
worker: ``start_draft_weight_update`` opens a round whose ``update_weights`` load into the draft
(same strict names / dtypes / shapes, checked against the draft's state dict), and whose
``finish_weight_update`` requires every draft tensor and sets ``weight_version`` as the policy's
does; ``start_weight_update`` targets the policy again. A receiver without a draft raises
(``RuntimeError`` naming the receiver, answered 500 by the server, as vLLM's worker raises
"no draft model is configured"), and so does a sparse (delta) transport, whose rounds patch the
policy only (vLLM's ``sparse_nccl`` reports ``supports_draft_weight_update = False``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from weightsync.sources import MetadataMismatchError, WeightSyncError
from weightsync.sources.toolkit import checksum, get_logger

from .receiving import ChecksumMismatchError, DenseRound, handshake, receive_dense, typed
from .transport import (
    LoopbackWorkerInitInfo,
    SparseEntry,
    open_transport_group,
    parse_sparse_update_info,
    plan_sparse,
    wait_work,
)

__all__ = ["LoopbackReceiver", "ChecksumMismatchError", "CheckpointLoader", "PAUSE_MODES"]

logger = get_logger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class CheckpointLoader(torch.nn.Module):
    """The receiver model's ``load_weights`` for vLLM's ``load_checkpoint_weight_patches``: copies
    each ``(checkpoint name, full tensor)`` into the model tensor of that name with one
    same-shaped ``copy_`` -- the loader contract vLLM's NaN-masked sparse apply supports. Counts its
    calls and whether vLLM's masked ``copy_`` was in place during them (``masked_calls``), so a test
    can tell the patches went through vLLM's apply and not around it."""

    def __init__(self, targets: dict[str, tuple[int, torch.Tensor]]) -> None:
        super().__init__()
        self._targets = targets
        self.calls = 0
        self.masked_calls = 0
        self.loaded: set[int] = set()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        self.masked_calls += int(torch.Tensor.copy_ is not _ORIGINAL_COPY)
        names = set()
        for name, tensor in weights:
            gid, target = self._targets[name]
            target.copy_(tensor)
            self.loaded.add(gid)
            names.add(name)
        return names


#: ``torch.Tensor.copy_`` as torch defines it (vLLM's sparse apply swaps it while loading).
_ORIGINAL_COPY = torch.Tensor.copy_


def _vllm_apply() -> Any:
    """vLLM's ``load_checkpoint_weight_patches`` and ``CheckpointWeightPatch`` (imported on first
    use: the module pulls in ``vllm.model_executor``, seconds of import a dense receiver never pays)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    return load_checkpoint_weight_patches, CheckpointWeightPatch


class LoopbackReceiver:
    """Plays one vLLM inference worker on CPU: joins the loopback transport as group rank
    ``rank_offset + index`` and loads what rank 0 broadcasts into ``model``.

    Thread-safe for the protocol calls (one update at a time); pause state and the weight version
    can be read while an update is in flight.
    """

    def __init__(self, model: torch.nn.Module, *, index: int = 0, draft: torch.nn.Module | None = None) -> None:
        self.model = model
        #: the speculative-decoding draft (module docstring), or None: ``start_draft_weight_update`` raises
        self.draft = draft
        self.index = index
        self.weight_version: str | None = None
        self.paused = False
        self.pause_mode: str | None = None
        self.updates_finished = 0
        #: finished rounds that targeted the draft model
        self.draft_updates_finished = 0
        self.last_update: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._init: LoopbackWorkerInitInfo | None = None
        self._group: Any = None
        self._store: Any = None
        self._group_rank = -1
        self._policy_targets = self._collect_targets(model)
        self._draft_targets = self._collect_targets(draft) if draft is not None else None
        #: the current round's target (the policy's, or the draft's after start_draft_weight_update)
        self._targets = self._policy_targets
        self._is_draft = False
        self.loader = CheckpointLoader(self._policy_targets)  # sparse rounds: the policy only
        #: per target (False: policy, True: draft): what an empty update info of its next round reuses
        self._last_plans: dict[bool, list[tuple[str, torch.dtype, tuple[int, ...]]] | None] = {False: None, True: None}
        self._in_update = False
        self._received: set[int] = set()
        self._checksums: dict[str, str] = {}
        self._failed: str | None = None
        self._bytes = 0
        self._tensors = 0
        self._patches = 0
        self._patched = 0
        self._t0 = 0.0

    # -- the model's names --------------------------------------------------------------------

    @staticmethod
    def _collect_targets(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
        """``name -> (group id, tensor)`` over ``state_dict(keep_vars=True)``: parameters and
        persistent buffers, tied aliases included; aliases of one storage share a group id."""
        targets: dict[str, tuple[int, torch.Tensor]] = {}
        groups: dict[tuple[int, int, tuple[int, ...]], int] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            gid = groups.setdefault(key, len(groups))
            targets[name] = (gid, t)
        return targets

    def _group_names(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name, (gid, _) in self._targets.items():
            out.setdefault(gid, []).append(name)
        return out

    # -- protocol -----------------------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the transport group described by ``init_info`` (blocks until the sender joins)."""
        try:
            info = LoopbackWorkerInitInfo(**init_info)
        except TypeError as e:
            raise ValueError(f"invalid loopback init_info: {e}") from e
        rank = info.rank_offset + self.index
        if rank >= info.world_size:
            raise ValueError(
                f"receiver index {self.index} needs group rank {rank}, but init_info.world_size "
                f"is {info.world_size}"
            )
        with self._lock:
            self.shutdown()
            self._store, self._group = open_transport_group(
                info.master_address, info.master_port, rank, info.world_size, info.timeout_s
            )
            self._init, self._group_rank = info, rank
            self._last_plans = {False: None, True: None}
        if info.sparse:
            _vllm_apply()  # pay vLLM's loader import now, not inside the first round's transfer
        logger.info("receiver %d joined the loopback group as rank %d", self.index, rank)

    def start_weight_update(self) -> None:
        """Open a round that loads into the policy model."""
        with self._lock:
            self._require_init()
            self._begin(draft=False)

    def start_draft_weight_update(self) -> None:
        """Open a round that loads into the draft model (vLLM 0.33+'s ``start_draft_weight_update``);
        raises, naming the receiver, when it holds no draft or its transport is sparse."""
        with self._lock:
            self._require_init()
            if self._draft_targets is None:
                raise RuntimeError(
                    f"receiver {self.index}: draft model weight update requested, but this receiver holds no "
                    "draft model (LoopbackReceiver(model, draft=...)); sync without draft= or give it one"
                )
            if self._init is not None and self._init.sparse:
                raise RuntimeError(
                    f"receiver {self.index}: the sparse (delta) loopback transport does not support draft model "
                    "weight updates (its rounds patch the policy only)"
                )
            self._begin(draft=True)

    def _begin(self, *, draft: bool) -> None:
        """A new round's state (caller holds the lock)."""
        self._is_draft = draft
        self._targets = self._draft_targets if draft and self._draft_targets is not None else self._policy_targets
        self._in_update = True
        self._received = set()
        self._checksums = {}
        self._failed = None
        self._bytes = self._tensors = 0
        self._patches = self._patched = 0
        self._t0 = time.perf_counter()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one chunk of the update: answer the sender's go/no-go, then consume the stream.

        A rejected update (unknown name, dtype or shape mismatch, bad update info) answers "no" to
        the handshake, so the sender raises before sending a byte, and this call raises the reason.
        """
        with self._lock:
            self._require_init()
            infos = update_info if isinstance(update_info, list) else [update_info]
            for info in infos:
                self._receive_one(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self._lock:
            if not self._in_update:
                raise RuntimeError("finish_weight_update without start_weight_update")
            self._in_update = False
            if self._failed is not None:
                raise WeightSyncError(
                    f"receiver {self.index}: this update failed ({self._failed}); "
                    f"weight_version stays {self.weight_version!r}"
                )
            sparse = bool(self._init and self._init.sparse)
            missing = [] if sparse else [  # a delta round carries only what changed
                names[0] if len(names) == 1 else " = ".join(names)
                for gid, names in sorted(self._group_names().items())
                if gid not in self._received
            ]
            which = "draft" if self._is_draft else "policy"
            if missing:
                raise MetadataMismatchError(
                    f"receiver {self.index}: the update did not send {len(missing)} of the {which} model's "
                    f"{len(self._group_names())} tensors: {missing[:20]}"
                    + (" ..." if len(missing) > 20 else "")
                    + f"; weight_version stays {self.weight_version!r}"
                )
            if weight_version is not None:
                self.weight_version = weight_version
            if self._is_draft:
                self.draft_updates_finished += 1
            else:
                self.updates_finished += 1
            self.last_update = {
                "tensors": self._tensors,
                "bytes_received": self._bytes,
                "seconds": time.perf_counter() - self._t0,
                "checksums_verified": bool(self._init and self._init.checksums) and not sparse,
                "weight_version": self.weight_version,
                "sparse": sparse,
                "draft": self._is_draft,
                "patches": self._patches,
                "patched_elements": self._patched,
                "apply_calls": self.loader.calls,
                "apply_masked_calls": self.loader.masked_calls,
            }

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused, self.pause_mode = True, mode

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None

    def shutdown(self) -> None:
        self._group = self._store = None
        self._init = None

    # -- one update_info chunk ----------------------------------------------------------------

    def _require_init(self) -> None:
        if self._group is None or self._init is None:
            raise RuntimeError("loopback receiver: init_weight_transfer_engine was not called")

    def _check_plan(self, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self._check_targets(plan)
        self._last_plans[self._is_draft] = plan  # what an empty update info of this target's next round reuses

    def _check_targets(self, plan: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """Every name is one of the model's, with its dtype and shape (dense and sparse alike)."""
        problems = []
        for name, dtype, shape in plan:
            if name not in self._targets:
                problems.append(f"unknown parameter {name!r}")
                continue
            t = self._targets[name][1]
            if t.dtype != dtype or tuple(t.shape) != shape:
                problems.append(
                    f"parameter {name!r}: update sends {str(dtype).removeprefix('torch.')} "
                    f"{shape}, model has {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                )
        if problems:
            raise MetadataMismatchError(
                f"receiver {self.index} rejects the update ({len(problems)} problems): "
                + "; ".join(problems[:10])
                + (" ..." if len(problems) > 10 else "")
            )

    def _receive_one(self, info: dict[str, Any]) -> None:
        assert self._init is not None
        if not self._init.sparse:
            # Handshake, chunk plan and checksums: ``receiving.receive_dense``, the one
            # implementation this receiver shares with the worker engine inside a real vLLM server.
            outcome = DenseRound()
            try:
                receive_dense(
                    self._group,
                    self._group_rank,
                    self._init,
                    info,
                    index=self.index,
                    last_plan=self._last_plans[self._is_draft],
                    check=self._check_plan,
                    load=self._load,
                    outcome=outcome,
                    precheck=self._require_in_update,
                )
            finally:
                if outcome.failed is not None:
                    self._failed = outcome.failed
            return
        error: Exception | None = None
        try:
            self._require_in_update()
            entries = parse_sparse_update_info(info)
            self._check_targets([(e.name, e.dtype, e.shape) for e in entries])
        except Exception as e:  # answered "no" below, then raised
            error = e
        try:
            handshake(self._group, self._group_rank, error, index=self.index)
        except BaseException as e:
            self._failed = str(e) if e is error else "another receiver rejected the update"
            raise
        self._receive_patches(entries)

    def _require_in_update(self) -> None:
        if not self._in_update:
            raise RuntimeError("update_weights without start_weight_update")

    def _receive_patches(self, entries: list[SparseEntry]) -> None:
        """Consume a sparse chunk's broadcasts (``plan_sparse``: per patch, indices then values),
        then apply the chunk through vLLM's ``load_checkpoint_weight_patches``. The stream is
        consumed in full before anything is applied, so a failed apply leaves the transport aligned."""
        bufs: dict[tuple[int, str], torch.Tensor] = {}
        for i, what, n in plan_sparse(entries):
            buf = torch.empty(n, dtype=torch.uint8)
            wait_work(self._group.broadcast(buf, 0), f"sparse {what}", rank=self._group_rank)
            bufs[(i, what)] = buf
            self._bytes += n
        try:
            self._apply(entries, bufs)
        except Exception as e:
            self._failed = f"applying the patches failed: {type(e).__name__}: {e}"
            raise

    def _apply(self, entries: list[SparseEntry], bufs: dict[tuple[int, str], torch.Tensor]) -> None:
        load_patches, Patch = _vllm_apply()
        patches = []
        for i, e in enumerate(entries):
            values = bufs[(i, "values")].view(e.dtype) if e.count else torch.empty(0, dtype=e.dtype)
            indices = None
            if not e.whole:
                indices = bufs[(i, "indices")].view(torch.int32) if e.count else torch.empty(0, dtype=torch.int32)
            patches.append(Patch(name=e.name, shape=e.shape, dtype=e.dtype, values=values, indices=indices))
        # vLLM refuses dense (whole) and sparse patches in one call: one call per run of either kind.
        start = 0
        for k in range(1, len(patches) + 1):
            if k == len(patches) or (patches[k].indices is None) != (patches[start].indices is None):
                load_patches(self.loader, patches[start:k])
                start = k
        for e in entries:
            gid, target = self._targets[e.name]
            self._received.add(gid)
            self._checksums[e.name] = checksum(target)
            self._patches += 1
            self._patched += e.count
            self._tensors += 1

    def full_checksums(self, names: list[str] | None = None, *, draft: bool = False) -> dict[str, str]:
        """``{name: integrity.checksum}`` of the model's tensors as held now (all of them, a tied
        group under each of its names, or ``names``): what a trainer compares with a dense pass.
        ``draft``: the draft model's instead of the policy's."""
        with self._lock:
            targets = self._draft_targets if draft else self._policy_targets
            if targets is None:
                raise ValueError(f"receiver {self.index}: holds no draft model")
            wanted = list(targets) if names is None else list(names)
            unknown = [n for n in wanted if n not in targets]
            if unknown:
                raise ValueError(f"receiver {self.index}: unknown tensor names {unknown[:10]}")
            return {n: checksum(targets[n][1]) for n in wanted}

    def _load(self, entry: tuple[str, torch.dtype, tuple[int, ...]], data: torch.Tensor) -> None:
        """Copy one received parameter (``data``: its bytes) into the model."""
        name = entry[0]
        gid, target = self._targets[name]
        received = typed(entry, data)
        self._checksums[name] = checksum(received)
        with torch.no_grad():
            target.copy_(received)
        self._received.add(gid)
        self._tensors += 1
        self._bytes += data.numel()

    # -- for tests and the demo ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "is_paused": self.paused,
            "pause_mode": self.pause_mode,
            "updates_finished": self.updates_finished,
            "has_draft": self.draft is not None,
            "draft_updates_finished": self.draft_updates_finished,
            "initialized": self._group is not None,
            "last_update": dict(self.last_update),
        }

    @torch.no_grad()
    def logits(self, input_ids: list[list[int]]) -> torch.Tensor:
        """The model's logits for ``input_ids`` (eval mode, fp32 on CPU)."""
        was = self.model.training
        self.model.eval()
        try:
            out = self.model(input_ids=torch.tensor(input_ids, dtype=torch.long))
        finally:
            self.model.train(was)
        return getattr(out, "logits", out).float()

    def weight_checksums(self) -> dict[str, str]:
        """``{checkpoint name: integrity.checksum}`` of what the last round received, as received
        (``weightsync.sources.core.check.integrity.ReportsChecksums``)."""
        return dict(self._checksums)
