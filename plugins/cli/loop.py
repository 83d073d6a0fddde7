"""The train-and-sync loop the three demos share (``demo``, ``demo --server vllm``, ``demo --delta``),
and their tally.

Every step, on every rank: one optimizer step of next-token cross-entropy on random ids (each rank
its own data, as in data parallelism), then ``WeightSync.sync(step, weight_version="step-N")``, then
the demo's own check of what the receiver holds (``verify``). A demo differs only in what it builds
around the loop -- the source (``FSDPSource``, ``FP8Source``, ``DeltaSource``), the receiver (a
loopback process, a vLLM server) and its optimizer -- and in ``verify``, which judges a sync and words
its line. ``cold_start=True`` syncs once before the first step (the delta demo's anchor round): that
sync is checked like the others but not counted among the ``steps`` syncs; a failed check fails the
demo all the same.

Invariant: every rank runs the same steps and syncs in the same order (``WeightSync`` is collective)
and ends with the same ``DemoResult`` (``verify`` returns what every rank agreed on).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from weightsync.sources import WeightSyncError

from .common import format_bytes
from .progress import phase

if TYPE_CHECKING:  # importing the driver imports vLLM: not for the CLI's Ctrl-C path (``progress``)
    from ..sync import SyncReport, WeightSync  # noqa: F401 - SyncReport: in the Verify alias (a string)

__all__ = ["DemoResult", "TrainerCollectiveError", "Verdict", "progress", "train_and_sync"]

#: The demo running in this process (``progress``: what Ctrl-C reports).
_CURRENT: "DemoResult | None" = None


@dataclass
class DemoResult:
    """One demo's tally. ``steps``: the syncs asked for (one per training step); creating a result
    makes it this process's current demo, which ``progress`` reads. ``failed_extra``: checks outside
    the counted syncs that failed (the delta demo's cold-start anchor)."""

    steps: int = 0
    syncs: int = 0
    verified: int = 0
    bytes: int = 0
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    summary: str = ""
    failed_extra: int = 0

    def __post_init__(self) -> None:
        global _CURRENT
        _CURRENT = self

    @property
    def ok(self) -> bool:
        return self.syncs > 0 and self.verified == self.syncs and not self.failed_extra

    def finish(self, demo: str, world: int, model: str, n_params: int, target: str = "") -> str:
        """Set and return the one summary line every demo ends with (``target``: what it synced into)."""
        self.summary = (
            f"{demo}: {self.verified}/{self.syncs} syncs verified, "
            f"{format_bytes(self.bytes)} sent in {self.seconds:.2f} s "
            f"({world} ranks, {model}, {n_params:,} params) -> {target}" + ("PASS" if self.ok else "FAIL")
        )
        return self.summary


class TrainerCollectiveError(WeightSyncError):
    """A collective of the demo's own work between syncs -- FSDP2's all-gathers and reduce-scatters
    in the training step, the demo's checks -- failed in the process group: a peer rank stopped
    past the process group's timeout (which the CLI sets to the sync timeout:
    ``common.init_cpu_process_group``) or died. Inside a sync weightsync's own bounded waits name
    the late rank (``SyncTimeoutError``, ``PeerFailedError``); outside one, this names the step."""


#: gloo's words for a peer that is gone or late (its errors are plain ``RuntimeError``s)
_GLOO_PEER_FAILURE = ("Timed out", "pair closure", "Connection closed", "Connection reset", "Broken pipe")


@contextmanager
def _trainer_collectives(rank: int, step: int, what: str) -> Iterator[None]:
    """A gloo failure of the trainer's own collectives inside the block is raised as a named
    ``TrainerCollectiveError`` saying where (anything else passes unchanged)."""
    try:
        yield
    except WeightSyncError:
        raise
    except RuntimeError as e:
        if not any(w in str(e) for w in _GLOO_PEER_FAILURE):
            raise
        said = re.sub(r"^\[[^]]*\] ", "", str(e).strip())[:200]  # gloo's source location first
        raise TrainerCollectiveError(
            f"rank {rank}: step {step}: {what}: a collective of the trainer failed ({said}); "
            "a peer rank is stopped past the process group's timeout, or gone"
        ) from e


def progress() -> tuple[int, int]:
    """``(syncs done, syncs asked for)`` of the demo running in this process ((0, 0) before one starts)."""
    return (_CURRENT.syncs, _CURRENT.steps) if _CURRENT is not None else (0, 0)


@dataclass(frozen=True)
class Verdict:
    """A demo's judgement of one sync, the same on every rank. ``ok``: True verified, False failed,
    None not checked (counts as not verified, but is no failure). ``bytes`` / ``seconds``: what the
    demo counts as sent and as the sync's time; ``line``: what it prints for the sync."""

    ok: bool | None
    line: str
    bytes: int
    seconds: float


#: ``verify(step, loss or None (the cold start), the sync's report, its wall seconds) -> Verdict``
Verify = Callable[[int, "float | None", "SyncReport", float], Verdict]


def train_and_sync(
    ws: "WeightSync",
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    result: DemoResult,
    *,
    vocab_size: int,
    rank: int,
    verify: Verify,
    say: Callable[..., object],
    cold_start: bool = False,
) -> None:
    """The loop (module docstring): ``result.steps`` training steps, a ``ws.sync`` after each (and one
    before the first with ``cold_start``), each judged by ``verify``, tallied into ``result`` and its
    line printed with ``say``. Every rank calls it."""
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as in DP
    for step in range(0 if cold_start else 1, result.steps + 1):
        loss = None
        phase(f"step {step} of {result.steps}: training" if step else "the cold-start sync")
        if step:
            with _trainer_collectives(rank, step, "the training step (FSDP2's collectives)"):
                ids = torch.randint(0, vocab_size, (4, 32), generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optim.step()
                optim.zero_grad()
        t0 = time.perf_counter()
        phase(f"step {step} of {result.steps}: syncing" if step else "the cold-start sync")
        report = ws.sync(step, weight_version=f"step-{step}")
        seconds = time.perf_counter() - t0
        phase(f"step {step} of {result.steps}: checking what the receiver holds")
        with _trainer_collectives(rank, step, "the demo's check of the sync"):
            verdict = verify(step, None if loss is None else loss.item(), report, seconds)
        if step:  # the syncs counted are the steps' (--steps N: sync 1/N ... N/N)
            result.syncs += 1
            result.verified += int(verdict.ok is True)
        else:  # the cold start is checked alike; a failure fails the demo
            result.failed_extra += int(verdict.ok is False)
        result.bytes += verdict.bytes
        result.seconds += verdict.seconds
        result.lines.append(verdict.line)
        say(verdict.line)
