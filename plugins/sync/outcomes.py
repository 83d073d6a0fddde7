"""How the ranks of a sync agree on each phase's outcome before any of them moves on.

Control-plane calls run on rank 0 only and a source can fail on any one rank, so a failure is local
until it is told: a rank that raised alone would leave its peers walking into the next collective by
themselves. Each phase that can fail on one rank is run through ``attempt`` (which captures, never
raises), then the outcomes are exchanged on the process group's store (``Board.exchange``: bounded,
nothing left pending when a rank gives up) with ``agree``, and every rank raises alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from weightsync.sources.toolkit import Board

__all__ = ["agree", "attempt", "describe"]


def attempt(fn: Callable[..., None], *args: object) -> BaseException | None:
    """Run ``fn``; return what it raised (to be agreed across ranks before re-raising)."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller on every rank
        return e
    return None


def describe(e: BaseException) -> str:
    """``"Type: message"``: how a failure is named to the other ranks and in logs, with the notes
    weightsync added to it (``weightsync: ...``, e.g. why vLLM disabled its NCCL communicator): the
    other ranks learn the cause, not only the symptom."""
    notes = [n for n in getattr(e, "__notes__", ()) if isinstance(n, str) and n.startswith("weightsync:")]
    return f"{type(e).__name__}: {e}" + "".join(f" ({n})" for n in notes)


def agree(board: Board | None, phase: str, err: BaseException | None, *, rank: int,
          timeout_s: float) -> dict[int, str]:
    """Exchange each rank's outcome of ``phase`` (on the store: nothing left pending if a rank gives
    up); ``{rank: error}`` for every rank that failed. Without a board (one process) only this
    rank's own outcome, under ``rank``."""
    mine = "" if err is None else describe(err)
    if board is None:
        return {} if err is None else {rank: mine}
    ranks = list(range(dist.get_world_size()))
    got = board.exchange(mine or "ok", ranks=ranks, timeout_s=timeout_s,
                         what=f"the weight sync {phase} outcome exchange")
    return {r: v for r, v in got.items() if v != "ok"}
