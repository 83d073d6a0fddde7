"""A ``LoopbackReceiver`` behind vLLM's dev-mode HTTP routes (``ReceiverServer``); its client is
``client.ReceiverClient``, its process ``process.start_receiver_process``.

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
import json
import sys
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from weightsync.sources.toolkit import get_logger

from .receiver import LoopbackReceiver

__all__ = ["ReceiverServer"]

logger = get_logger(__name__)


class _Server(ThreadingHTTPServer):
    #: Room for bursts of concurrent clients (a trainer fans out to every engine at once); the
    #: stdlib's default listen backlog is 5.
    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request: object, client_address: tuple) -> None:
        """A client that hung up before its answer (a trainer stopped by Ctrl-C mid-call) needs no
        answer and is no server error: logged at debug, not printed as a traceback on stderr.
        Anything else is the stdlib's report."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            logger.debug("receiver: client %s hung up before its answer (%s)", client_address, exc)
            return
        super().handle_error(request, client_address)


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
