"""Multi-rank test worlds on CPU: N spawned processes joined by a gloo process group.

Starting a world costs seconds (torch, vLLM, megatron-core imports), so a test runs many checks per
world: ``fn(rank, world_size, **kwargs)`` is one module-level function that does all of them and
returns a picklable result per rank. A rank that raises or does not finish within ``timeout`` makes
``run_world`` raise with every rank's outcome, and every child is killed: a hang is a failure with a
message, never a stuck CI job.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorldError(AssertionError):
    def __init__(self, message: str, outcomes: dict[int, Any]):
        super().__init__(message)
        self.outcomes = outcomes


def _child(fn, rank, world_size, port, kwargs, queue, pg_timeout_s):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 240.0,
    pg_timeout_s: float = 120.0,
    expect_errors: bool = False,
    **kwargs: Any,
) -> dict[int, Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; return ``{rank: result}``.

    With ``expect_errors=True`` every rank's outcome is returned as ``("ok", result)`` or
    ``("error", text)`` instead of raising, so a bad-input test can assert that *every* rank raised
    a named error (and none hung).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, kwargs, queue, pg_timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Any] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            outcomes[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in outcomes]
    if expect_errors:
        if missing:
            raise WorldError(f"ranks {missing} neither returned nor raised within {timeout}s (hang)", outcomes)
        return outcomes
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if missing or errors:
        lines = [f"world of {world_size} failed: missing ranks {missing} (timeout {timeout}s)"]
        for r, text in sorted(errors.items()):
            lines.append(f"--- rank {r} ---\n{text}")
        raise WorldError("\n".join(lines), outcomes)
    return {r: v for r, (s, v) in outcomes.items()}


def errors_of(fn, *a, **k) -> str | None:
    """``"Type: message"`` of what ``fn(*a, **k)`` raises (draining it if it returns an iterator),
    else None: how a rank reports an expected error as a fact instead of dying."""
    try:
        r = fn(*a, **k)
        if hasattr(r, "__next__"):
            list(r)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return f"{type(e).__name__}: {e}"
    return None
