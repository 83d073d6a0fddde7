"""A line at least every ``EVERY_S`` seconds while a command works: no silent wait a user must sit
through (building a model, a first sync, a vLLM server starting, a comparison).

Rank 0 runs ``heartbeat(command)`` around the command; a daemon thread watches the time of the last
write to stdout or stderr (``_Stamped`` wraps both for the duration) and, once nothing was written
for ``EVERY_S``, prints ``weightsync <command>: ... <phase> (<N> s)`` to stderr. ``phase(text)``
names what the command is doing now (a no-op where no heartbeat runs: other ranks, tests calling the
rank code in-process). The thread touches no collective and no model: it only prints.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["EVERY_S", "heartbeat", "phase"]

#: The longest a command stays silent (seconds).
EVERY_S = 4.0

_STATE: dict[str, Any] = {"phase": None, "since": 0.0}


class _Stamped:
    """A text stream that records when it was last written to (everything else is the stream's)."""

    def __init__(self, stream: TextIO, clock: list[float]) -> None:
        self._stream = stream
        self._clock = clock

    def write(self, text: str) -> int:
        if text:
            self._clock[0] = time.monotonic()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def phase(text: str) -> None:
    """What the command is doing from now on (the heartbeat's words; its seconds count from here)."""
    _STATE["phase"] = text
    _STATE["since"] = time.monotonic()


@contextmanager
def heartbeat(command: str, *, enabled: bool = True, every_s: float = EVERY_S) -> Iterator[None]:
    """Within the block: a line on stderr whenever stdout and stderr were silent for ``every_s``."""
    if not enabled:
        yield
        return
    clock = [time.monotonic()]
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stamped(out, clock), _Stamped(err, clock)  # type: ignore[assignment]
    phase("loading torch, transformers and vLLM")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.25):
            now = time.monotonic()
            if now - clock[0] >= every_s:
                sys.stderr.write(f"weightsync {command}: ... {_STATE['phase']} ({now - _STATE['since']:.0f} s)\n")
                sys.stderr.flush()

    thread = threading.Thread(target=beat, name="weightsync-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.stdout, sys.stderr = out, err
        _STATE["phase"] = None
