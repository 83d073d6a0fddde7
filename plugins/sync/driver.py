"""``WeightSync``: one object per trainer rank that owns the vLLM trainer engine and runs each sync.

Per sync, in this order, on every rank:

1. (first sync only) rank 0 checks that every server's vLLM can parse what the init info and source
   need (``check_compatible``, if the client has one: a 0.34 trainer beside 0.33 servers), then the
   trainer engine is built: ``WeightTransferTrainerFactory.trainer_init`` on every rank (rank 0
   rendezvouses with vLLM), then the transport preflight;
2. rank 0 pauses generation on every server (``keep`` | ``wait`` | ``abort``, or not at all);
3. every rank runs the send phase -- ``engine.send_weights()`` (``dense_pass.DensePass``: the
   collectives, many senders, the draft round) or a delta round (``delta_rounds.DeltaRounds``) --
   rank 0 drives the four vLLM calls and its ``finish_weight_update`` commits ``weight_version``
   (the training step by default);
4. rank 0 resumes generation -- also when the send failed -- and only then does anything raise.

Invariants, and why:

* **Only rank 0 talks to vLLM; every rank runs the collectives.** The engine guards its RPCs on
  ``is_sender``; the driver does the same for pause / resume / commit.
* **A failure raises on every rank, never a hang or a half-raised world.** Control-plane calls happen
  on rank 0 only, so a failed pause or rendezvous is invisible to the other ranks, which would walk
  into the next collective alone. After each phase that can fail on one rank (engine init,
  preflight, pause, send + commit + resume) the ranks agree on their outcome (``outcomes.agree``);
  any failure raises on every rank, naming the rank(s) and phase. The rank that failed re-raises its
  own exception (with a note), after rank 0 has resumed generation. Before that, the send phase's
  ``recover`` lets peers complete the collectives they wait in (a pass finished, a round drained),
  and after an agreed failure its ``failed`` runs on every rank (a delta is reset: the next sync is
  an anchor).
* **Bad configuration raises before any bytes move**: argument errors at construction (same on every
  rank), rank / backend disagreement between ranks and the IPC-over-remote-HTTP refusal at the first
  sync, before ``trainer_init``, and so does a server whose vLLM version cannot parse a field the
  sync needs (``ServerVersionError``, naming the server, both versions and the field).
* **The commit is vLLM's own**: ``finish_weight_update(weight_version)`` sets the version in the same
  call that finishes the update (``AsyncLLM.finish_weight_update``); engines call ``finish`` without
  a version, so they talk through ``clients.CommittingClient``, which adds it. An engine that never
  calls ``finish`` gets an explicit ``update_weight_version`` instead. A generic client that can do
  neither is refused.
* **The source is checked on every rank** (``weightsync.sources.checked``): a stream that disagrees
  with the metadata, or ranks that disagree about the metadata, raise before vLLM loads garbage.
* **What an engine can do is read from ``capabilities``** (sparse, whole patches, draftless,
  finishable pass, round hooks), nowhere else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from weightsync.sources import WeightSyncError, checked
from weightsync.sources.toolkit import DEFAULT_TIMEOUT_S, Board, get_logger, multi_rank, next_tag, senders_of

from .capabilities import DRAFTLESS_BACKENDS, FINISHABLE_PASS_BACKENDS, is_sparse_backend
from .clients import CommittingClient
from .delta_rounds import DEFAULT_CHUNK_BYTES, DeltaRounds, check_pairing, is_delta_source
from .dense_pass import DensePass, check_draft
from .outcomes import agree, attempt, describe
from .preflight import check_engine, pynccl_disabled_cause
from .report import SyncReport

# DEFAULT_CHUNK_BYTES, is_delta_source (delta_rounds), DRAFTLESS_BACKENDS, FINISHABLE_PASS_BACKENDS and
# is_sparse_backend (capabilities) live where their idea does; re-exported here, where they used to be.
__all__ = [
    "WeightSync", "PAUSE_MODES", "LateSync", "SendPhase", "DEFAULT_CHUNK_BYTES", "DRAFTLESS_BACKENDS",
    "FINISHABLE_PASS_BACKENDS", "is_delta_source", "is_sparse_backend",
]

logger = get_logger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")


class SendPhase(Protocol):
    """Step 3 of a sync, on every rank: ``DensePass`` or ``DeltaRounds``."""

    #: the ``source`` the engine is built with (``trainer_init``)
    engine_source: Any

    def begin(self, board: Board | None) -> None:
        """Before the send: reset this sync's bookkeeping."""

    def send(self, engine: TrainerWeightTransferEngine, board: Board | None, version: str) -> None:
        """Send (and, where the phase owns it, commit); raise this rank's failure."""

    def recover(self, err: BaseException, engine: TrainerWeightTransferEngine | None) -> None:
        """This rank's send raised ``err``: let peers complete the collectives they wait in."""

    def failed(self) -> None:
        """The send failed on some rank (agreed); runs on every rank before raising."""

    def report_fields(self, wire_bytes: int) -> dict[str, Any]:
        """The phase's own ``SyncReport`` fields for the last sync (``{}``: none)."""


