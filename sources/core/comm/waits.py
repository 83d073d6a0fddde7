"""Bounded collectives: no weightsync collective waits forever, and a failed rank is heard at once.

A multi-rank pass is a chain of collectives; when one rank leaves the chain (its source raised, its
model differs, it stopped early) every other rank blocks in its next collective until the process
group's timeout -- 30 minutes for gloo by default, often forever in practice. Two pieces here turn
that into a named error on every rank within a bounded time:

* ``bounded_group(ranks, timeout_s=...)``: a gloo group over ``ranks`` created with a finite timeout
  (cached; creation is synchronized among the members only). weightsync's own collectives run on it,
  off the device, whatever backend the trainer uses.
* ``Board`` + ``wait_bounded(work, ...)``: a per-pass failure board on the default process group's
  store. A rank that fails posts its error there (``Board.fail``); a rank that waits on an async
  collective with ``wait_bounded`` polls the work and -- only once it has waited a little, so the fast
  path costs nothing -- the board. It raises ``PeerFailedError`` quoting the failed rank's own error
  as soon as one is posted, or ``SyncTimeoutError`` naming the ranks that never reached this
  collective and what was being exchanged (the parameter, for a gather) when ``timeout_s`` elapses.

Invariant: every rank issues the same weightsync collectives in the same order, so the n-th
``wait_bounded`` of a pass means the same exchange everywhere; board keys are namespaced by a pass
tag that every rank derives the same way (a per-process counter of passes, which agree as long as
ranks run passes in lockstep -- and if they don't, the bounded wait is what reports it).
After a failed pass a bounded group may still hold an unmatched operation, so ``discard_groups``
drops the cache and the next pass builds fresh ones (every rank of a failed pass fails, so every rank
discards alike).
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ..ground.errors import ExchangeError, PeerFailedError, SyncTimeoutError, WeightSyncError  # noqa: F401 (re-export)
from ..ground.logs import get_logger

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PeerFailedError",
    "Board",
    "bounded_group",
    "discard_groups",
    "group_ranks",
    "next_tag",
    "wait_bounded",
    "wait_p2p",
    "active_board",
]

logger = get_logger(__name__)

#: Bound on every weightsync-issued wait (control exchanges, gathers issued through ``wait_bounded``).
DEFAULT_TIMEOUT_S = 300.0

#: How long a wait runs before it starts polling the board (and marks itself as waiting). Below this
#: a wait costs only ``work.is_completed()`` polls: no store traffic on the fast path.
_QUIET_S = 0.05

#: The gloo group's own timeout is set this much above the weightsync bound, so that the bounded wait
#: (which knows the parameter and the late ranks) always fires first.
_GROUP_SLACK_S = 30.0


_GROUPS: dict[tuple, Any] = {}
_GENERATION = itertools.count()
_generation = next(_GENERATION)
_TAGS: dict[str, itertools.count] = {}


def group_ranks(group: Any = None) -> tuple[int, ...]:
    """The global ranks of ``group`` (default: the world)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def bounded_group(
    ranks: Sequence[int] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    purpose: str = "control",
) -> Any:
    """A gloo group over ``ranks`` (default: the world) whose operations time out, created once.

    Only the members synchronize on creation (``use_local_synchronization``), so a subgroup never
    needs the other ranks' cooperation. Cached per (default group, ranks, timeout, purpose,
    generation). ``purpose="pass"`` groups carry the exchanges inside a checked pass and are the only
    ones ``discard_groups`` drops; ``"control"`` groups (the driver's outcome exchanges) are never
    abandoned mid-operation, so they stay aligned across failed passes.
    """
    members = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
    gen = _generation if purpose == "pass" else 0
    key = (id(dist.distributed_c10d._get_default_group()), members, float(timeout_s), purpose, gen)
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(
            ranks=list(members),
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_s + _GROUP_SLACK_S),
            use_local_synchronization=True,
            group_desc="weightsync_bounded",
        )
        _GROUPS[key] = group
    return group


def discard_groups() -> None:
    """Forget the cached ``purpose="pass"`` groups (one may hold an unmatched op after a failed pass).

    Call it on every rank of a failed pass; the next pass builds fresh ones.
    """
    global _generation
    for key in [k for k in _GROUPS if k[3] == "pass"]:
        del _GROUPS[key]
    _generation = next(_GENERATION)


