"""The vLLM HTTP control plane, fanned out to every server.

``VLLMHTTPClient`` extends vLLM's ``HTTPVLLMWeightSyncClient`` (the four weight-transfer calls an
engine drives) with the dev-mode routes a sync needs around them: ``/pause``, ``/resume``,
``/is_paused``, ``/weight_info``, ``/get_world_size``, ``/update_weight_version`` and ``GET /version``.
Routes, methods, query-vs-body and response shapes are ``vllm/entrypoints/rl/online/api_router.py``
(served only with ``VLLM_SERVER_DEV_MODE=1``), the same in vLLM 0.33 and 0.34; ``/version`` is served
by every vLLM server (``vllm/entrypoints/serve/instrumentator/basic.py``).

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
* **Each server gets a payload its vLLM version parses** (a 0.34 trainer beside 0.33 servers): the
  fields a server's vLLM predates are left out while at their default, refused otherwise
  (``ServerVersionError``), and ``check_compatible`` raises the same from the init info and metadata
  alone, before ``trainer_init`` (``versions``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import urlsplit

from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import broadcast_ranks, get_logger

from .versions import ADDED_FIELDS, ServerVersionError, needs, parse_vllm_version, payload_for, too_old

__all__ = [
    "ADDED_FIELDS",
    "VLLMHTTPClient",
    "ControlPlaneError",
    "InsecureTransportError",
    "PauseMode",
    "ServerVersionError",
    "is_loopback_url",
    "parse_vllm_version",
]

logger = get_logger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
#: init info backends whose ``world_size`` is trainer senders + inference workers (one transfer group).
_GROUP_BACKENDS = ("nccl", "sparse_nccl", "loopback", "loopback_sparse")
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
        self._versions: dict[str, str | None] | None = None
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
        """``POST /init_weight_transfer_engine`` on every server, each with the payload its vLLM
        version parses (see ``ADDED_FIELDS``) and, for NCCL with several servers, its own
        ``rank_offset``. Raises ``ServerVersionError`` before any request if a server cannot take it."""
        offsets = None
        if len(self.base_urls) > 1 and "rank_offset" in init_info:
            offsets = self._nccl_offsets(init_info)
        bodies = {}
        for u in self.base_urls:
            info = self._for_server(u, "init_info", dict(init_info))
            if offsets is not None:
                info["rank_offset"] = offsets[u]
            bodies[u] = {"init_info": info}
        self._fanout("POST", "init_weight_transfer_engine", json_for=lambda i, u: bodies[u], long=True)

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """``POST /update_weights`` on every server, each with the payload its vLLM version parses
        (see ``ADDED_FIELDS``); ``ServerVersionError`` before any request if a server cannot."""
        if _has_ipc_handles(update_info):
            self.check_backend("ipc")
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        safe = _json_safe_update_payload(update_info)
        bodies = {}
        for u in self.base_urls:
            if isinstance(safe, list):
                info: Any = [self._for_server(u, "update_info", dict(i)) if isinstance(i, dict) else i for i in safe]
            else:
                info = self._for_server(u, "update_info", dict(safe)) if isinstance(safe, dict) else safe
            bodies[u] = {"update_info": info}
        self._fanout("POST", "update_weights", json_for=lambda i, u: bodies[u], long=True)

    def start_draft_weight_update(self) -> None:
        """``POST /start_draft_weight_update`` on every server (vLLM 0.33+): the update rounds that
        follow, until ``finish_weight_update``, load into the speculative draft model. A server
        without a draft model, or whose weight-transfer engine cannot retarget (vLLM's
        ``sparse_nccl``, ``nccl_m2n``, ``sharded_rdt``: ``supports_draft_weight_update = False``),
        answers an error, raised here naming it."""
        self._fanout("POST", "start_draft_weight_update", long=True)

    # ---- versions -----------------------------------------------------------------------------

    def server_versions(self, *, refresh: bool = False) -> dict[str, str | None]:
        """``GET /version`` on every server, once per client (``refresh`` asks again):
        ``{base_url: vLLM version}``; ``None`` for a server that has no ``/version`` route (404)."""
        if self._versions is None or refresh:
            timeout = self.control_timeout

            def one(url: str) -> str | None:
                try:
                    r = self._request_one(url, "GET", "version", params=None, json=None, timeout=timeout)
                except _Failure as e:
                    if str(e).startswith("HTTP 404"):
                        return None
                    raise
                return str(r["version"]) if isinstance(r, dict) and "version" in r else None

            found: dict[str, str | None] = {}
            failures: dict[str, str] = {}
            with ThreadPoolExecutor(max_workers=len(self.base_urls)) as pool:
                futs = {u: pool.submit(one, u) for u in self.base_urls}
                for u, f in futs.items():
                    try:
                        found[u] = f.result()
                    except _Failure as e:
                        failures[u] = str(e)
            if failures:
                lines = "; ".join(f"{u}: GET /version {why}" for u, why in failures.items())
                raise ControlPlaneError(
                    f"{len(failures)} of {len(self.base_urls)} vLLM server(s) failed GET /version: {lines}",
                    failures,
                )
            for u, v in found.items():
                if v is None:
                    logger.warning(
                        "%s has no GET /version: its vLLM version is unknown; fields newer vLLMs added "
                        "are left out while they hold their defaults, anything else is sent as is", u
                    )
            self._versions = found
        return dict(self._versions)

    def check_compatible(self, init_info: Any, metadata: Sequence[Any] | None = None) -> None:
        """Raise ``ServerVersionError`` if a server's vLLM is too old for what ``init_info`` (a vLLM
        ``TrainerInitInfo``) and the source's ``metadata`` ask of it: ``use_load_plan=True`` (init
        field ``use_load_plan``), or, with vLLM's NCCL backend, a parameter whose first owner is not
        rank 0 (update field ``src``). Asks each server's ``GET /version`` (once per client) and
        ``GET /get_world_size``; nothing else. ``WeightSync`` calls it on the sender before
        ``trainer_init`` (its outcome agreed: every rank raises).

        Also raises ``ValueError`` naming ``world_size`` when ``init_info`` is for a transfer group
        (vLLM's ``nccl`` / ``sparse_nccl``, weightsync's ``loopback`` / ``loopback_sparse``) whose
        ``world_size`` is not the trainer's senders plus every server's workers (``GET
        /get_world_size``): a wrong size otherwise waits out the group's rendezvous timeout (30-300 s)
        and then names a store key. A server that does not answer ``/get_world_size`` is not checked
        here (the sync's own calls name it)."""
        wanted = needs(init_info, metadata)  # (payload, field, value)
        if wanted:
            versions = self.server_versions()
            problems = []
            for u in self.base_urls:
                for payload, field_, value in wanted:
                    problem = too_old(u, versions.get(u), payload, field_, value)
                    if problem:
                        problems.append(problem)
            if problems:
                raise ServerVersionError("; ".join(problems))
        self._check_world_size(init_info, metadata)

    def _check_world_size(self, init_info: Any, metadata: Sequence[Any] | None) -> None:
        backend = getattr(init_info, "backend", None)
        world = getattr(init_info, "world_size", None)
        if backend not in _GROUP_BACKENDS or not isinstance(world, int):
            return
        senders = 1
        if backend == "nccl" and metadata:  # vLLM 0.34's many senders: rank 0 and every first owner
            senders = len(broadcast_ranks(metadata))
        try:
            workers = self.get_world_size(include_dp=True)
        except (ControlPlaneError, ValueError, TypeError) as e:
            logger.debug("world_size not checked before init: %s", e)
            return
        need = senders + sum(workers.values())
        if world != need:
            where = ", ".join(f"{u}: {n}" for u, n in workers.items())
            raise ValueError(
                f"{type(init_info).__name__}.world_size={world}, but the {backend} transfer group has "
                f"{need} members: {senders} trainer sender(s) + the servers' inference workers ({where}; "
                f"GET /get_world_size, with DP). Pass world_size={need} "
                f"(VLLMHTTPClient.nccl_world_size({senders}) asks the servers)"
            )

    def _for_server(self, url: str, payload: str, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` as the server at ``url`` parses it (``versions.payload_for``); asks its version
        only when ``info`` carries a field a newer vLLM added."""
        if not any(f in info for f in ADDED_FIELDS[payload]):
            return info
        return payload_for(url, self.server_versions().get(url), payload, info)

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

    def nccl_world_size(self, senders: int = 1) -> int:
        """The NCCL group size: the trainer's ``senders`` (1, or with vLLM 0.34's many senders
        ``len(weightsync.sources.broadcast_ranks(source.metadata))``) + every server's workers (with DP)."""
        if isinstance(senders, bool) or not isinstance(senders, int) or senders < 1:
            raise ValueError(f"nccl_world_size(senders={senders!r}): a positive int (trainer ranks that broadcast)")
        return senders + sum(self.get_world_size(include_dp=True).values())

    # ---- LoRA adapters (vLLM's runtime LoRA routes: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) ----

    def server_info(self) -> dict[str, Any]:
        """``GET /server_info?config_format=json`` (dev mode): ``{base_url: {"vllm_config": ..., ...}}``
        (each server's whole ``VllmConfig`` as JSON; ``LoRAAdapterSync`` reads its ``lora_config``)."""
        return self._fanout("GET", "server_info", params={"config_format": "json"})

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, load_inplace: bool = False) -> None:
        """``POST /v1/load_lora_adapter`` on every server. vLLM loads and validates the adapter before
        it replaces one of the same name (``load_inplace``), so a refused load (HTTP 4xx/5xx, vLLM's
        reason in the error) leaves the previous adapter serving."""
        body = {"lora_name": str(lora_name), "lora_path": str(lora_path), "load_inplace": bool(load_inplace)}
        self._fanout("POST", "v1/load_lora_adapter", json=body, long=True)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """``POST /v1/unload_lora_adapter`` on every server."""
        self._fanout("POST", "v1/unload_lora_adapter", json={"lora_name": str(lora_name)})

    def lora_adapters(self) -> dict[str, dict[str, str]]:
        """``GET /v1/models``: ``{base_url: {adapter name: path it was loaded from}}`` (cards with a parent)."""
        out: dict[str, dict[str, str]] = {}
        for u, r in self._fanout("GET", "v1/models").items():
            cards = _field(r, "data", u)
            out[u] = {c["id"]: c.get("root") for c in cards if isinstance(c, dict) and c.get("parent")}
        return out

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
