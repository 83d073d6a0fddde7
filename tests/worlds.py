"""Multi-rank test worlds on CPU: N processes joined by a gloo process group.

A test runs many checks per world: ``fn(rank, world_size, **kwargs)`` is one module-level function
that does all of them and returns a picklable result per rank. A rank that raises or does not finish
within ``timeout`` makes ``run_world`` raise with every rank's outcome, and every child is killed: a
hang is a failure with a message, never a stuck CI job.

Start-up: importing torch, transformers, megatron-core, vLLM and weightsync costs ~10 s of CPU per
process, which used to be paid by every rank of every world (and every loopback receiver). Ranks
now come from one ``forkserver`` per pytest process (``CONTEXT``) that has those modules imported
once; each rank is a fork of it, single-threaded, with no process group, no CUDA and no megatron
parallel state initialised -- so every world still starts from a clean slate, in milliseconds.

Rendezvous: the parent binds the world's ``TCPStore`` on port 0 and passes the bound port to the
ranks, so no port is ever picked by one process and bound later by another (no EADDRINUSE race).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable, Iterator


#: Imported once in the forkserver; every rank and test receiver is forked from it. A module that
#: is missing here (megatron-core on a lean install) is skipped by the forkserver, not an error.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "accelerate",
    "peft",
    "safetensors.torch",
    "megatron.core",
    "vllm.distributed.weight_transfer",
    "weightsync.sources",
    "weightsync.plugins",
    "weightsync.plugins.loopback.trainer",
    "weightsync.plugins.loopback.receiver",
    "worlds",
    "fsdp_worlds",
    "megatron_worlds",
    "moe_models",
    "mla_models",
    "moe_megatron",
]

CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


@contextlib.contextmanager
def dead_port() -> Iterator[int]:
    """A local port that refuses connections for as long as the block runs: bound, never listening,
    so no other process can take it meanwhile (a dead peer's address without a race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class WorldError(AssertionError):
    def __init__(self, message: str, outcomes: dict[int, Any]):
        super().__init__(message)
        self.outcomes = outcomes


def _child(fn, rank, world_size, port, kwargs, queue, pg_timeout_s, env):
    """One rank: join the parent's store at ``port``, run ``fn``, report through ``queue``."""
    # The parent's environment as of run_world (a forked rank would otherwise see the forkserver's,
    # as of its start). What a module read at import time, or malloc at process start, stays as it was.
    os.environ.clear()
    os.environ.update(env)
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
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
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
    import torch.distributed as dist

    ctx = CONTEXT
    queue = ctx.Queue()
    # The parent hosts the world's store, bound on port 0: the port is taken before anyone hears it.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    port = store.port
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, kwargs, queue, pg_timeout_s, dict(os.environ)))
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
        del store
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


def _world_store(timeout_s: float) -> Any:
    """A client of this world's own ``TCPStore`` (the parent hosts it at ``MASTER_PORT``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def tell_peers(event: str) -> None:
    """In a rank: ``event`` happened here (``wait_for_peers`` on another rank returns). How a test
    world orders ranks on an event instead of a fixed sleep that a loaded machine outlasts."""
    _world_store(60.0).set(f"ws-test-event/{event}", b"1")


def wait_for_peers(*events: str, timeout_s: float = 300.0) -> None:
    """In a rank: block until every one of ``events`` was told (``tell_peers``) by some rank;
    ``timeout_s`` bounds it (reached only when the rank that should tell failed: then it raises)."""
    _world_store(timeout_s).wait([f"ws-test-event/{e}" for e in events])


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


def _cli_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str, str]:
    """``weightsync argv`` as this rank runs it under torchrun (``LOCAL_RANK``/``WORLD_SIZE`` are set,
    the default group exists): the exit code and what it printed."""
    import contextlib
    import io

    from weightsync.plugins.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


class CliResult:
    """What ``subprocess.run`` would have returned for rank 0, plus every rank's output."""

    def __init__(self, per_rank: dict[int, tuple[int, str, str]]) -> None:
        self.returncode, self.stdout, self.stderr = per_rank[0]
        self.per_rank = per_rank


def run_cli(*argv: str, nproc: int = 1, timeout: float = 400.0) -> CliResult:
    """Run the ``weightsync`` CLI's rank code on ``nproc`` forked ranks: the same code path a rank
    takes under the CLI's own torchrun launch, without paying a fresh interpreter's imports per rank
    (~8 s each here). The console script and the torchrun launch themselves are covered by the
    tests that run ``weightsync`` as a subprocess (tests/test_demo_cli.py)."""
    return CliResult(run_world(_cli_rank, nproc, timeout=timeout, argv=list(argv)))


def _script_rank(rank: int, world_size: int, path: str, args: list[str]) -> tuple[int, str, str]:
    """``python path args`` as this rank runs it under torchrun: exit code and what it printed."""
    import contextlib
    import io
    import runpy
    import sys

    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - a crash is the script's exit 1, with its traceback
            err.write(traceback.format_exc())
            code = 1
    return code, out.getvalue(), err.getvalue()


def run_script(path: str, *args: str, nproc: int = 2, timeout: float = 400.0) -> CliResult:
    """Run a torchrun-able script on ``nproc`` forked ranks (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
    set, the default gloo group formed, as torchrun would leave them)."""
    return CliResult(run_world(_script_rank, nproc, timeout=timeout, path=path, args=list(args)))
