"""``WeightSync``: one object per trainer rank that owns the vLLM trainer engine and runs each sync.

Per sync, in this order, on every rank:

1. (first sync only) rank 0 checks that every server's vLLM can parse what the init info and source
   need (``check_compatible``, if the client has one: a 0.34 trainer beside 0.33 servers), then the
   trainer engine is built: ``WeightTransferTrainerFactory.trainer_init`` on every rank (rank 0
   rendezvouses with vLLM), then the transport preflight;
2. rank 0 pauses generation on every server (``keep`` | ``wait`` | ``abort``, or not at all);
3. every rank runs ``engine.send_weights()`` (the collectives), rank 0 drives the four vLLM calls and
   its ``finish_weight_update`` commits ``weight_version`` (the training step by default);
4. rank 0 resumes generation -- also when the send failed -- and only then does anything raise.

Invariants, and why:

* **Only rank 0 talks to vLLM; every rank runs the collectives.** The engine guards its RPCs on
  ``is_sender``; the driver does the same for pause / resume / commit.
* **A failure raises on every rank, never a hang or a half-raised world.** Control-plane calls happen
  on rank 0 only, so a failed pause or rendezvous is invisible to the other ranks, which would walk
  into the next collective alone. After each phase that can fail on one rank (engine init,
  preflight, pause, send + commit + resume) the ranks exchange their outcome on the process group's
  store (``Board.exchange``: bounded, nothing left pending when a rank gives up); any failure raises
  on every rank, naming the rank(s) and phase. The rank that failed re-raises its own exception
  (with a note), after rank 0 has resumed generation. A sender whose consumer failed halfway
  through the source's pass finishes the pass alone (engines in ``FINISHABLE_PASS_BACKENDS``), so
  peers blocked in the source's gathers complete them and hear the error.
* **Bad configuration raises before any bytes move**: argument errors at construction (same on every
  rank), rank / backend disagreement between ranks and the IPC-over-remote-HTTP refusal at the first
  sync, before ``trainer_init``, and so does a server whose vLLM version cannot parse a field the
  sync needs (``ServerVersionError``, naming the server, both versions and the field).
* **The commit is vLLM's own**: ``finish_weight_update(weight_version)`` sets the version in the same
  call that finishes the update (``AsyncLLM.finish_weight_update``). Engines call ``finish`` without a
  version, so the driver hands them a thin client that adds it; an engine that never calls ``finish``
  gets an explicit ``update_weight_version`` instead. A generic client that can do neither is refused.
* **The source is checked on every rank** (``weightsync.sources.checked``): a stream that disagrees
  with the metadata, or ranks that disagree about the metadata, raise before vLLM loads garbage.

**Delta rounds** (a ``DeltaSource`` with a sparse engine: vLLM's ``sparse_nccl``,
``SparseNCCLTrainerInitInfo``, or the CPU ``LoopbackSparseTrainerInitInfo``). vLLM's sparse (0.33, 0.34)
trainer engine takes no source, its ``send_weights(patches)`` holds the whole round in memory
(``list(patches)``) and returns at once on non-senders, whose collectives would then never run. So
step 3 becomes, on every rank: iterate ``delta.iter_patches()`` (the diff's collectives; patches
appear on rank 0 only) and, on the sender, one ``start_weight_update``, ``send_weight_chunk`` per
chunk of at most ``chunk_bytes`` of indices + values (a larger patch alone), the engine's
``verify_round()`` if it has one (every rank), then ``finish_weight_update(weight_version)``. A
sender whose consumer failed drains the round so its peers' collectives complete; any failure of
the phase, on any rank, makes **every** rank call ``delta.reset()`` before raising, so the next sync
is an anchor that brings the receiver, in whatever state the failed round left it, to the exact
weights. A delta source with a dense engine, or a plain source with a sparse one, is refused at
construction; dense syncs are unchanged.

**Many senders** (a source with ``senders="owners"``, vLLM 0.34's NCCL engine: each tensor is
broadcast by its first owner, each broadcaster on its own turn while the others wait in that
turn's broadcasts). A broadcaster whose source fails mid-turn cannot just stop: every other member
of the transfer group would wait in its next broadcast forever (NCCL has no timeout). So it posts the
failure on the sync's sender board, completes its turn with zero tensors of the declared shapes
(the engine's own ``_checked_iter`` still checks them), and raises after ``send_weights`` returns;
rank 0, seeing the posted failure, finishes the update without committing the new
``weight_version``; then the send outcome is agreed and every rank raises. The workers hold zeros
where the failed turn's tensors should be until the next sync, which sends every tensor again.
The cross-rank metadata agreement runs when ``WeightSync`` is built (``CheckedSource``), since no
exchange can run inside a pass.

**Draft sync** (``draft=``: a second source, e.g. ``MegatronSource(part="mtp")``, the speculative
decoding draft's tensors). In the same pause, right after the policy's update went through on every
rank, the same trainer engine runs one more round with the draft as its source and a client whose
``start_weight_update`` is ``start_draft_weight_update`` (vLLM 0.33+: that round loads into the
draft model), finished with the same ``weight_version``. Refused at construction, on every rank, for
engines that cannot retarget (``DRAFTLESS_BACKENDS``: vLLM's ``supports_draft_weight_update = False``),
delta rounds, many senders and ``use_load_plan`` (the NCCL trainer checks every round against the
policy's load plan), and for a client without ``start_draft_weight_update``.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferUpdatePayload,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import torch

from weightsync.sources import WeightSyncError, checked
from weightsync.sources.toolkit import DEFAULT_TIMEOUT_S, Board, broadcast_ranks, get_logger, next_tag

from .preflight import check_engine
from .report import SyncReport

__all__ = [
    "WeightSync", "PAUSE_MODES", "LateSync", "DEFAULT_CHUNK_BYTES", "DRAFTLESS_BACKENDS", "is_delta_source",
    "is_sparse_backend",
]

logger = get_logger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")


class _CommittingClient:
    """Forwards the four ``VLLMWeightSyncClient`` calls; ``finish_weight_update`` carries the
    driver's pending ``weight_version`` when the engine passes none."""

    def __init__(self, client: VLLMWeightSyncClient) -> None:
        self.client = client
        self.version: str | None = None
        self.committed: str | None = None
        #: many senders: the sync's sender board; a failure posted there withholds the version
        self.turns: Board | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        if self.turns is not None and self.turns.failure() is not None:
            version = None  # a sender completed its turn with zeros: finish, commit nothing
        self.client.finish_weight_update(version)
        self.committed = version

    def __getattr__(self, name: str) -> Any:
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)


