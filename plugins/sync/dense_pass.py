"""The dense send phase of ``WeightSync``: one ``send_weights()`` pass of the source through the
engine (and the draft round after it), on every rank.

**A failed sender finishes the pass.** A sender whose consumer failed halfway through the source's
pass finishes the pass alone (engines for which ``capabilities.finishable_pass`` holds), so peers
blocked in the source's gathers complete them and reach the outcome exchange instead of waiting out
the process-group timeout. ``TrackedSource`` is what the engine iterates: the source unchanged, but
remembering the pass in flight so that it can be finished.

**A broadcaster completes its turn** (vLLM's dense NCCL engine, ``capabilities.blocking_turns``:
one sender, or many with ``senders="owners"`` in vLLM 0.34, each tensor broadcast by its first
owner, each broadcaster on its own turn while the others wait in that turn's broadcasts). A
broadcaster whose source fails mid-turn cannot just stop: the workers (and, with many senders, every
other member of the transfer group) would wait in the next broadcast forever (NCCL has no timeout).
So it completes its turn with zeros of the declared shapes (the engine's own ``_checked_iter`` still
checks them), posts the failure on the sync's sender board when there is one, and raises after
``send_weights`` returns; rank 0, seeing the failure (its own, or one posted), finishes the update
without committing the new ``weight_version``; then the send outcome is agreed and every rank
raises. The workers hold zeros where the failed turn's tensors should be until the next sync, which
sends every tensor again.
The cross-rank metadata agreement runs when ``WeightSync`` is built (``CheckedSource``), since no
exchange can run inside a pass.

**Draft sync** (``draft=``: a second source, e.g. ``MegatronSource(part="mtp")``, the speculative
decoding draft's tensors). In the same pause, right after the policy's update went through on every
rank, the same trainer engine runs one more round with the draft as its source and a client whose
``start_weight_update`` is ``start_draft_weight_update`` (vLLM 0.33+: that round loads into the
draft model), finished with the same ``weight_version``. Refused at construction (``check_draft``),
on every rank, for engines that cannot retarget (``capabilities.is_draftless``), delta rounds, many
senders and ``use_load_plan`` (the NCCL trainer checks every round against the policy's load plan),
and for a client without ``start_draft_weight_update``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import Board, broadcast_ranks, get_logger, multi_rank, senders_of

from . import capabilities
from .clients import CommittingClient, DraftClient
from .outcomes import describe

__all__ = ["DensePass", "TrackedSource", "check_draft"]

logger = get_logger(__name__)


class TrackedSource(WeightSource):
    """What the engine iterates: the driver's source, unchanged (same metadata, same iterator
    objects, no per-tensor work), except that it remembers the pass in flight so the driver can
    finish it when the engine's consumer failed halfway."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.live: Iterator[Any] | None = None
        self.passes = 0
        #: many senders (``senders="owners"``): the sync's sender board, set per sync by the driver
        self.turns: Board | None = None
        #: this rank broadcasts over an engine whose workers block in every declared tensor
        #: (``capabilities.blocking_turns``): its pass always yields them all; set by ``DensePass``
        self.completes_turn = False
        #: this rank's rank (``init_info.rank``), for the failure's log line and board post
        self.rank = 0
        #: what this broadcaster's source raised in its turn (the turn was completed with zeros)
        self.failure: BaseException | None = None

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata

    @property
    def senders(self) -> str:
        return senders_of(self.source)

    def owned_names(self, rank: int) -> list[str]:
        return self.source.owned_names(rank)

    def implements_iter_full(self) -> bool:
        return self.source.implements_iter_full()

    def implements_iter_local(self) -> bool:
        return self.source.implements_iter_local()

    def iter_full(self) -> Iterator[Any]:
        self.passes += 1
        self.live = iter(self.source.iter_full())
        if self.completes_turn:
            return self._complete_turn(self.live)
        return self.live

    def _complete_turn(self, pairs: Iterator[Any]) -> Iterator[Any]:
        """A broadcaster's pass that always yields every tensor it declared (module docstring):
        after a failure, zeros of the declared shapes and dtypes, on the device of what it yielded."""
        rank = self.rank
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
            if self.turns is not None:
                self.turns.fail(f"rank {rank}: {type(e).__name__}: {e}")
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