def next_tag(kind: str) -> str:
    """``kind/N``: the N-th pass of this kind in this process, equal across ranks in lockstep."""
    counter = _TAGS.setdefault(kind, itertools.count())
    return f"{kind}/{next(counter)}"


class Board:
    """A pass's failure board on the default store: who failed first and why, who waits where.

    Posting costs one store round trip and happens only on failure or after a wait exceeded
    ``_QUIET_S``; reading happens only inside such a slow wait.
    """

    def __init__(self, tag: str, *, rank: int | None = None) -> None:
        self.tag = tag
        self.rank = dist.get_rank() if rank is None else rank
        self._store = dist.PrefixStore(f"weightsync/{tag}/", dist.distributed_c10d._get_default_store())
        self._step = 0
        self.failed_here = False

    def next_step(self) -> int:
        self._step += 1
        return self._step

    def fail(self, message: str) -> None:
        """Post this rank's failure (the first poster is the one peers quote)."""
        if self.failed_here:
            return
        self.failed_here = True
        try:
            self._store.set(f"fail/{self.rank}", message)
            if self._store.add("nfail", 1) == 1:
                self._store.set("first", f"{self.rank}\x00{message}")
        except Exception as e:  # the store itself is gone: nothing more we can tell peers
            logger.warning("could not post failure to the weightsync board: %s", e)

    def failure(self) -> tuple[int, str] | None:
        """The first posted failure of this pass, or None."""
        if self._store.add("nfail", 0) == 0:
            return None
        rank, _, message = self._store.get("first").decode().partition("\x00")
        return int(rank), message

    def exchange(
        self,
        value: str,
        *,
        ranks: Sequence[int],
        what: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        parse: Callable[[str], Any] | None = None,
    ) -> dict[int, Any]:
        """Every rank of ``ranks`` posts ``value``; return ``{rank: value}`` once all have
        (``{rank: parse(value)}`` with ``parse``).

        Runs on the store, not on a process group: nothing to pair up, nothing left pending when a
        rank gives up, so a failed pass leaves no group misaligned and no group has to be built at
        a moment a late rank might miss. Fast path: one set, one check, one multi-get. Slow path:
        the same polling as ``wait_bounded`` (board after ``_QUIET_S``, ``SyncTimeoutError`` naming
        the absent ranks after ``timeout_s``, posted on the board so a straggler learns why).
        A value that is not text, or that ``parse`` rejects, raises ``ExchangeError`` naming
        ``what`` and the rank it came from (also posted on the board), never the parser's own error.
        """
        step = self.next_step()
        keys = [f"x/{step}/{r}" for r in ranks]
        self._store.set(f"x/{step}/{self.rank}", value)
        t0 = time.monotonic()
        pause = 1e-4
        while not self._store.check(keys):
            waited = time.monotonic() - t0
            if waited > _QUIET_S:
                failure = self.failure()
                if failure is not None and failure[0] != self.rank:
                    raise PeerFailedError(
                        f"rank {self.rank}: rank {failure[0]} failed while this rank waited in "
                        f"{what}: {failure[1]}"
                    )
                if waited > timeout_s:
                    absent = [r for r, k in zip(ranks, keys) if not self._store.check([k])]
                    message = (
                        f"rank {self.rank}: {what} did not complete within {timeout_s:g}s; "
                        f"{_late(absent)} (ranks of this exchange: {list(ranks)}). A late rank is "
                        "usually still in a previous step, stopped iterating early, or is not "
                        "calling the sync at all."
                    )
                    self.fail(message)
                    raise SyncTimeoutError(message)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        out: dict[int, Any] = {}
        for r, raw in zip(ranks, self._store.multi_get(keys)):
            try:
                text = raw.decode()
                out[r] = text if parse is None else parse(text)
            except Exception as e:  # noqa: BLE001 - any parser's error becomes one named error
                message = (
                    f"rank {self.rank}: {what}: the value of rank {r} read from the store is "
                    f"unreadable ({type(e).__name__}: {e}); read {bytes(raw[:120])!r}"
                    f"{'...' if len(raw) > 120 else ''}. The store returned garbage, or that rank runs "
                    "another weightsync version."
                )
                self.fail(message)
                raise ExchangeError(message) from e
        return out

    def mark_waiting(self, step: int, what: str) -> None:
        self._store.set(f"wait/{step}/{self.rank}", what)

    def absent(self, step: int, ranks: Sequence[int]) -> list[int]:
        """Ranks of ``ranks`` that have not marked themselves waiting at ``step``."""
        return [r for r in ranks if r != self.rank and not self._store.check([f"wait/{step}/{r}"])]