#: Backends whose non-sender ranks do nothing during ``send_weights`` but iterate the source, and
#: whose sender lets a failure propagate out of ``send_weights``: a sender that failed mid-pass can
#: finish the pass alone (its peers are blocked in the source's gathers, not in engine collectives).
#: vLLM's IPC engine is not one: its ranks meet in per-chunk handle all-gathers and barriers.
#: An engine can declare itself with a ``weightsync_finishable_pass`` attribute.
FINISHABLE_PASS_BACKENDS = frozenset({"nccl"})


class _TrackedSource(WeightSource):
    """What the engine iterates: the driver's source, unchanged (same metadata, same iterator
    objects, no per-tensor work), except that it remembers the pass in flight so the driver can
    finish it when the engine's consumer failed halfway."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.live: Iterator[Any] | None = None
        self.passes = 0
        #: many senders (``senders="owners"``): the sync's sender board, set per sync by the driver
        self.turns: Board | None = None
        #: what this broadcaster's source raised in its turn (the turn was completed with zeros)
        self.failure: BaseException | None = None

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata

    def owned_names(self, rank: int) -> list[str]:
        return self.source.owned_names(rank)

    def implements_iter_full(self) -> bool:
        return self.source.implements_iter_full()

    def implements_iter_local(self) -> bool:
        return self.source.implements_iter_local()

    def iter_full(self) -> Iterator[Any]:
        self.passes += 1
        self.live = iter(self.source.iter_full())
        if self.turns is not None and self.turns.rank in broadcast_ranks(self.metadata):
            return self._complete_turn(self.live)
        return self.live

    def _complete_turn(self, pairs: Iterator[Any]) -> Iterator[Any]:
        """A broadcaster's pass that always yields every tensor it declared (module docstring):
        after a failure, zeros of the declared shapes and dtypes, on the device of what it yielded."""
        rank = self.turns.rank  # type: ignore[union-attr]
        mine = [m for m in self.metadata if m.owners is None or rank in m.owners]
        n = 0
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        try:
            for name, tensor in pairs:
                n += 1
                device = tensor.device
                yield name, tensor
        except GeneratorExit:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised by the driver after the turn
            self.failure = e
            self.turns.fail(f"rank {rank}: {type(e).__name__}: {e}")  # type: ignore[union-attr]
            logger.error("rank %d: source failed after %d of %d tensors (%s); completing the turn with "
                         "zeros so the transfer group does not hang", rank, n, len(mine), e)
            for m in mine[n:]:
                yield m.name, torch.zeros(tuple(m.shape), dtype=m.dtype, device=device)

    def iter_local(self) -> Iterator[Any]:
        self.passes += 1
        self.live = iter(self.source.iter_local())
        return self.live

    def finish_pass(self, passes_before: int) -> int:
        """Run this sync's pass to its end, discarding tensors, so peers blocked in its collectives
        complete them: the rest of a suspended pass, or a whole pass if none started. Returns the
        number of tensors drained."""
        if self.passes == passes_before:
            it: Iterator[Any] | None = iter(self.source.iter_full())
        else:
            it = self.live
            if inspect.isgenerator(it) and inspect.getgeneratorstate(it) == inspect.GEN_CLOSED:
                return 0
        n = 0
        for _ in it or ():
            n += 1
        return n

    def __getattr__(self, name: str) -> Any:
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)


#: Backends whose vLLM worker engine declares ``supports_draft_weight_update = False`` (vLLM 0.33 and
#: 0.34: ``nccl_m2n``, ``sharded_rdt``; 0.34: ``sparse_nccl``): ``WeightSync(draft=...)`` refuses them.
DRAFTLESS_BACKENDS = frozenset({"sparse_nccl", "nccl_m2n", "sharded_rdt"})


class _DraftClient:
    """The draft round's client: ``start_weight_update`` is ``start_draft_weight_update``; the rest
    (and the version the committing client adds at finish) as the policy round's."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def start_weight_update(self) -> None:
        self.client.start_draft_weight_update()

    def __getattr__(self, name: str) -> Any:
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)