class DensePass:
    """The dense send phase (module docstring): the engine's ``send_weights()`` over the tracked
    source, then the draft round; on this rank's failure, the pass finished for its peers."""

    def __init__(self, source: WeightSource, draft: WeightSource | None, client: CommittingClient, *,
                 backend: str, rank: int, many_senders: bool) -> None:
        self.tracked = TrackedSource(source)
        self.draft = draft
        self.client = client
        self.backend = backend
        self.rank = rank
        self.many_senders = many_senders
        self._passes_before = 0
        self._turns: Board | None = None
        self.tracked.rank = rank
        #: a failure this rank's own turn completed with zeros withholds the version at finish
        client.sender_failed = lambda: self.tracked.failure is not None

    @property
    def engine_source(self) -> WeightSource:
        """The ``source`` the engine is built with (``trainer_init``)."""
        return self.tracked

    def begin(self, board: Board | None) -> None:
        """Before the sync's send, on every rank: mark the pass and open the sender board."""
        self._passes_before = self.tracked.passes
        turns = Board(f"{board.tag}/senders") if board is not None and self.many_senders else None
        self._turns = self.tracked.turns = self.client.turns = turns
        self.tracked.failure = None
        self.tracked.completes_turn = (capabilities.blocking_turns(self.backend)
                                       and self.rank in broadcast_ranks(self.tracked.metadata))

    def send(self, engine: TrainerWeightTransferEngine, board: Board | None, version: str) -> None:
        """The engine's pass, then the draft's; raises this rank's failure, or a broadcaster's that
        completed its turn with zeros."""
        engine.send_weights()
        if self.draft is not None and self.tracked.failure is None:
            self._send_draft(engine)
        if self.tracked.failure is not None:  # this broadcaster's turn was completed with zeros
            raise self.tracked.failure
        failed = self._turns.failure() if self._turns is not None else None
        if failed is not None:
            raise WeightSyncError(
                f"rank {self.rank}: sending rank {failed[0]} failed in its turn and completed it "
                f"with zeros ({failed[1]}); the update was finished without committing "
                f"weight_version {version!r}"
            )

    def recover(self, err: BaseException, engine: TrainerWeightTransferEngine | None) -> None:
        """This rank's ``send_weights`` raised. If peers can only be blocked in the source's own
        collectives (``capabilities.finishable_pass``), finish the pass here so they complete it and
        reach the outcome exchange, instead of waiting out the process-group timeout."""
        if not capabilities.finishable_pass(engine, self.backend) or not multi_rank():
            return
        try:
            n = self.tracked.finish_pass(self._passes_before)
        except BaseException as e:  # noqa: BLE001 - the source itself failed too; peers hear it
            logger.error("finishing the pass after %s failed: %s", describe(err), describe(e))
            return
        if n:
            logger.warning("send failed (%s); finished the pass here (%d tensors) so peers complete it",
                           describe(err), n)

    def failed(self) -> None:
        """The send failed on some rank (agreed): nothing to undo for a dense pass."""

    def report_fields(self, wire_bytes: int) -> dict[str, Any]:
        """A dense pass adds nothing to the ``SyncReport`` (the source's ``last_pass`` says it)."""
        return {}

    def _send_draft(self, engine: TrainerWeightTransferEngine) -> None:
        """The draft round (module docstring): the engine's source and client swapped for the
        round, restored after it whatever happens. Every rank runs it (the draft source's gathers)."""
        assert self.draft is not None
        saved = engine.source, engine.client, self.client.sender_failed
        draft = TrackedSource(self.draft)
        draft.rank, draft.completes_turn = self.rank, self.tracked.completes_turn
        self.client.sender_failed = lambda: draft.failure is not None  # the draft's turn withholds too
        engine.source, engine.client = draft, DraftClient(self.client)
        try:
            engine.send_weights()
            if draft.failure is not None:  # completed with zeros: raised once the workers are free
                raise draft.failure
        except BaseException as e:
            # peers may be blocked in the draft's gathers: finish its pass here, as for the policy's
            if capabilities.finishable_pass(engine, self.backend) and multi_rank():
                try:
                    draft.finish_pass(0)
                except BaseException as e2:  # noqa: BLE001 - the draft round's own failure is raised
                    logger.error("rank %d: finishing the draft pass after %s failed: %s", self.rank,
                                 describe(e), describe(e2))
            raise
        finally:
            engine.source, engine.client, self.client.sender_failed = saved


def check_draft(draft: Any, source: Any, init_info: TrainerInitInfo, client: Any, delta: bool) -> None:
    """``WeightSync(draft=...)``'s refusals (module docstring): arguments only, so the same verdict on
    every rank, before any byte moves."""
    if draft is None:
        return
    rank, backend = init_info.rank, init_info.backend
    where = f"WeightSync: rank {rank}: draft="
    if not isinstance(draft, WeightSource):
        raise TypeError(f"{where} must be a vLLM WeightSource (e.g. MegatronSource(part='mtp')), got {type(draft).__name__}")
    if capabilities.is_draftless(init_info):
        raise ValueError(
            f"{where} backend {backend!r} ({type(init_info).__name__}) cannot update a draft model: its vLLM "
            "engine reports supports_draft_weight_update = False (sparse_nccl, nccl_m2n, sharded_rdt); "
            "sync the draft through vLLM's 'nccl' or 'ipc' engine, or leave draft=None"
        )
    if delta:
        raise ValueError(f"{where} cannot ride a delta round (sparse patches go to the target model only)")
    if senders_of(source) == "owners" or senders_of(draft) == "owners":
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