_ACTIVE: list[Board] = []


def active_board() -> Board | None:
    """The board of the checked pass running in this process, if any (``CheckedSource`` sets it), so
    a source's own ``wait_bounded`` calls hear about failures posted by other ranks' checks."""
    return _ACTIVE[-1] if _ACTIVE else None


def activate(board: Board) -> None:
    _ACTIVE.append(board)


def deactivate(board: Board) -> None:
    if board in _ACTIVE:
        _ACTIVE.remove(board)


def wait_bounded(
    work: Any,
    *,
    board: Board | None = None,
    ranks: Sequence[int],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Wait for async ``work`` (issued with ``async_op=True``) at most ``timeout_s``.

    ``what`` names the exchange ("all-gather of 'model.layers.0.mlp.up_proj.weight'") and appears in
    every error. ``board`` defaults to the active checked pass's board (``active_board``), else a
    private one (timeouts still name the absent ranks). Raises ``PeerFailedError`` as soon as another rank of the pass posts a failure,
    ``SyncTimeoutError`` naming the absent ranks after ``timeout_s``, and converts an error of the
    work itself into ``SyncTimeoutError`` with the same context.
    """
    if board is None:
        board = active_board() or Board(next_tag("wait"))
    step = board.next_step()
    rank = board.rank
    if work.is_completed():
        _finish(work, board, ranks, what, step)
        return
    t0 = time.monotonic()
    marked = False
    pause = 5e-5
    while not work.is_completed():
        waited = time.monotonic() - t0
        if waited > _QUIET_S:
            if not marked:
                board.mark_waiting(step, what)
                marked = True
            failure = board.failure()
            if failure is not None and failure[0] != rank:
                raise PeerFailedError(
                    f"rank {rank}: rank {failure[0]} failed while this rank waited in {what}: "
                    f"{failure[1]}"
                )
            if waited > timeout_s:
                absent = board.absent(step, ranks)
                message = (
                    f"rank {rank}: {what} did not complete within {timeout_s:g}s; "
                    f"{_late(absent)} (ranks of this exchange: {list(ranks)}). A late rank is "
                    "usually still in a previous step, stopped iterating early, or is not calling "
                    "the sync at all."
                )
                board.fail(message)  # a late rank that arrives after all learns why, at once
                raise SyncTimeoutError(message)
        # Gentle backoff: a doubling sleep overshoots a sub-millisecond gather by up to 2x, and
        # these waits sit on the per-group hot path; 1.25x keeps the overshoot near 25%.
        time.sleep(pause)
        pause = min(pause * 1.25, 0.002 if waited < _QUIET_S else 0.01)
    _finish(work, board, ranks, what, step)


def _late(absent: list[int]) -> str:
    if not absent:
        return "every rank arrived but the exchange did not finish"
    return f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never reached it"


def _finish(work: Any, board: Board, ranks: Sequence[int], what: str, step: int) -> None:
    try:
        work.wait()
    except Exception as e:
        failure = board.failure()
        if failure is not None and failure[0] != board.rank:
            raise PeerFailedError(
                f"rank {board.rank}: rank {failure[0]} failed during {what}: {failure[1]}"
            ) from e
        raise SyncTimeoutError(f"rank {board.rank}: {what} failed: {e}") from e


def wait_p2p(work: Any, *, peer: int, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait for one point-to-point ``work`` (``isend``/``irecv``), bounded on gloo.

    gloo's send/recv work completes only inside ``wait`` (``is_completed`` does not advance it), so
    ``wait_bounded``'s polling cannot serve here; ``wait(timeout)`` is gloo's own bounded wait. The
    error names this rank, the peer and ``what`` (the parameter). After it the pair's state is
    undefined: rebuild the process group. Device backends use a plain ``wait()`` (their watchdog
    bounds it; a host-side timeout would synchronize every transfer).
    """
    if dist.get_backend() != "gloo":
        work.wait()
        return
    import datetime

    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise SyncTimeoutError(
            f"rank {dist.get_rank()}: {what} did not complete within {timeout_s:g}s: rank {peer} "
            f"never took its side of the transfer ({e}). A late rank is usually still in a previous "
            "step, stopped iterating early, or is not calling the sync at all."
        ) from e