#: Bytes of indices + values per ``send_weight_chunk`` in a delta round (a larger patch goes alone).
DEFAULT_CHUNK_BYTES = 256 << 20


def is_delta_source(source: Any) -> bool:
    """A ``DeltaSource`` (or anything with its round API): what a sparse engine is fed from."""
    return all(callable(getattr(source, m, None)) for m in ("iter_patches", "iter_deltas", "reset"))


def is_sparse_backend(init_info: Any) -> bool:
    """Whether ``init_info``'s engine sends patches (vLLM ``sparse_nccl``, or an engine whose init
    info declares ``weightsync_sparse``, as ``LoopbackSparseTrainerInitInfo`` does)."""
    return getattr(init_info, "backend", None) == "sparse_nccl" or bool(
        getattr(type(init_info), "weightsync_sparse", False)
    )


def _patch_bytes(patch: Any) -> int:
    idx = patch.indices
    n = patch.values.numel() * patch.values.element_size()
    return n + (0 if idx is None else idx.numel() * idx.element_size())


def _attempt(fn: Callable[..., None], *args: Any) -> BaseException | None:
    """Run ``fn``; return what it raised (to be agreed across ranks before re-raising)."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller on every rank
        return e
    return None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class WeightSync:
    """Pushes a trainer's weights into vLLM; build it on every trainer rank with the same arguments.

    Args:
        source: the ``WeightSource`` to send (``FSDPSource``, ``MegatronSource``, vLLM's
            ``ModuleSource``...). Wrapped in ``weightsync.sources.checked`` unless ``check=False``.
            A ``DeltaSource`` runs delta rounds and needs a sparse ``init_info`` (see the module
            docstring); it checks its own stream (its ``check=``).
        init_info: any vLLM ``TrainerInitInfo`` (``NCCLTrainerInitInfo``, ``IPCTrainerInitInfo``,
            weightsync's ``LoopbackTrainerInitInfo``), with ``rank`` = this trainer rank; rank 0 sends.
        client: the control plane (``VLLMHTTPClient``, vLLM's Ray client, or any object with the four
            ``VLLMWeightSyncClient`` methods). Needs ``pause`` / ``resume`` unless ``pause=None``.
        every: sync every ``every`` training steps (``maybe_sync``); ``sync`` syncs on demand.
        pause: ``"keep"`` (default: in-flight requests freeze and continue on the new weights),
            ``"wait"`` (drain them first), ``"abort"``, or ``None`` (do not pause).
        clear_cache: vLLM's ``clear_cache`` for ``wait`` / ``abort`` pauses.
        version_fn: ``step -> weight_version`` (default ``str(step)``).
        check: check the source's stream and cross-rank metadata on every rank.
        timeout_s: bound on weightsync's own metadata agreement collective.
        chunk_bytes: delta rounds only: indices + values bytes per ``send_weight_chunk``.
        draft: the speculative-decoding draft's source (``MegatronSource(part="mtp")``), synced in
            the same pause right after the policy, same ``weight_version`` (module docstring); checked
            like ``source``. None: the draft stays as vLLM loaded it.
    """

    def __init__(
        self,
        source: WeightSource,
        init_info: TrainerInitInfo,
        client: VLLMWeightSyncClient,
        *,
        every: int = 1,
        pause: str | None = "keep",
        clear_cache: bool = True,
        version_fn: Callable[[int], str] = str,
        check: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        draft: WeightSource | None = None,
    ) -> None:
        delta = is_delta_source(source)
        if not delta and not isinstance(source, WeightSource):
            raise TypeError(f"WeightSync: source must be a vLLM WeightSource, got {type(source).__name__}")
        if not isinstance(init_info, TrainerInitInfo):
            raise TypeError(
                f"WeightSync: init_info must be a vLLM TrainerInitInfo (NCCL, IPC, loopback), "
                f"got {type(init_info).__name__}"
            )
        missing = [
            m
            for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
            if not callable(getattr(client, m, None))
        ]
        if missing:
            raise TypeError(
                f"WeightSync: client {type(client).__name__} is not a VLLMWeightSyncClient (missing {missing})"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"WeightSync: every must be a positive int (steps between syncs), got {every!r}")
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"WeightSync: pause must be one of {PAUSE_MODES} or None, got {pause!r}")
        if pause is not None and not all(callable(getattr(client, m, None)) for m in ("pause", "resume")):
            raise TypeError(
                f"WeightSync: pause={pause!r} needs a client with pause()/resume() (VLLMHTTPClient); "
                f"{type(client).__name__} has none. Pass pause=None to sync without pausing."
            )
        if not callable(version_fn):
            raise TypeError(f"WeightSync: version_fn must be callable (step -> str), got {version_fn!r}")
        _check_draft(draft, source, init_info, client, delta)
        _check_delta_pairing(source, init_info, delta)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"WeightSync: chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        #: the draft's source, checked (None: no draft sync)
        self.draft: WeightSource | None = None
        if draft is not None:
            self.draft = checked(draft, rank=init_info.rank, timeout_s=timeout_s) if check else draft
        #: The ``DeltaSource`` of a delta sync (None: dense syncs, unchanged).
        self.delta: Any = source if delta else None
        self.last_delta_send: dict[str, int] = {}
        if delta:
            self.source = source
        else:
            self.source = checked(source, rank=init_info.rank, timeout_s=timeout_s) if check else source
        #: the source sends from many ranks (``senders="owners"``: vLLM 0.34's NCCL engine)
        self.many_senders = getattr(source, "senders", "rank0") == "owners"
        if self.many_senders and init_info.backend != "nccl":
            raise ValueError(
                f"WeightSync: rank {init_info.rank}: the source has senders='owners', which only vLLM's dense "
                f"NCCL engine (backend 'nccl', vLLM 0.34+) can send; init_info is backend {init_info.backend!r} "
                f"({type(init_info).__name__}): build the source with senders='rank0' for it"
            )
        self._tracked = _TrackedSource(self.source)
        self.timeout_s = timeout_s
        self.init_info = init_info
        self.client = client
        self.every = every
        self.pause_mode = pause
        self.clear_cache = clear_cache
        self.version_fn = version_fn
        self._commit_client = _CommittingClient(client)
        self._engine: TrainerWeightTransferEngine | None = None
        self._closed = False
        self._last_step: int | None = None
        self._syncs = 0
        self.last_report: SyncReport | None = None

    # ---- properties ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.init_info.rank

    @property
    def is_sender(self) -> bool:
        return self.init_info.is_sender

    @property
    def backend(self) -> str:
        return self.init_info.backend

    @property
    def engine(self) -> TrainerWeightTransferEngine | None:
        """The vLLM trainer engine, built at the first sync (``None`` before)."""
        return self._engine

    # ---- schedule -----------------------------------------------------------------------------

    def should_sync(self, step: int) -> bool:
        """True iff ``step`` is a multiple of ``every`` and was not synced already. Pure: the same
        answer on every rank for the same step."""
        return step % self.every == 0 and step != self._last_step

    def maybe_sync(self, step: int) -> SyncReport | None:
        """``sync(step)`` if the schedule says so, else ``None``. Call it on every rank, every step."""
        return self.sync(step) if self.should_sync(step) else None

    # ---- the sync -----------------------------------------------------------------------------

    def sync(self, step: int | None = None, *, weight_version: str | None = None) -> SyncReport:
        """Pause, send, commit, resume. Call on every rank in the same order; returns the report."""
        if self._closed:
            raise WeightSyncError(f"rank {self.rank}: WeightSync.sync() after shutdown()")
        step = self._syncs if step is None else int(step)
        version = str(weight_version if weight_version is not None else self.version_fn(step))
        t_start = time.perf_counter()
        cold = self._engine is None
        board = Board(next_tag("weightsync-sync")) if _multi_rank() else None

        # -- first sync: build the engine on every rank, then the transport preflight. Each step's
        #    outcome is agreed before the next, so no rank enters a collective its peers skipped.
        if cold:
            for phase, fn in (
                ("server compatibility", self._check_compatible),
                ("engine init", self._build_engine),
                ("preflight", self._preflight),
            ):
                err = _attempt(fn, board)
                failed = self._agree(board, phase, err)
                if failed:
                    self._drop_engine()  # every rank rebuilds at the next sync
                    self._raise(phase, failed, err)

        # -- pause (sender), agreed before any data collective.
        paused_attempted = self.is_sender and self.pause_mode is not None
        t = time.perf_counter()
        err = _attempt(self._pause) if paused_attempted else None
        pause_s = time.perf_counter() - t if paused_attempted else 0.0
        resume_s = 0.0
        failed = self._agree(board, "pause", err)
        if failed:
            if paused_attempted:  # a fan-out pause may have reached some servers
                self._resume_quietly()
            self._raise("pause", failed, err)

        # -- send (+ commit on the sender), then resume whatever happened.
        err = None
        passes_before = self._tracked.passes
        turns = Board(f"{board.tag}/senders") if board is not None and self.many_senders else None
        self._tracked.turns = self._commit_client.turns = turns
        self._tracked.failure = None
        t_send = time.perf_counter()
        delta_round: Any = None
        try:
            self._commit_client.version = version
            self._commit_client.committed = None
            assert self._engine is not None
            if self.delta is not None:
                delta_round = self._delta_round()  # a generator: nothing runs yet
                self._send_delta(delta_round, board)
            else:
                self._engine.send_weights()
                if self.draft is not None and self._tracked.failure is None:
                    self._send_draft()
                if self._tracked.failure is not None:  # this broadcaster's turn was completed with zeros
                    raise self._tracked.failure
                failed = turns.failure() if turns is not None else None
                if failed is not None:
                    raise WeightSyncError(
                        f"rank {self.rank}: sending rank {failed[0]} failed in its turn and completed it "
                        f"with zeros ({failed[1]}); the update was finished without committing "
                        f"weight_version {version!r}"
                    )
            if self.is_sender and self._commit_client.committed != version:
                self._commit_explicitly(version)
        except BaseException as e:  # noqa: BLE001
            err = e
            if self.delta is not None:
                self._drain_round(e, delta_round)
            else:
                self._finish_pass_after(e, passes_before)
        send_s = time.perf_counter() - t_send
        if paused_attempted:
            t = time.perf_counter()
            try:
                self.client.resume()
            except BaseException as e:  # noqa: BLE001
                if err is None:
                    err = e
                else:
                    logger.error("resume after a failed send also failed: %s", _describe(e))
            resume_s = time.perf_counter() - t
        failed = self._agree(board, "send", err)
        if failed:
            if self.delta is not None:
                self._reset_delta()  # every rank: the next sync is an anchor
            self._raise("send", failed, err)

        self._last_step = step
        self._syncs += 1
        report = self._report(step, version, send_s, pause_s, resume_s, time.perf_counter() - t_start, cold)
        self.last_report = report
        logger.log(20 if self.is_sender else 10, "%s", report.summary())
        return report

    def shutdown(self) -> None:
        """Tear down the trainer engine (communicators). Idempotent; call on every rank."""
        self._closed = True
        self._drop_engine()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- pieces -------------------------------------------------------------------------------

    def _check_compatible(self, board: Board | None) -> None:
        """The sender asks the client whether every server's vLLM can parse what this init info and
        source need (``VLLMHTTPClient.check_compatible``: ``GET /version``); agreed before
        ``trainer_init``, so a too-old server raises on every rank before any collective."""
        check = getattr(self.client, "check_compatible", None)
        if not self.is_sender or not callable(check):
            return
        source = self.delta if self.delta is not None else self.source
        check(self.init_info, getattr(source, "metadata", None))

    def _build_engine(self, board: Board | None) -> None:
        self._check_ranks(board)
        check_backend = getattr(self.client, "check_backend", None)
        if callable(check_backend):  # e.g. refuse pickled IPC handles to a remote host, on every rank
            check_backend(self.backend)
        if self.delta is not None:
            # vLLM's sparse engine refuses any source; ours takes the delta to verify rounds against.
            source = self.delta if getattr(type(self.init_info), "weightsync_sparse", False) else None
            self._engine = WeightTransferTrainerFactory.trainer_init(
                self.init_info, client=self._commit_client, source=source
            )
            return
        try:
            self._engine = WeightTransferTrainerFactory.trainer_init(
                self.init_info, client=self._commit_client, source=self._tracked
            )
        except RuntimeError as e:
            if "PyNccl communicator is disabled" in str(e):  # vLLM >= 0.34, at trainer_init
                e.add_note(f"weightsync: rank {self.rank}: {_pynccl_disabled_cause()}")
            raise

    def _send_draft(self) -> None:
        """The draft round (module docstring): the engine's source and client swapped for the
        round, restored after it whatever happens. Every rank runs it (the draft source's gathers)."""
        engine = self._engine
        assert engine is not None
        saved = engine.source, engine.client
        draft = _TrackedSource(self.draft)
        engine.source, engine.client = draft, _DraftClient(self._commit_client)
        try:
            engine.send_weights()
        except BaseException as e:
            # peers may be blocked in the draft's gathers: finish its pass here, as for the policy's
            finishable = getattr(engine, "weightsync_finishable_pass", self.backend in FINISHABLE_PASS_BACKENDS)
            if finishable and _multi_rank():
                try:
                    draft.finish_pass(0)
                except BaseException as e2:  # noqa: BLE001 - the draft round's own failure is raised
                    logger.error("rank %d: finishing the draft pass after %s failed: %s", self.rank, _describe(e), _describe(e2))
            raise
        finally:
            engine.source, engine.client = saved

    def _delta_round(self) -> Iterator[Any]:
        """The round's iterator: vLLM's ``SparseWeightPatch`` es (indices always explicit), or, for
        an engine whose init info declares ``weightsync_whole_patches`` (our loopback), the
        delta's ``iter_deltas(whole_when_cheaper=True)``: a tensor whole where that is cheaper."""
        if getattr(type(self.init_info), "weightsync_whole_patches", False):
            return iter(self.delta.iter_deltas(whole_when_cheaper=True))
        return iter(self.delta.iter_patches())

    def _send_delta(self, patches: Iterator[Any], board: Board | None) -> None:
        """One delta round, on every rank (see the module docstring): every rank drives the
        round's iterator (its collectives); the sender sends bounded chunks inside one
        start/finish lifecycle. Then the ranks agree that the round went through everywhere
        before the engine's ``verify_round`` (a collective pass, every rank) and the commit: a
        sender whose consumer failed must not leave its peers alone in that pass."""
        err: BaseException | None = None
        try:
            self._send_round(patches)
        except BaseException as e:  # noqa: BLE001 - agreed below, then re-raised
            err = e
            self._drain_round(e, patches)
        failed = self._agree(board, "delta round", err) if board is not None else {}
        if err is not None:
            raise err
        if failed:
            me = dist.get_rank()
            raise WeightSyncError(
                f"rank {me}: the delta round failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            )
        verify = getattr(self._engine, "verify_round", None)
        if callable(verify):
            verify()
        if self.is_sender:
            self._commit_client.finish_weight_update(self._commit_client.version)

    def _send_round(self, patches: Iterator[Any]) -> None:
        engine = self._engine
        assert engine is not None
        sent = self.last_delta_send = {"patches": 0, "bytes": 0, "chunks": 0, "max_chunk_bytes": 0}
        start_round = getattr(engine, "start_round", None)
        if callable(start_round):
            start_round()
        if self.is_sender:
            self._commit_client.start_weight_update()
        chunk: list[Any] = []
        nbytes = 0

        def flush() -> None:
            nonlocal chunk, nbytes
            engine.send_weight_chunk(chunk)
            sent["chunks"] += 1
            sent["max_chunk_bytes"] = max(sent["max_chunk_bytes"], nbytes)
            chunk, nbytes = [], 0

        for patch in patches:
            if not self.is_sender:  # vLLM's contract: patches appear on the sender only
                continue
            size = _patch_bytes(patch)
            if chunk and nbytes + size > self.chunk_bytes:
                flush()
            chunk.append(patch)
            nbytes += size
            sent["patches"] += 1
            sent["bytes"] += size
        if chunk:
            flush()

    def _drain_round(self, err: BaseException, patches: Iterator[Any] | None) -> None:
        """This rank's delta round failed. Run the round's iterator to its end, discarding patches,
        so peers blocked in its collectives complete them and reach the outcome exchange (then every
        rank resets the delta). A round the delta source itself raised in is closed already."""
        if patches is None or not _multi_rank():
            return
        try:
            n = sum(1 for _ in patches)
        except BaseException as e:  # noqa: BLE001 - the source failed too; peers hear it
            logger.error("draining the delta round after %s failed: %s", _describe(err), _describe(e))
            return
        if n:
            logger.warning("delta round failed (%s); drained %d patches so peers complete it", _describe(err), n)

    def _reset_delta(self) -> None:
        try:
            self.delta.reset()
        except BaseException as e:  # noqa: BLE001 - the round's own failure is what gets raised
            logger.error("rank %d: delta.reset() after a failed round failed: %s", self.rank, _describe(e))

    def _preflight(self, board: Board | None) -> None:
        assert self._engine is not None
        check_engine(self._engine)

    def _pause(self) -> None:
        self.client.pause(self.pause_mode, clear_cache=self.clear_cache)

    def _drop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def _check_ranks(self, board: Board | None) -> None:
        """Every rank has a distinct ``init_info.rank``, one of them 0, and the same backend."""
        if board is None:
            if self.rank != 0:
                raise ValueError(
                    f"WeightSync: init_info.rank={self.rank} in a single-process trainer; rank 0 is "
                    "the sender and must exist"
                )
            return
        ranks_ = list(range(dist.get_world_size()))
        mine = f"{self.rank} {self.backend}"
        got = board.exchange(mine, ranks=ranks_, what="the WeightSync rank/backend check")
        everyone = [got[r].split(" ", 1) for r in ranks_]
        ranks = [int(r) for r, _ in everyone]
        backends = [b for _, b in everyone]
        problems = []
        if len(set(ranks)) != len(ranks):
            problems.append(f"init_info.rank values repeat across ranks: {ranks} (global rank order)")
        if 0 not in ranks:
            problems.append(f"no rank has init_info.rank=0 (the sender): {ranks}")
        if len(set(backends)) != 1:
            problems.append(f"ranks chose different backends: {backends}")
        if problems:
            raise ValueError(f"rank {dist.get_rank()}: WeightSync misconfigured: " + "; ".join(problems))

    def _finish_pass_after(self, err: BaseException, passes_before: int) -> None:
        """This rank's ``send_weights`` raised. If peers can only be blocked in the source's own
        collectives (``FINISHABLE_PASS_BACKENDS``), finish the pass here so they complete it and
        reach the outcome exchange, instead of waiting out the process-group timeout."""
        engine = self._engine
        finishable = getattr(engine, "weightsync_finishable_pass", self.backend in FINISHABLE_PASS_BACKENDS)
        if not finishable or not _multi_rank():
            return
        try:
            n = self._tracked.finish_pass(passes_before)
        except BaseException as e:  # noqa: BLE001 - the source itself failed too; peers hear it
            logger.error("finishing the pass after %s failed: %s", _describe(err), _describe(e))
            return
        if n:
            logger.warning("send failed (%s); finished the pass here (%d tensors) so peers complete it",
                           _describe(err), n)

    def _commit_explicitly(self, version: str) -> None:
        update = getattr(self.client, "update_weight_version", None)
        if not callable(update):
            raise WeightSyncError(
                f"rank {self.rank}: the {self.backend!r} engine never called finish_weight_update, and "
                f"client {type(self.client).__name__} has no update_weight_version(); weight_version "
                f"{version!r} cannot be committed"
            )
        update(version)

    def _resume_quietly(self) -> None:
        try:
            self.client.resume()
        except BaseException as e:  # noqa: BLE001 - the original failure is what gets raised
            logger.error("resume after a failed prepare also failed: %s", _describe(e))

    def _agree(self, board: Board | None, phase: str, err: BaseException | None) -> dict[int, str]:
        """Exchange each rank's outcome of ``phase`` (on the store: nothing left pending if a rank
        gives up); ``{rank: error}`` for every rank that failed."""
        mine = "" if err is None else _describe(err)
        if board is None:
            return {} if err is None else {self.rank: mine}
        ranks = list(range(dist.get_world_size()))
        got = board.exchange(mine or "ok", ranks=ranks, timeout_s=self.timeout_s,
                             what=f"the weight sync {phase} outcome exchange")
        return {r: v for r, v in got.items() if v != "ok"}

    def _raise(self, phase: str, failed: dict[int, str], err: BaseException | None) -> None:
        me = dist.get_rank() if _multi_rank() else self.rank
        others = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        resumed = "; generation was resumed" if self.pause_mode is not None else ""
        if err is not None:
            err.add_note(f"weightsync: sync failed in {phase} on rank(s) {sorted(failed)}{resumed}")
            raise err
        raise WeightSyncError(
            f"rank {me}: weight sync failed in {phase} on rank(s) {sorted(failed)}: {others}{resumed}"
        )

    def _report(
        self, step: int, version: str, send_s: float, pause_s: float, resume_s: float, total_s: float, cold: bool
    ) -> SyncReport:
        meta = self.source.metadata
        wire = sum(m.dtype.itemsize * math.prod(m.shape) for m in meta)
        stats = getattr(self.source, "last_pass", None)
        delta_fields: dict[str, Any] = {}
        if self.delta is not None:
            last = getattr(self.delta, "last_round", None)
            sent = self.last_delta_send
            delta_fields = dict(
                delta_anchor=getattr(last, "anchor", None),
                delta_changed=getattr(last, "changed", None),
                delta_elements=getattr(last, "elements", None),
                delta_tensors=getattr(last, "tensors", None),
                delta_wire_bytes=getattr(last, "wire_bytes", None),
                delta_dense_bytes=getattr(last, "dense_bytes", wire),
                delta_collective_bytes=getattr(last, "collective_bytes", None),
                delta_chunks=sent.get("chunks") if self.is_sender else None,
                delta_sent_bytes=sent.get("bytes") if self.is_sender else None,
            )
        return SyncReport(
            step=step,
            weight_version=version,
            backend=self.backend,
            rank=self.rank,
            is_sender=self.is_sender,
            tensors=len(meta),
            bytes=wire,
            send_seconds=send_s,
            pause_seconds=pause_s,
            resume_seconds=resume_s,
            total_seconds=total_s,
            pause_mode=self.pause_mode,
            rank_tensors=getattr(stats, "tensors", None),
            rank_bytes=getattr(stats, "bytes", None),
            collectives=getattr(stats, "collectives", None),
            peak_extra_bytes=getattr(stats, "peak_extra_bytes", None),
            cold=cold,
            **delta_fields,
        )


def _pynccl_disabled_cause() -> str:
    """Why vLLM's ``PyNcclCommunicator`` disabled itself, from the environment (vLLM 0.34 raises at
    ``trainer_init``; 0.33 went on and the preflight catches it)."""
    import os

    if os.environ.get("VLLM_DISABLE_PYNCCL", "0") not in ("", "0", "false", "False"):
        return "vLLM disabled its NCCL communicator because VLLM_DISABLE_PYNCCL is set in the trainer's environment"
    return (
        "vLLM disabled its NCCL communicator: it could not load the NCCL library (missing, or older "
        "than the symbols vLLM binds, e.g. ncclCommSuspend, absent in NCCL 2.28.9) -- install the NCCL "
        "vLLM was built against or point VLLM_NCCL_SO_PATH at it"
    )


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_delta_pairing(source: Any, init_info: TrainerInitInfo, delta: bool) -> None:
    """A delta source needs a sparse engine and a sparse engine a delta source; sparse engines take
    no packed wire options. The same verdict on every rank (arguments only), before any byte."""
    sparse = is_sparse_backend(init_info)
    backend = init_info.backend
    if delta and getattr(init_info, "use_load_plan", False):
        raise ValueError(
            f"WeightSync: rank {init_info.rank}: init_info.use_load_plan=True (vLLM 0.34: the workers plan "
            "direct writes from the metadata sent at init) cannot serve delta rounds: a DeltaSource sends "
            "sparse patches through sparse_nccl, which has no load plan; use_load_plan is for dense NCCL "
            "syncs of a source whose metadata is the same every round (every weightsync source's is)"
        )
    if delta and not sparse:
        raise TypeError(
            f"WeightSync: rank {init_info.rank}: a DeltaSource sends patches, but backend {backend!r} "
            f"({type(init_info).__name__}) sends dense tensors; use vLLM's SparseNCCLTrainerInitInfo "
            "(backend 'sparse_nccl') or weightsync's LoopbackSparseTrainerInitInfo, or pass the "
            "wrapped source itself for dense syncs"
        )
    if sparse and not delta:
        raise TypeError(
            f"WeightSync: rank {init_info.rank}: backend {backend!r} sends sparse patches; wrap the "
            f"source in DeltaSource(...) (got {type(source).__name__})"
        )
    if sparse:
        bad = [f for f in ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
               if f in getattr(init_info, "__dataclass_fields__", {}) and getattr(init_info, f, None)]
        if bad:
            raise ValueError(
                f"WeightSync: rank {init_info.rank}: backend {backend!r} takes no packed wire options "
                f"(sparse transfers are never packed); init_info sets {bad}"
            )


def _check_draft(draft: Any, source: Any, init_info: TrainerInitInfo, client: Any, delta: bool) -> None:
    """``WeightSync(draft=...)``'s refusals (module docstring): arguments only, so the same verdict on
    every rank, before any byte moves."""
    if draft is None:
        return
    rank, backend = init_info.rank, init_info.backend
    where = f"WeightSync: rank {rank}: draft="
    if not isinstance(draft, WeightSource):
        raise TypeError(f"{where} must be a vLLM WeightSource (e.g. MegatronSource(part='mtp')), got {type(draft).__name__}")
    if backend in DRAFTLESS_BACKENDS or getattr(type(init_info), "weightsync_draftless", False):
        raise ValueError(
            f"{where} backend {backend!r} ({type(init_info).__name__}) cannot update a draft model: its vLLM "
            "engine reports supports_draft_weight_update = False (sparse_nccl, nccl_m2n, sharded_rdt); "
            "sync the draft through vLLM's 'nccl' or 'ipc' engine, or leave draft=None"
        )
    if delta:
        raise ValueError(f"{where} cannot ride a delta round (sparse patches go to the target model only)")
    if getattr(source, "senders", "rank0") == "owners" or getattr(draft, "senders", "rank0") == "owners":
        raise ValueError(f"{where} is not supported with senders='owners' (many senders); use senders='rank0'")
    if getattr(init_info, "use_load_plan", False):
        raise ValueError(
            f"{where} needs use_load_plan=False: vLLM's NCCL trainer checks every round against the policy's "
            "load plan, which the draft's tensors are not part of"
        )
    if not callable(getattr(client, "start_draft_weight_update", None)):
        raise TypeError(
            f"{where} needs a client with start_draft_weight_update() (VLLMHTTPClient, RayDraftWeightSyncClient; "
            f"vLLM 0.33+ serves POST /start_draft_weight_update); {type(client).__name__} has none"
        )


class LateSync:
    """A ``WeightSync`` given now, or built later by ``factory(model)`` once the framework has
    prepared (sharded) the model -- how every training-loop hook takes its ``sync=`` argument.

    Validates at construction (a hook's ``__init__``) so a wrong argument fails before training
    starts, and again on what the factory returns."""

    def __init__(self, sync: WeightSync | Callable[[Any], WeightSync], *, owner: str, model_arg: str) -> None:
        if not isinstance(sync, WeightSync) and not callable(sync):
            raise TypeError(
                f"{owner}: sync must be a WeightSync or a callable {model_arg} -> WeightSync, "
                f"got {type(sync).__name__}"
            )
        self._owner = owner
        self._factory = None if isinstance(sync, WeightSync) else sync
        #: the ``WeightSync``: the one given, or the factory's once ``build`` ran; else None.
        self.sync: WeightSync | None = sync if isinstance(sync, WeightSync) else None

    def build(self, model: Any) -> WeightSync:
        """The ``WeightSync``, calling the factory with ``model`` the first time."""
        if self.sync is None:
            built = self._factory(model)  # type: ignore[misc]
            if not isinstance(built, WeightSync):
                raise TypeError(f"{self._owner}: the sync factory returned {type(built).__name__}, not a WeightSync")
            self.sync = built
        return self.sync
