"""``ReceiverClient``: a ``VLLMWeightSyncClient`` for a ``ReceiverServer`` (or a vLLM dev-mode
server), stdlib only, plus the receiver's test routes (``/_state``, ``/_checksums``, ``/_full_checksums``,
``/_logits``, ``/_calls``, ``/_shutdown``).

Why not vLLM's ``HTTPVLLMWeightSyncClient``: this one raises ``WeightSyncError`` carrying the server's
error message, so a rejected update says why on the trainer, and it imports no vLLM (a receiver's
parent, a test, need not pay it).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import torch

from weightsync.sources import WeightSyncError

__all__ = ["ReceiverClient"]


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
