"""``LoRAAdapterSync``: send only a sharded PEFT model's LoRA adapter into vLLM's LoRA serving.

Per ``sync(step)``, on every trainer rank, in this order:

1. (first sync) rank 0 reads every server's LoRA limits (``GET /server_info``: ``lora_config``'s
   ``max_lora_rank``, ``max_loras``, ``max_cpu_loras``, ``lora_dtype``; the served model's folder)
   and, where that folder is readable here, which adapter targets the served checkpoint lacks;
   every rank receives them (on the store);
2. every rank checks the adapter against them (``check_adapter``) -- an adapter rank above
   ``--max-lora-rank``, a target the served model lacks (or its output embedding, which vLLM does
   not serve LoRA on), ``keep`` above ``max_loras``, and vLLM's own ``PEFTHelper.validate_legal``
   -- and the outcomes are agreed: a failure raises on every rank, naming it, before the server sees
   anything. (DoRA, ``lora_bias``, ``modules_to_save``, a merged or disabled adapter, a dtype no
   adapter file carries: refused when ``LoRAAdapterSource`` is built, on every rank.)
3. every rank gathers the adapter tensors (``LoRAAdapterSource``: only A/B move, one all-gather per
   FSDP unit);
4. rank 0 writes ``adapter_model.safetensors`` + ``adapter_config.json`` into a fresh folder
   ``<adapter_dir>/<lora_name>/<version>-<id>``: both files written into a hidden temporary folder
   beside it, each fsynced, the folder fsynced, then renamed into place (one atomic rename) and the
   parent fsynced -- a half-written adapter is never visible under a name the server could read;
5. rank 0 pauses generation (``pause``), asks every server to load the folder
   (``/v1/load_lora_adapter``; in place for ``mode="inplace"``), commits ``weight_version``, and
   resumes -- also when the load failed; then removes the folders no served name points at any more
   (``inplace``: the previous version's; ``versioned``: the versions beyond ``keep``, unloaded first);
6. the outcome is agreed: a failure (the server's refusal, with its reason) raises on every rank.

Invariants, and why:

* **A fresh path per version.** vLLM keys its prefix cache by the adapter's name *and path*
  (``kv_cache_utils._gen_lora_extra_hash_keys``) and does not invalidate it on an in-place reload;
  reloading new weights from the same path under a ``keep`` pause served the previous version's
  cached attention state. Every sync therefore writes a new folder, so no stale prefix is served.
* **A failed load leaves the previous version serving.** vLLM loads and validates a new adapter
  before it replaces the old one (``LRUCacheWorkerLoRAManager.add_adapter``) and registers the name
  only on success; weightsync keeps the previous folder on disk until a newer one has loaded (vLLM
  re-reads an adapter from its path when its CPU cache evicted it) and commits no ``weight_version``.
* **Versioned names** (``mode="versioned"``): each sync serves ``<lora_name>-<version>`` beside the
  older ones (asynchronous RL: requests name the version they sample from); at most ``keep``
  (default and bound: the servers' ``max_loras``) stay loaded, the oldest unloaded and removed.
* **Only rank 0 talks to vLLM or writes files; every rank runs the gathers and raises the same.**
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources import LoRAAdapterSource, WeightSyncError
from weightsync.sources.toolkit import DEFAULT_TIMEOUT_S, Board, get_logger, multi_rank, next_tag

from .checks import check_adapter, server_limits
from .files import write_adapter
from .report import AdapterSyncReport

__all__ = ["LoRAAdapterSync", "AdapterSyncReport", "AdapterRefusedError", "MODES", "check_adapter",
           "server_limits", "write_adapter"]

logger = get_logger(__name__)

MODES = ("inplace", "versioned")
PAUSE_MODES = ("keep", "wait", "abort")


class AdapterRefusedError(WeightSyncError):
    """A vLLM server refused the adapter (its reason in the message); the previous version serves."""


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64] or "v"


# ---- the driver ---------------------------------------------------------------------------------


class LoRAAdapterSync:
    """Adapter-only syncs of a (sharded) PEFT model into vLLM; build it on every rank alike.

    Args:
        model: the ``PeftModel`` (plain / FSDP2 / HSDP / FSDP+TP), or a ready ``LoRAAdapterSource``.
        client: the control plane (``VLLMHTTPClient``: ``pause`` / ``resume``, ``load_lora_adapter``,
            ``unload_lora_adapter``, ``update_weight_version``, ``server_info``).
        lora_name: the name requests use (``mode="inplace"``), or its prefix (``"versioned"``:
            ``<lora_name>-<version>``).
        adapter_dir: a folder the servers can read; versions go under ``<adapter_dir>/<lora_name>/``.
        server_dir: where the servers see ``adapter_dir`` when it is mounted elsewhere (default: same).
        mode: ``"inplace"`` (one name reloaded in place) or ``"versioned"`` (several versions loaded).
        every: sync every ``every`` training steps (``maybe_sync`` / the hooks); ``sync`` syncs on demand.
        keep: ``versioned`` only: versions kept loaded (default: the servers' ``max_loras``; at most that).
        pause: ``"keep"`` | ``"wait"`` | ``"abort"`` | None, around the load, as ``WeightSync``.
        clear_cache: vLLM's ``clear_cache`` for ``wait`` / ``abort`` pauses.
        version_fn: ``step -> weight_version`` (default ``str(step)``).
        adapter, dtype: ``LoRAAdapterSource``'s (which adapter; the dtype sent).
        precheck: check the adapter against the servers' limits before they see it (default). False
            leaves the verdict to the server (``server_info`` is then not asked).
        timeout_s: bound on the cross-rank exchanges (the load outcome waits ``client.transfer_timeout`` more).
    """

    def __init__(
        self,
        model: Any,
        client: Any,
        *,
        lora_name: str = "policy",
        adapter_dir: str,
        server_dir: str | None = None,
        mode: str = "inplace",
        every: int = 1,
        keep: int | None = None,
        pause: str | None = "keep",
        clear_cache: bool = True,
        version_fn: Callable[[int], str] = str,
        adapter: str | None = None,
        dtype: torch.dtype | None = None,
        precheck: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.rank = dist.get_rank() if multi_rank() else 0
        who = f"LoRAAdapterSync: rank {self.rank}"
        if not isinstance(lora_name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]+", lora_name):
            raise ValueError(f"{who}: lora_name must be a non-empty name of letters, digits, '_.:-', got {lora_name!r}")
        if not isinstance(adapter_dir, (str, os.PathLike)) or not str(adapter_dir):
            raise ValueError(f"{who}: adapter_dir must be a folder path the servers can read, got {adapter_dir!r}")
        if mode not in MODES:
            raise ValueError(f"{who}: mode must be one of {MODES}, got {mode!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{who}: every must be a positive int (steps between syncs), got {every!r}")
        if keep is not None and (mode != "versioned" or isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"{who}: keep must be a positive int, and only with mode='versioned'; got keep={keep!r}, "
                             f"mode={mode!r}")
        if pause is not None and pause not in PAUSE_MODES:
            raise ValueError(f"{who}: pause must be one of {PAUSE_MODES} or None, got {pause!r}")
        need = ["load_lora_adapter", "update_weight_version"] + (["pause", "resume"] if pause else [])
        need += ["unload_lora_adapter"] if mode == "versioned" else []
        need += ["server_info"] if precheck else []
        missing = [m for m in need if not callable(getattr(client, m, None))]
        if missing:
            raise TypeError(f"{who}: client {type(client).__name__} lacks {missing} (use VLLMHTTPClient)")
        if not callable(version_fn):
            raise TypeError(f"{who}: version_fn must be callable (step -> str), got {version_fn!r}")
        self.source = model if isinstance(model, LoRAAdapterSource) else LoRAAdapterSource(
            model, adapter=adapter, dtype=dtype, timeout_s=timeout_s)
        self.client = client
        self.lora_name = lora_name
        self.adapter_dir = os.path.abspath(os.fspath(adapter_dir))
        self.server_dir = os.fspath(server_dir) if server_dir is not None else self.adapter_dir
        self.mode = mode
        self.every = every
        self.keep = keep
        self.pause_mode = pause
        self.clear_cache = clear_cache
        self.version_fn = version_fn
        self.precheck = precheck
        self.timeout_s = timeout_s
        transfer = getattr(client, "transfer_timeout", None)
        transfer = float(transfer) if isinstance(transfer, (int, float)) and not isinstance(transfer, bool) else 900.0
        #: how long ranks wait for rank 0's write + pause + load + commit + resume
        self.load_timeout_s = timeout_s + 3 * transfer
        self.facts: dict[str, dict[str, Any]] | None = None
        #: rank 0: ``[(served name, folder)]`` loaded now, oldest first
        self.served: list[tuple[str, str]] = []
        self.last_report: AdapterSyncReport | None = None
        self._last_step: int | None = None
        self._closed = False

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    # ---- schedule (as ``WeightSync``'s) ----------------------------------------------------------

    def should_sync(self, step: int) -> bool:
        """True iff ``step`` is a multiple of ``every`` and was not synced already. Pure: the same
        answer on every rank for the same step."""
        return step % self.every == 0 and step != self._last_step

    def maybe_sync(self, step: int) -> AdapterSyncReport | None:
        """``sync(step)`` if the schedule says so, else ``None``. Call it on every rank, every step."""
        return self.sync(step) if self.should_sync(step) else None

    # ---- phases ---------------------------------------------------------------------------------

    def _limits(self) -> str:
        """Rank 0: every server's facts as JSON (``server_limits``)."""
        modules = [m.module for m in self.source.modules]
        infos = self.client.server_info()
        return json.dumps({u: server_limits(i, modules) for u, i in infos.items()})

    def _agree(self, board: Board | None, phase: str, mine: str, *, timeout_s: float | None = None) -> dict[int, str]:
        if board is None:
            return {0: mine}
        ranks = list(range(dist.get_world_size()))
        return board.exchange(mine, ranks=ranks, timeout_s=timeout_s or self.timeout_s,
                              what=f"the LoRA adapter sync {phase} exchange")

    def _raise_if_failed(self, phase: str, got: dict[int, str], err: BaseException | None) -> None:
        failed = {r: v[len("error:"):] for r, v in got.items() if v.startswith("error:")}
        if not failed:
            return
        if err is not None:
            err.add_note(f"weightsync: LoRA adapter sync failed in {phase} on rank(s) {sorted(failed)}")
            raise err
        cls = AdapterRefusedError if phase == "load" else WeightSyncError
        raise cls(f"rank {self.rank}: LoRA adapter sync failed in {phase} on rank(s) {sorted(failed)}: "
                  + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())))

    def _attempt(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, str]:
        try:
            return fn(), None, "ok"
        except BaseException as e:  # noqa: BLE001 - agreed, then raised on every rank
            return None, e, f"error:{type(e).__name__}: {e}"

    def sync(self, step: int | None = None, *, weight_version: str | None = None) -> AdapterSyncReport:
        """Check, gather, write, pause, load, commit, resume (module docstring). Every rank, same order."""
        if self._closed:
            raise WeightSyncError(f"rank {self.rank}: LoRAAdapterSync.sync() after shutdown()")
        t0 = time.perf_counter()
        step = 0 if step is None else int(step)
        version = str(weight_version if weight_version is not None else self.version_fn(step))
        board = Board(next_tag("weightsync-lora")) if multi_rank() else None

        # 1. the servers' limits (once), on every rank
        if self.precheck and self.facts is None:
            text, err, status = self._attempt(self._limits) if self.is_sender else (None, None, "ok")
            got = self._agree(board, "server limits", text if err is None and self.is_sender else status)
            self._raise_if_failed("server limits", got, err)
            self.facts = json.loads(got[0])
            loras = [f.get("lora") for f in self.facts.values()]
            if self.mode == "versioned" and self.keep is None and loras and all(loras):
                self.keep = min(int(lo["max_loras"]) for lo in loras)  # type: ignore[index]
        if self.mode == "versioned" and self.keep is None:
            self.keep = 1  # precheck=False: the servers' max_loras is not known
        # 2. checks, every rank
        if self.precheck:
            _, err, status = self._attempt(lambda: check_adapter(
                self.source, self.facts or {}, mode=self.mode, keep=self.keep, rank=self.rank))
            self._raise_if_failed("checks", self._agree(board, "checks", status), err)

        # 3. gather, every rank (collective)
        t = time.perf_counter()
        tensors, err, status = self._attempt(self.source.state_dict)
        gather_s = time.perf_counter() - t
        self._raise_if_failed("gather", self._agree(board, "gather", status), err)

        # 4-5. rank 0: write, pause, load, commit, resume, clean up
        timings = {"write": 0.0, "load": 0.0, "pause": 0.0}
        result: dict[str, Any] = {}
        if self.is_sender:
            _, err, status = self._attempt(lambda: self._publish(tensors, version, timings, result))
        else:
            err, status = None, "ok"
        self._raise_if_failed("load", self._agree(board, "load", status, timeout_s=self.load_timeout_s), err)

        meta = self.source.metadata
        report = AdapterSyncReport(
            step=step, weight_version=version, rank=self.rank,
            lora_name=self._served_name(version), path=result.get("path"), tensors=len(meta),
            bytes=sum(m.dtype.itemsize * math.prod(m.shape) for m in meta), file_bytes=result.get("file_bytes"),
            gather_seconds=gather_s, write_seconds=timings["write"], load_seconds=timings["load"],
            pause_seconds=timings["pause"], total_seconds=time.perf_counter() - t0,
            collectives=getattr(self.source.last_pass, "collectives", None),
        )
        self.last_report = report
        self._last_step = step
        logger.log(20 if self.is_sender else 10, "%s", report.summary())
        return report

    def _served_name(self, version: str) -> str:
        return self.lora_name if self.mode == "inplace" else f"{self.lora_name}-{_safe(version)}"

    def _publish(self, tensors: dict[str, torch.Tensor], version: str, timings: dict[str, float],
                 result: dict[str, Any]) -> None:
        leaf = f"{_safe(version)}-{uuid.uuid4().hex[:8]}"
        local = os.path.join(self.adapter_dir, self.lora_name, leaf)
        remote = os.path.join(self.server_dir, self.lora_name, leaf)
        t = time.perf_counter()
        result["file_bytes"] = write_adapter(local, tensors, self.source.adapter_config())
        timings["write"] = time.perf_counter() - t
        result["path"] = local
        name = self._served_name(version)
        inplace = self.mode == "inplace" or any(n == name for n, _ in self.served)
        paused = False
        err: BaseException | None = None
        try:
            if self.pause_mode is not None:
                t = time.perf_counter()
                self.client.pause(self.pause_mode, clear_cache=self.clear_cache)
                paused = True
                timings["pause"] = time.perf_counter() - t
            t = time.perf_counter()
            try:
                self.client.load_lora_adapter(name, remote, load_inplace=inplace)
            except BaseException as e:
                raise AdapterRefusedError(
                    f"rank {self.rank}: the server refused adapter {name!r} (version {version!r}, {remote}); "
                    f"the previous version keeps serving and weight_version was not committed: {e}"
                ) from e
            timings["load"] = time.perf_counter() - t
            self.client.update_weight_version(version)
        except BaseException as e:  # noqa: BLE001 - resume first, then raise
            err = e
        if paused:
            try:
                self.client.resume()
            except BaseException as e:  # noqa: BLE001
                if err is None:
                    err = e
                else:
                    logger.error("rank %d: resume after a failed adapter load also failed: %s", self.rank, e)
        if err is not None:
            shutil.rmtree(local, ignore_errors=True)  # never loaded: nothing points at it
            raise err
        self._retire(name, local)

    def _retire(self, name: str, local: str) -> None:
        """After a successful load: drop folders no served name points at any more."""
        old = [(n, p) for n, p in self.served if n == name]
        self.served = [(n, p) for n, p in self.served if n != name] + [(name, local)]
        for _, p in old:
            shutil.rmtree(p, ignore_errors=True)
        if self.mode == "versioned":
            while self.keep is not None and len(self.served) > self.keep:
                n, p = self.served.pop(0)
                try:
                    self.client.unload_lora_adapter(n)
                except BaseException as e:  # noqa: BLE001 - the new version serves; say so and go on
                    logger.warning("rank %d: unloading old adapter version %r failed: %s", self.rank, n, e)
                shutil.rmtree(p, ignore_errors=True)

    def shutdown(self) -> None:
        """No more syncs from this object (the served adapters and their folders stay). Idempotent."""
        self._closed = True

    def __enter__(self) -> "LoRAAdapterSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

