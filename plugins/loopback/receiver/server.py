"""Reaching a ``LoopbackReceiver``: vLLM's dev-mode HTTP routes, a client, and a process launcher.

``ReceiverServer`` serves the routes a vLLM server exposes with ``VLLM_SERVER_DEV_MODE=1``, with the
same request bodies and JSON answers, so vLLM's own ``HTTPVLLMWeightSyncClient`` drives it unchanged::

    POST /init_weight_transfer_engine {"init_info": {...}}   POST /start_weight_update
    POST /start_draft_weight_update (vLLM 0.33+; 500 naming the receiver when it holds no draft)
    POST /update_weights {"update_info": {...}}              POST /finish_weight_update {"weight_version"?}
    POST /pause?mode=abort|wait|keep&clear_cache=            POST /resume
    GET  /is_paused   GET /get_world_size   GET /weight_info  POST /update_weight_version {"new_version"}
    POST /shutdown_weight_transfer_engine   POST /weight_checker {"action": "checksum"|"reset"|"compare"}

plus test routes under ``/_``: ``GET /_calls`` (every request in order: method, path, query, body,
status; ``?clear=1`` empties it), ``GET /_state``, ``GET /_checksums``, ``POST /_logits {"input_ids"}``,
``POST /_full_checksums {"names"?, "draft"?}`` (the receiver's tensors as held now, for delta
rounds; ``draft``: the draft model's),
``POST /_shutdown``. Errors answer ``{"error": "..."}`` with 400 for bad input and 500 otherwise.

Invariant: every request runs on its own thread (``ThreadingHTTPServer``), so ``update_weights`` --
which blocks in the transport while the trainer broadcasts -- never blocks the other routes. An
answer to a request that asked for ``Connection: close`` says ``Connection: close`` too: a pooling
HTTP/1.1 client (requests, which vLLM's client and ours use) would otherwise reuse a socket this
server is closing, and lose its next call to a race (``RemoteDisconnected``) whenever the machine
is busy. ``tests/test_receiver_http.py`` hammers every route to prove it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import multiprocessing as mp
import os
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import get_logger

from .receiver import LoopbackReceiver

__all__ = ["ReceiverServer", "ReceiverClient", "ReceiverHandle", "start_receiver_process"]

logger = get_logger(__name__)


class _Server(ThreadingHTTPServer):
    #: Room for bursts of concurrent clients (a trainer fans out to every engine at once); the
    #: stdlib's default listen backlog is 5.
    request_queue_size = 128
    daemon_threads = True


class ReceiverServer:
    """Serves one ``LoopbackReceiver`` over HTTP on ``host:port`` (port 0: a free one)."""

    def __init__(self, receiver: LoopbackReceiver, host: str = "127.0.0.1", port: int = 0) -> None:
        self.receiver = receiver
        self.calls: list[dict[str, Any]] = []
        self._calls_lock = threading.Lock()
        self.httpd = _Server((host, port), _make_handler(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ReceiverServer":
        """Serve on a background thread (in-process use)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def record(self, entry: dict[str, Any]) -> None:
        with self._calls_lock:
            self.calls.append(entry)

    # -- routes -------------------------------------------------------------------------------

    def dispatch(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        r = self.receiver
        body = body if isinstance(body, dict) else {}
        if method == "POST" and path == "/init_weight_transfer_engine":
            if "init_info" not in body:
                raise ValueError("body must be {'init_info': {...}}")
            r.init_weight_transfer_engine(body["init_info"])
            return 200, {"message": "Weight transfer initialized"}
        if method == "POST" and path == "/start_weight_update":
            r.start_weight_update()
            return 200, {"message": "Weight update started"}
        if method == "POST" and path == "/start_draft_weight_update":
            r.start_draft_weight_update()
            return 200, {"message": "Draft weight update started"}
        if method == "POST" and path == "/update_weights":
            if "update_info" not in body:
                raise ValueError("body must be {'update_info': {...}}")
            r.update_weights(body["update_info"])
            return 200, {"message": "Weights updated"}
        if method == "POST" and path == "/finish_weight_update":
            r.finish_weight_update(body.get("weight_version"))
            return 200, {"message": "Weight update finished"}
        if method == "POST" and path == "/shutdown_weight_transfer_engine":
            r.shutdown()
            return 200, {"message": "Weight transfer shut down"}
        if method == "POST" and path == "/pause":
            clear = query.get("clear_cache", "true").lower() not in ("false", "0", "no")
            r.pause(query.get("mode", "abort"), clear)
            return 200, {"status": "paused"}
        if method == "POST" and path == "/resume":
            r.resume()
            return 200, {"status": "resumed"}
        if method == "GET" and path == "/is_paused":
            return 200, {"is_paused": r.paused}
        if method == "GET" and path == "/get_world_size":
            return 200, {"world_size": 1}
        if method == "GET" and path == "/weight_info":
            return 200, {"weight_version": r.weight_version}
        if method == "POST" and path == "/update_weight_version":
            if "new_version" not in body:
                raise ValueError("body must be {'new_version': '...'}")
            r.weight_version = str(body["new_version"])
            return 200, {"success": True, "new_version": r.weight_version}
        if method == "POST" and path == "/weight_checker":
            return 200, _weight_checker(r.model, body)
        if method == "GET" and path == "/_calls":
            with self._calls_lock:
                calls = list(self.calls)
                if query.get("clear") in ("1", "true"):
                    self.calls.clear()
            return 200, {"calls": calls}
        if method == "GET" and path == "/_state":
            return 200, r.state()
        if method == "GET" and path == "/_checksums":
            return 200, {"checksums": r.weight_checksums()}
        if method == "POST" and path == "/_full_checksums":
            return 200, {"checksums": r.full_checksums(body.get("names"), draft=bool(body.get("draft")))}
        if method == "POST" and path == "/_logits":
            logits = r.logits(body["input_ids"])
            return 200, {
                "shape": list(logits.shape),
                "sha256": hashlib.sha256(logits.contiguous().numpy().tobytes()).hexdigest(),
                "logits": logits.reshape(-1).tolist(),
            }
        if method == "POST" and path == "/_shutdown":
            return 200, {"message": "shutting down"}  # the handler shuts down once it has answered
        return 404, {"error": f"no route {method} {path}"}


def _weight_checker(model: torch.nn.Module, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's dev-mode ``/weight_checker``, computed by vLLM's own ``weight_checksum`` helpers over
    the receiver model (one worker: key prefix ``dp0:pp0:pcp0:tp0:``)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests, zero_weights

    action = body.get("action")
    if action not in ("checksum", "reset", "compare"):
        raise ValueError(f"action must be 'checksum', 'reset' or 'compare', got {action!r}")
    if action == "reset":
        zero_weights(model)
        return {"status": "reset"}
    checksums = {f"dp0:pp0:pcp0:tp0:{k}": v for k, v in compute_tensor_digests(model).items()}
    if action == "checksum":
        return {"checksums": checksums}
    baseline = body.get("baseline")
    if not isinstance(baseline, dict):
        raise ValueError("action='compare' requires a 'baseline' object")
    mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


def _make_handler(server: ReceiverServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging
            logger.debug("http: " + fmt, *args)

        def _handle(self, method: str) -> None:
            parsed = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parsed.query))
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            entry: dict[str, Any] = {
                "method": method,
                "path": parsed.path,
                "query": query,
                "body": None,
                "t": time.time(),
            }
            try:
                body = json.loads(raw) if raw else None
                entry["body"] = body
                status, answer = server.dispatch(method, parsed.path, query, body)
            except (ValueError, KeyError) as e:
                status, answer = 400, {"error": f"{type(e).__name__}: {e}"}
            except Exception as e:  # noqa: BLE001 - answered, logged
                logger.warning("receiver %s %s failed: %s", method, parsed.path, e)
                logger.debug("%s", traceback.format_exc())
                status, answer = 500, {"error": f"{type(e).__name__}: {e}"}
            entry["status"] = status
            if not parsed.path.startswith("/_"):
                server.record(entry)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                # The client asked for "Connection: close" (vLLM's clients and ours do): say so in the
                # answer. Without it an HTTP/1.1 client (requests/urllib3) takes the connection as
                # reusable and sends its next call on a socket this server is closing -- under load
                # that call dies as "RemoteDisconnected" (the drop seen in CI).
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            if method == "POST" and parsed.path == "/_shutdown" and status == 200:
                # Only now: serve_forever returns and the process may exit, so an earlier shutdown
                # could kill this answer mid-write (the caller saw "RemoteDisconnected").
                self.wfile.flush()
                threading.Thread(target=server.httpd.shutdown, daemon=True).start()

        def do_GET(self) -> None:  # noqa: N802
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

    return Handler


class ReceiverClient:
    """``VLLMWeightSyncClient`` for a ``ReceiverServer`` (or a vLLM dev-mode server), stdlib only.

    Unlike vLLM's ``HTTPVLLMWeightSyncClient`` it raises ``WeightSyncError`` carrying the server's
    error message, so a rejected update says why on the trainer.
    """

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}/{path.lstrip('/')}",
            data=data if method == "POST" else None,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read()).get("error", "")
            except Exception:  # noqa: BLE001
                msg = ""
            raise WeightSyncError(f"receiver {method} /{path.lstrip('/')} -> {e.code}: {msg}") from None
        except urllib.error.URLError as e:
            raise WeightSyncError(f"receiver at {self.base_url} unreachable: {e.reason}") from None
        except (http.client.HTTPException, OSError) as e:  # dropped mid-call, timed out, reset
            raise WeightSyncError(
                f"receiver {method} /{path.lstrip('/')} at {self.base_url} failed: {type(e).__name__}: {e}"
            ) from e

    # the VLLMWeightSyncClient protocol
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "start_weight_update")

    def start_draft_weight_update(self) -> None:
        """The rounds until ``finish_weight_update`` load into the receiver's draft model."""
        self._call("POST", "start_draft_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("POST", "update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "finish_weight_update", body)

    # the rest of the dev-mode surface, and the test routes
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        q = urllib.parse.urlencode({"mode": mode, "clear_cache": str(clear_cache).lower()})
        self._call("POST", f"pause?{q}")

    def resume(self) -> None:
        self._call("POST", "resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "is_paused")["is_paused"])

    def weight_version(self) -> str | None:
        return self._call("GET", "weight_info")["weight_version"]

    def world_size(self) -> int:
        return int(self._call("GET", "get_world_size")["world_size"])

    def state(self) -> dict[str, Any]:
        return self._call("GET", "_state")

    def weight_digests(self) -> dict[str, str]:
        """SHA-256 per parameter of the receiver model (vLLM's ``/weight_checker``), key prefix cut."""
        out = self._call("POST", "weight_checker", {"action": "checksum"})["checksums"]
        return {k.split(":", 4)[-1]: v for k, v in out.items()}

    def weight_checksums(self) -> dict[str, str]:
        """What the receiver got in the last round (``integrity.ReportsChecksums``)."""
        return self._call("GET", "_checksums")["checksums"]

    def full_checksums(self, names: list[str] | None = None, *, draft: bool = False) -> dict[str, str]:
        """``integrity.checksum`` of the receiver's tensors as held now (``names``, or all; ``draft``:
        the draft model's): what the sparse loopback engine compares with a dense pass of the
        trainer's source."""
        return self._call("POST", "_full_checksums", {"names": names, "draft": draft})["checksums"]

    def calls(self, clear: bool = False) -> list[dict[str, Any]]:
        return self._call("GET", "_calls?clear=1" if clear else "_calls")["calls"]

    def logits(self, input_ids: list[list[int]]) -> tuple[torch.Tensor, str]:
        """The receiver model's logits for ``input_ids`` and the SHA-256 of their fp32 bytes."""
        out = self._call("POST", "_logits", {"input_ids": input_ids})
        return torch.tensor(out["logits"], dtype=torch.float32).reshape(out["shape"]), out["sha256"]

    def shutdown_server(self) -> None:
        self._call("POST", "_shutdown")


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
    initialised, and pays the imports again; a ``forkserver`` context with torch preloaded starts
    it in milliseconds).
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
