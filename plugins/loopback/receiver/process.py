"""A ``LoopbackReceiver`` in its own process (``start_receiver_process``) and its handle.

Invariants, and why: the child builds the model and starts serving before it reports its URL on a
pipe, so ``start_receiver_process`` returns only once the server accepts requests (or raises the
child's own error); the child exits with its parent (a watcher thread), so a crashed test leaves no
server behind; a ``spawn`` child imports the parent's ``__main__`` script again, so a call from an
unguarded top-level statement is refused up front, naming the line, instead of a child that dies
before it reports.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

from weightsync.sources import WeightSyncError

from .client import ReceiverClient
from .receiver import LoopbackReceiver
from .server import ReceiverServer

__all__ = ["ReceiverHandle", "start_receiver_process"]


class ReceiverHandle:
    """The receiver process: ``url``, ``pid``, ``alive``, ``stop()``; a context manager."""

    def __init__(self, process: Any, url: str) -> None:
        self.process = process
        self.url = url

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                ReceiverClient(self.url, timeout=2).shutdown_server()
            except WeightSyncError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __enter__(self) -> "ReceiverHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _receiver_main(model_factory: Callable[[], torch.nn.Module], host: str, port: int, conn: Any) -> None:
    try:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        model = model_factory()
        server = ReceiverServer(LoopbackReceiver(model), host, port)
        conn.send(("ok", server.url))
        conn.close()
        server.serve_forever()
        server.httpd.server_close()
        # nothing is left to do: end now rather than through a spawned interpreter's teardown of
        # torch and transformers (seconds of CPU the trainer's stop() would wait out)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        except Exception:  # noqa: BLE001
            pass


def _is_main_guard(node: Any) -> bool:
    """``if __name__ == "__main__":`` (either operand order, or one term of an ``and``)."""
    import ast

    if not isinstance(node, ast.If):
        return False
    tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else [node.test]
    for t in tests:
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            sides = [t.left, t.comparators[0]]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            consts = {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__"} and consts == {"__main__"}:
                return True
    return False


def _unguarded_main_statement(ctx: Any) -> tuple[str, int] | None:
    """``(script, line)`` when this call runs from a top-level statement of the ``__main__`` script
    that is not under ``if __name__ == "__main__":`` and ``ctx`` is ``spawn`` (the child imports the
    script again as ``__mp_main__``, runs that statement again, and multiprocessing refuses to start a
    process during bootstrapping: the child dies before it reports). None otherwise, and whenever it
    cannot tell (no script file: ``python -c``, a notebook; source that does not parse)."""
    import ast
    import inspect
    import sys

    if ctx.get_start_method() != "spawn":
        return None
    main = sys.modules.get("__main__")
    # as multiprocessing.spawn decides: a main imported by name (``python -m``) is re-imported by that
    # name, except a package's ``__main__`` (never re-run); a main without a spec is re-run by path
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py") or not os.path.isfile(path):
        return None
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return None if _is_main_guard(node) else (str(path), line)
    return None


def start_receiver_process(
    model_factory: Callable[[], torch.nn.Module],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    start_timeout_s: float = 120.0,
    client_timeout_s: float = 300.0,
    mp_context: Any = None,
) -> tuple[ReceiverClient, ReceiverHandle]:
    """Start a process that builds ``model_factory()`` (picklable: a module-level function or a
    ``functools.partial`` of one) and serves it as a ``LoopbackReceiver`` over HTTP.

    Returns ``(client, handle)`` once the server accepts requests. The process exits when the
    parent does, on ``handle.stop()``, or on ``POST /_shutdown``. ``mp_context``: the
    ``multiprocessing`` context to start it from (default ``spawn``: safe whatever the parent has
    initialised, and pays the imports again; a ``forkserver`` context with torch preloaded does not
    pay them again).
    """
    ctx = mp_context if mp_context is not None else mp.get_context("spawn")
    unguarded = _unguarded_main_statement(ctx)
    if unguarded is not None:
        path, line = unguarded
        raise WeightSyncError(
            f"start_receiver_process was called from line {line} of {path}, which is not under "
            f"`if __name__ == \"__main__\":`. The receiver is a '{ctx.get_start_method()}' process: it "
            f"imports {os.path.basename(path)} again, which would run that line again and fail before the "
            f"receiver starts. Put the script's top-level work under `if __name__ == \"__main__\":` "
            f"(e.g. `def main(): ...` and `if __name__ == \"__main__\": main()`)"
        )
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_receiver_main,
        args=(model_factory, host, port, child_conn),
        daemon=True,
        name="weightsync-loopback-receiver",
    )
    proc.start()
    child_conn.close()
    deadline = time.monotonic() + start_timeout_s
    while not parent_conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.kill()
            proc.join(5)
            raise WeightSyncError(
                f"loopback receiver process did not start within {start_timeout_s:.0f}s "
                f"(exit code {proc.exitcode})"
            )
    try:
        status, value = parent_conn.recv()
    except EOFError:
        status, value = "error", f"the process exited (code {proc.exitcode}) before reporting"
    if status != "ok":
        proc.join(5)
        raise WeightSyncError(f"loopback receiver process failed to start: {value} (its own error, if any, is on "
                              "stderr above)")
    return ReceiverClient(value, timeout=client_timeout_s), ReceiverHandle(proc, value)
