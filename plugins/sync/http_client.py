"""The vLLM HTTP control plane, fanned out to every server.

``VLLMHTTPClient`` extends vLLM's ``HTTPVLLMWeightSyncClient`` (the four weight-transfer calls an
engine drives) with the dev-mode routes a sync needs around them: ``/pause``, ``/resume``,
``/is_paused``, ``/weight_info``, ``/get_world_size`` and ``/update_weight_version``. Routes, methods,
query-vs-body and response shapes are vLLM 0.33's ``vllm/entrypoints/rl/online/api_router.py``
(served only with ``VLLM_SERVER_DEV_MODE=1``).

Invariants, and why:

* **Every call reaches every server, and fails if any fails.** Behind an external load balancer each
  vLLM instance holds its own weights and its own scheduler: a pause that reached one instance, or an
  update that reached two of three, silently serves mixed policies. Calls run concurrently (one thread
  per server) and every server's outcome is collected before raising, so the error lists each failed
  server with its route and status.
* **Bounded.** Every request has a timeout; short control routes and the long transfer routes
  (which block for a whole broadcast or a ``pause(mode="wait")`` drain) have separate bounds. A timeout
  names the server, the route and the bound.
* **No pickles to another host by accident.** vLLM's HTTP client ships CUDA IPC handles pickled
  (``ipc_handles_pickled``), which the server unpickles: code execution for anyone who can reach it,
  and meaningless off-host anyway (CUDA IPC is same-node). The client refuses to send ``ipc_handles``
  to any host outside loopback unless ``allow_insecure_ipc=True``; ``check_backend("ipc")`` lets the
  driver raise the same refusal on every rank before any bytes move.
* **NCCL rank offsets per server.** vLLM's NCCL init payload places the workers at ``rank_offset=1``;
  sent unchanged to several instances, all of them would claim the same NCCL ranks and the rendezvous
  would hang. With several servers the client gives each one the offset after its predecessors'
  workers (from ``/get_world_size``) and checks the payload's ``world_size`` covers them all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import urlsplit

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from weightsync.sources import WeightSyncError, get_logger

__all__ = [
    "VLLMHTTPClient",
    "ControlPlaneError",
    "InsecureTransportError",
    "PauseMode",
    "is_loopback_url",
]

logger = get_logger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
_PAUSE_MODES = ("abort", "wait", "keep")


class ControlPlaneError(WeightSyncError):
    """One or more vLLM servers failed a control-plane call (status, timeout, connection)."""

    def __init__(self, message: str, failures: dict[str, str]) -> None:
        super().__init__(message)
        #: ``{base_url: reason}`` for every server that failed.
        self.failures = failures


class InsecureTransportError(WeightSyncError, ValueError):
    """Pickled CUDA IPC handles would be sent to a non-loopback host without an explicit opt-in."""


def is_loopback_url(url: str) -> bool:
    """True iff ``url``'s host is ``localhost`` or an address in 127.0.0.0/8 or ``::1``.

    Decided from the URL alone (no DNS): a name other than ``localhost`` counts as remote.
    """
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _has_ipc_handles(update_info: WeightTransferUpdatePayload) -> bool:
    infos = update_info if isinstance(update_info, list) else [update_info]
    return any(
        isinstance(i, dict) and (i.get("ipc_handles") is not None or i.get("ipc_handles_pickled"))
        for i in infos
    )


class VLLMHTTPClient(HTTPVLLMWeightSyncClient):
    """A ``VLLMWeightSyncClient`` for one or several vLLM servers, plus the dev-mode routes.

    Args:
        base_urls: one URL or a list (every instance behind a load balancer, not the balancer).
        api_key: sent as ``Authorization: Bearer <api_key>`` on every request (servers started with
            ``--api-key``, or an authenticating proxy in front of them).
        timeout: seconds for the quick routes (resume, is_paused, weight_info, get_world_size,
            update_weight_version); also the connect timeout of every request.
        transfer_timeout: seconds for routes that block on the data plane or a drain: init, start,
            update, finish, shutdown of the weight transfer engine, and pause.
        allow_insecure_ipc: send pickled IPC handles to non-loopback hosts anyway.
        session: a ``requests.Session`` to use (retries, proxies, TLS); default one per client.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        transfer_timeout: float = 900.0,
        allow_insecure_ipc: bool = False,
        session: Any = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("VLLMHTTPClient: base_urls is empty; give at least one server URL")
        for u in urls:
            parts = urlsplit(u)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"VLLMHTTPClient: base_urls entry {u!r} is not an http(s)://host[:port] URL"
                )
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"VLLMHTTPClient: base_urls has duplicates: {urls}")
        for name, value in (("timeout", timeout), ("transfer_timeout", transfer_timeout)):
            if not value or value <= 0:
                raise ValueError(f"VLLMHTTPClient: {name} must be a positive number of seconds, got {value!r}")
        super().__init__(urls[0], timeout=transfer_timeout)
        self.base_urls: list[str] = urls
        self.control_timeout = float(timeout)
        self.transfer_timeout = float(transfer_timeout)
        self.allow_insecure_ipc = allow_insecure_ipc
        # One connection per call: a sync makes a handful of calls, and a pooled keep-alive
        # connection that the server dropped after an error (uvicorn closes on a 500) would turn the
        # resume that must follow a failed send into a spurious "connection reset".
        self._headers = {"Connection": "close"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._has_key = bool(api_key)
        if session is None:
            import requests

            session = requests.Session()
        self._session = session

    def __repr__(self) -> str:  # never print the key
        auth = ", api_key=***" if self._has_key else ""
        return f"VLLMHTTPClient({self.base_urls!r}{auth})"

    # ---- transport ----------------------------------------------------------------------------

    def _request_one(
        self,
        url: str,
        method: str,
        route: str,
        *,
        params: dict[str, Any] | None,
        json: Any,
        timeout: float,
    ) -> Any:
        import requests

        try:
            r = self._session.request(
                method,
                f"{url}/{route}",
                params=params,
                json=json,
                headers=self._headers,
                timeout=(min(self.control_timeout, timeout), timeout),
            )
        except requests.Timeout as e:
            raise _Failure(f"timed out after {timeout:g}s ({type(e).__name__})") from e
        except requests.RequestException as e:
            raise _Failure(f"request failed: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            body = (r.text or "").strip().replace("\n", " ")
            hint = ""
            if r.status_code == 404:
                hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)"
            elif r.status_code == 401:
                hint = " (wrong or missing api_key)"
            raise _Failure(f"HTTP {r.status_code}{hint}: {body[:300]}")
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    def _fanout(
        self,
        method: str,
        route: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        json_for: Callable[[int, str], Any] | None = None,
        long: bool = False,
    ) -> dict[str, Any]:
        """Run one call on every server concurrently; ``{url: response json}`` or raise listing
        every server that failed. ``json_for(i, url)`` gives a per-server body."""
        timeout = self.transfer_timeout if long else self.control_timeout

        def one(i: int, url: str) -> Any:
            body = json_for(i, url) if json_for is not None else json
            return self._request_one(url, method, route, params=params, json=body, timeout=timeout)

        results: list[tuple[str, Any, BaseException | None]] = []
        with ThreadPoolExecutor(max_workers=len(self.base_urls)) as pool:
            futs = [pool.submit(one, i, u) for i, u in enumerate(self.base_urls)]
            for u, f in zip(self.base_urls, futs):
                try:
                    results.append((u, f.result(), None))
                except _Failure as e:
                    results.append((u, None, e))
        failures = {u: str(e) for u, _, e in results if e is not None}
        if failures:
            ok = [u for u, _, e in results if e is None]
            lines = "; ".join(f"{u}: {method} /{route} {why}" for u, why in failures.items())
            raise ControlPlaneError(
                f"{len(failures)} of {len(self.base_urls)} vLLM server(s) failed {method} /{route}: "
                f"{lines}" + (f" (succeeded on: {', '.join(ok)})" if ok else ""),
                failures,
            )
        return {u: r for u, r, _ in results}

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        # vLLM's base class routes its calls through here; keep them bounded and fanned out.
        self._fanout("POST", path, json=json, long=True)

    # ---- the four VLLMWeightSyncClient calls (+ shutdown) -------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if len(self.base_urls) > 1 and "rank_offset" in init_info:
            offsets = self._nccl_offsets(init_info)
            self._fanout(
                "POST",
                "init_weight_transfer_engine",
                json_for=lambda i, u: {"init_info": {**init_info, "rank_offset": offsets[u]}},
                long=True,
            )
            return
        super().init_weight_transfer_engine(init_info)

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        if _has_ipc_handles(update_info):
            self.check_backend("ipc")
        super().update_weights(update_info)

    # ---- dev-mode routes ----------------------------------------------------------------------

    def pause(self, mode: PauseMode = "abort", *, clear_cache: bool = True) -> None:
        """``POST /pause?mode=...&clear_cache=...`` on every server (``clear_cache`` is ignored by
        vLLM for ``keep``)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause: mode must be one of {_PAUSE_MODES}, got {mode!r}")
        params = {"mode": mode, "clear_cache": "true" if clear_cache else "false"}
        self._fanout("POST", "pause", params=params, long=True)

    def resume(self) -> None:
        """``POST /resume`` on every server."""
        self._fanout("POST", "resume")

    def is_paused(self) -> dict[str, bool]:
        """``GET /is_paused``: ``{base_url: paused}``."""
        return {u: bool(_field(r, "is_paused", u)) for u, r in self._fanout("GET", "is_paused").items()}

    def weight_info(self) -> dict[str, str | None]:
        """``GET /weight_info``: ``{base_url: committed weight_version}``."""
        return {u: _field(r, "weight_version", u) for u, r in self._fanout("GET", "weight_info").items()}

    def get_world_size(self, include_dp: bool = True) -> dict[str, int]:
        """``GET /get_world_size?include_dp=...``: ``{base_url: world_size}`` (TP*PP[*DP])."""
        params = {"include_dp": "true" if include_dp else "false"}
        return {
            u: int(_field(r, "world_size", u))
            for u, r in self._fanout("GET", "get_world_size", params=params).items()
        }

    def update_weight_version(self, new_version: str) -> None:
        """``POST /update_weight_version`` with body ``{"new_version": ...}`` on every server."""
        self._fanout("POST", "update_weight_version", json={"new_version": str(new_version)})

    def nccl_world_size(self) -> int:
        """The NCCL group size for a single trainer sender: 1 + every server's workers (with DP)."""
        return 1 + sum(self.get_world_size(include_dp=True).values())

    # ---- safety -------------------------------------------------------------------------------

    def check_backend(self, backend: str) -> None:
        """Raise ``InsecureTransportError`` if ``backend`` would ship pickled IPC handles to a host
        outside loopback without ``allow_insecure_ipc=True``. Pure; safe on every rank."""
        if backend != "ipc" or self.allow_insecure_ipc:
            return
        remote = [u for u in self.base_urls if not is_loopback_url(u)]
        if remote:
            raise InsecureTransportError(
                f"refusing to send pickled CUDA IPC handles to non-loopback server(s) {remote}: the "
                "server unpickles them (code execution for anyone on that path) and CUDA IPC only "
                "works on the same node anyway. Use a 127.0.0.1/localhost URL for a colocated "
                "server, or pass allow_insecure_ipc=True to VLLMHTTPClient if you really mean it."
            )

    def _nccl_offsets(self, init_info: dict[str, Any]) -> dict[str, int]:
        sizes = self.get_world_size(include_dp=True)
        base = int(init_info["rank_offset"])
        need = base + sum(sizes.values())
        if int(init_info.get("world_size", -1)) != need:
            raise ValueError(
                f"NCCL init_info world_size={init_info.get('world_size')} but the {len(sizes)} "
                f"servers have {sizes} workers (with DP) after {base} trainer rank(s): world_size "
                f"must be {need} (see VLLMHTTPClient.nccl_world_size())"
            )
        offsets, acc = {}, base
        for u in self.base_urls:
            offsets[u] = acc
            acc += sizes[u]
        return offsets


class _Failure(Exception):
    """One server's failure, collected by ``_fanout``."""


def _field(response: Any, key: str, url: str) -> Any:
    if not isinstance(response, dict) or key not in response:
        raise ControlPlaneError(
            f"{url}: expected a JSON object with {key!r}, got {response!r}", {url: "bad response"}
        )
    return response[key]
