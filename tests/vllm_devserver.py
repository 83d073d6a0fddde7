"""A recording stand-in for vLLM's dev-mode RL routes (0.33 and 0.34 alike), for control-plane tests on CPU.

Routes, methods, query-vs-body and response shapes follow ``vllm/entrypoints/rl/online/api_router.py``
(``/pause`` takes ``mode`` and ``clear_cache`` as query parameters, the weight-transfer routes take
JSON bodies embedded under ``init_info`` / ``update_info`` / ``weight_version`` / ``new_version``,
``/is_paused`` / ``/weight_info`` / ``/get_world_size`` are GETs). A missing required body field is a
422 as with FastAPI. Every request is recorded with its query, body and ``Authorization`` header.

It also applies updates: ``update_info`` entries carrying ``safetensors_b64`` (from the test-only
``tests/json_engine.py`` trainer engine) are decoded into ``weights`` so a test can compare what
arrived with an oracle. Test-only knobs: ``fail`` (route -> HTTP status for the next N calls),
``delay`` (route -> seconds), ``api_key`` (401 without the right bearer token), set directly or by a
trainer rank via ``POST /_test/config``.

A version (``vllm_version=``) makes it answer ``GET /version`` as every vLLM server does (without one,
404: a server whose version is unknown). ``init_fields`` / ``update_fields`` make it parse like a vLLM
worker, which builds its init / update info as ``InfoClass(**payload)``: a key outside the set is
answered as vLLM answers a worker's ``TypeError`` (HTTP 500, "unexpected keyword argument") -- how
an older server meets a field a newer trainer added.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_VALID_MODES = ("abort", "wait", "keep")


class DevServer:
    def __init__(
        self,
        *,
        world_size: int = 1,
        api_key: str | None = None,
        vllm_version: str | None = None,
        init_fields: set[str] | None = None,
        update_fields: set[str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.api_key = api_key
        self.vllm_version = vllm_version
        self.init_fields = init_fields
        self.update_fields = update_fields
        self.calls: list[dict[str, Any]] = []
        self.weights: dict[str, Any] = {}
        #: weight_version -> the weights as they were when that version was committed.
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.weight_version: str | None = None
        self.paused = False
        self.fail: dict[str, list[int]] = {}
        self.delay: dict[str, float] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_POST(self) -> None:
                server._handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "DevServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def routes(self) -> list[str]:
        return [c["route"] for c in self.calls if not c["route"].startswith("_test")]

    # ---- dispatch -----------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        route = parts.path.lstrip("/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        n = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(h, 400, {"error": "bad json"})
        with self.lock:
            self.calls.append(
                {
                    "route": route,
                    "method": method,
                    "query": query,
                    "body": body,
                    "auth": h.headers.get("Authorization"),
                    "t": time.monotonic(),
                }
            )
            delay = self.delay.get(route, 0.0)
            plan = self.fail.get(route)
            status = plan.pop(0) if plan else None
        if delay:
            time.sleep(delay)
        if route.startswith("_test/"):
            return self._send(h, 200, self._test_route(route, body or {}))
        if self.api_key is not None and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self._send(h, 401, {"error": "Unauthorized"})
        if status is not None:
            return self._send(h, status, {"error": f"injected failure on {route}"})
        fn = getattr(self, f"_{method.lower()}_{route}", None)
        if fn is None:
            return self._send(h, 404 if not hasattr(self, f"_post_{route}") and not hasattr(self, f"_get_{route}") else 405, {"detail": "Not Found"})
        try:
            code, out = fn(query, body)
        except KeyError as e:
            code, out = 422, {"detail": f"missing field {e}"}
        self._send(h, code, out)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _test_route(self, route: str, body: dict) -> dict:
        if route == "_test/config":
            with self.lock:
                for r, codes in body.get("fail", {}).items():
                    self.fail[r] = list(codes)
                self.delay.update(body.get("delay", {}))
            return {"ok": True}
        if route == "_test/state":
            return {"weight_version": self.weight_version, "paused": self.paused, "routes": self.routes()}
        return {"error": "unknown"}

    # ---- vLLM routes --------------------------------------------------------------------------

    def _post_pause(self, q: dict, body: Any) -> tuple[int, Any]:
        mode = q.get("mode", "abort")
        if mode not in _VALID_MODES:
            return 422, {"detail": f"mode {mode!r}"}
        if q.get("clear_cache", "true") not in ("true", "false", "True", "False", "1", "0"):
            return 422, {"detail": "clear_cache"}
        self.paused = True
        return 200, {"status": "paused"}

    def _post_resume(self, q: dict, body: Any) -> tuple[int, Any]:
        self.paused = False
        return 200, {"status": "resumed"}

    def _get_is_paused(self, q: dict, body: Any) -> tuple[int, Any]:
        return 200, {"is_paused": self.paused}

    def _unexpected(self, what: str, info: Any, fields: set[str] | None) -> tuple[int, Any] | None:
        if fields is None:
            return None
        for entry in info if isinstance(info, list) else [info]:
            extra = sorted(set(entry) - fields)
            if extra:
                return 500, {"error": {"message": f"Invalid {what} for NCCLWeightTransferEngine: "
                                                   f"__init__() got an unexpected keyword argument {extra[0]!r}"}}
        return None

    def _get_version(self, q: dict, body: Any) -> tuple[int, Any]:
        if self.vllm_version is None:
            return 404, {"detail": "Not Found"}
        return 200, {"version": self.vllm_version}

    def _post_init_weight_transfer_engine(self, q: dict, body: Any) -> tuple[int, Any]:
        info = (body or {})["init_info"]
        return self._unexpected("init_info", info, self.init_fields) or (200, {"message": "Weight transfer initialized"})

    def _post_shutdown_weight_transfer_engine(self, q: dict, body: Any) -> tuple[int, Any]:
        return 200, {"message": "Weight transfer shut down"}

    def _post_start_weight_update(self, q: dict, body: Any) -> tuple[int, Any]:
        return 200, {"message": "Weight update started"}

    def _post_update_weights(self, q: dict, body: Any) -> tuple[int, Any]:
        info = (body or {})["update_info"]
        refused = self._unexpected("update_info", info, self.update_fields)
        if refused:
            return refused
        for entry in info if isinstance(info, list) else [info]:
            blob = entry.get("safetensors_b64")
            if blob:
                from safetensors.torch import load

                self.weights.update(load(base64.b64decode(blob)))
        return 200, {"message": "Weights updated"}

    def _post_finish_weight_update(self, q: dict, body: Any) -> tuple[int, Any]:
        version = (body or {}).get("weight_version")
        if version is not None:
            self.weight_version = version
            self.snapshots[version] = dict(self.weights)
        return 200, {"message": "Weight update finished"}

    def _post_update_weight_version(self, q: dict, body: Any) -> tuple[int, Any]:
        self.weight_version = (body or {})["new_version"]
        return 200, {"success": True, "new_version": self.weight_version}

    def _get_weight_info(self, q: dict, body: Any) -> tuple[int, Any]:
        return 200, {"weight_version": self.weight_version}

    def _get_get_world_size(self, q: dict, body: Any) -> tuple[int, Any]:
        return 200, {"world_size": self.world_size}


class RecordingEngineClient:
    """The slice of vLLM's ``EngineClient`` that the RL routes call, recording each call.

    ``fail`` maps a method name to an exception to raise; ``delay`` to seconds to sleep first.
    """

    def __init__(self, world_size: int = 1) -> None:
        import types

        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, BaseException] = {}
        self.delay: dict[str, float] = {}
        self.version: str | None = None
        self.paused = False
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size_across_dp=world_size, world_size=world_size)
        )

    async def _call(self, name: str, arg: Any = None) -> None:
        import asyncio

        self.calls.append((name, arg))
        if self.delay.get(name):
            await asyncio.sleep(self.delay[name])
        if name in self.fail:
            raise self.fail[name]

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._call("pause_generation", {"mode": mode, "clear_cache": clear_cache})
        self.paused = True

    async def resume_generation(self) -> None:
        await self._call("resume_generation")
        self.paused = False

    async def is_paused(self) -> bool:
        await self._call("is_paused")
        return self.paused

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._call("init_weight_transfer_engine", request.init_info)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._call("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self._call("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        await self._call("update_weights", request.update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._call("finish_weight_update", weight_version)
        if weight_version is not None:
            self.version = weight_version

    async def update_weight_version(self, new_version: str) -> None:
        await self._call("update_weight_version", new_version)
        self.version = new_version

    async def get_weight_version(self) -> str | None:
        await self._call("get_weight_version")
        return self.version


class VLLMRouterServer:
    """vLLM's own RL ``APIRouter`` (``vllm.entrypoints.rl.online.api_router``) and ``GET /version``, served by uvicorn
    on 127.0.0.1 in a thread, over a ``RecordingEngineClient``. Route parsing (query vs body, 422s,
    response shapes) is vLLM's, not ours."""

    def __init__(self, world_size: int = 1) -> None:
        import socket

        import uvicorn
        from fastapi import FastAPI
        from vllm.entrypoints.rl.online.api_router import router

        self.engine = RecordingEngineClient(world_size)
        from vllm.entrypoints.serve.instrumentator.basic import router as basic_router

        app = FastAPI()
        app.include_router(router)
        app.include_router(basic_router)  # GET /version (the installed vLLM's), as a real server has
        app.state.engine_client = self.engine
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "VLLMRouterServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def names(self) -> list[str]:
        return [n for n, _ in self.engine.calls]