class WeightSync:
    """Pushes a trainer's weights into vLLM; build it on every trainer rank with the same arguments.

    Args:
        source: the ``WeightSource`` to send (``FSDPSource``, ``MegatronSource``, vLLM's
            ``ModuleSource``...). Wrapped in ``weightsync.sources.checked`` unless ``check=False``.
            A ``DeltaSource`` runs delta rounds and needs a sparse ``init_info`` (``delta_rounds``);
            it checks its own stream (its ``check=``).
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
            the same pause right after the policy, same ``weight_version`` (``dense_pass``); checked
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
        check_draft(draft, source, init_info, client, delta)
        check_pairing(source, init_info, delta)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"WeightSync: chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        #: the draft's source, checked (None: no draft sync)
        self.draft: WeightSource | None = None
        if draft is not None:
            self.draft = checked(draft, rank=init_info.rank, timeout_s=timeout_s) if check else draft
        #: The ``DeltaSource`` of a delta sync (None: dense syncs, unchanged).
        self.delta: Any = source if delta else None
        if delta:
            self.source = source
        else:
            self.source = checked(source, rank=init_info.rank, timeout_s=timeout_s) if check else source
        #: the source sends from many ranks (``senders="owners"``: vLLM 0.34's NCCL engine)
        self.many_senders = senders_of(source) == "owners"
        if self.many_senders and init_info.backend != "nccl":
            raise ValueError(
                f"WeightSync: rank {init_info.rank}: the source has senders='owners', which only vLLM's dense "
                f"NCCL engine (backend 'nccl', vLLM 0.34+) can send; init_info is backend {init_info.backend!r} "
                f"({type(init_info).__name__}): build the source with senders='rank0' for it"
            )
        self.timeout_s = timeout_s
        self.init_info = init_info
        self.client = client
        self.every = every
        self.pause_mode = pause
        self.clear_cache = clear_cache
        self.version_fn = version_fn
        self._commit_client = CommittingClient(client)
        #: step 3 of every sync (``SendPhase``): a delta round, or the dense pass
        self._phase: SendPhase
        if delta:
            self._phase = DeltaRounds(source, init_info, self._commit_client, chunk_bytes=chunk_bytes,
                                      timeout_s=timeout_s)
        else:
            self._phase = DensePass(self.source, self.draft, self._commit_client, backend=init_info.backend,
                                    rank=init_info.rank, many_senders=self.many_senders)
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

    @property
    def last_delta_send(self) -> dict[str, int]:
        """Delta syncs: what the sender's last round sent (``DeltaRounds.last_send``); else ``{}``."""
        return self._phase.last_send if isinstance(self._phase, DeltaRounds) else {}

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
        board = Board(next_tag("weightsync-sync")) if multi_rank() else None

        # -- first sync: build the engine on every rank, then the transport preflight. Each step's
        #    outcome is agreed before the next, so no rank enters a collective its peers skipped.
        if cold:
            for phase, fn in (
                ("server compatibility", self._check_compatible),
                ("engine init", self._build_engine),
                ("preflight", self._preflight),
            ):
                err = attempt(fn, board)
                failed = self._agree(board, phase, err)
                if failed:
                    self._drop_engine()  # every rank rebuilds at the next sync
                    self._raise(phase, failed, err)

        # -- pause (sender), agreed before any data collective.
        paused_attempted = self.is_sender and self.pause_mode is not None
        t = time.perf_counter()
        err = attempt(self._pause) if paused_attempted else None
        pause_s = time.perf_counter() - t if paused_attempted else 0.0
        resume_s = 0.0
        try:
            failed = self._agree(board, "pause", err)
        except BaseException:  # the exchange itself failed (a peer died or stopped): never leave a pause
            if paused_attempted:
                self._resume_quietly()
            raise
        if failed:
            if paused_attempted:  # a fan-out pause may have reached some servers
                self._resume_quietly()
            self._raise("pause", failed, err)

        # -- send (+ commit on the sender), then resume whatever happened.
        err = None
        self._phase.begin(board)
        t_send = time.perf_counter()
        try:
            self._commit_client.version = version
            self._commit_client.committed = None
            assert self._engine is not None
            self._phase.send(self._engine, board, version)
            if self.is_sender and self._commit_client.committed != version:
                self._commit_explicitly(version)
        except BaseException as e:  # noqa: BLE001
            err = e
            self._phase.recover(e, self._engine)
        send_s = time.perf_counter() - t_send
        if paused_attempted:
            t = time.perf_counter()
            try:
                self.client.resume()
            except BaseException as e:  # noqa: BLE001
                if err is None:
                    err = e
                else:
                    logger.error("resume after a failed send also failed: %s", describe(e))
            resume_s = time.perf_counter() - t
        failed = self._agree(board, "send", err)
        if failed:
            self._phase.failed()  # every rank (a delta: the next sync is an anchor)
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
            self._engine = WeightTransferTrainerFactory.trainer_init(
                self.init_info, client=self._commit_client, source=self._phase.engine_source
            )
            return
        try:
            self._engine = WeightTransferTrainerFactory.trainer_init(
                self.init_info, client=self._commit_client, source=self._phase.engine_source
            )
        except RuntimeError as e:
            if "PyNccl communicator is disabled" in str(e):  # vLLM >= 0.34, at trainer_init
                e.add_note(f"weightsync: rank {self.rank}: {pynccl_disabled_cause()}")
            raise

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
            logger.error("resume after a failed prepare also failed: %s", describe(e))

    def _agree(self, board: Board | None, phase: str, err: BaseException | None) -> dict[int, str]:
        return agree(board, phase, err, rank=self.rank, timeout_s=self.timeout_s)

    def _raise(self, phase: str, failed: dict[int, str], err: BaseException | None) -> None:
        me = dist.get_rank() if multi_rank() else self.rank
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
            **self._phase.report_fields(wire),
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
