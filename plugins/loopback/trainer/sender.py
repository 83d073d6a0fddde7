"""The sender's end of the loopback transport, shared by the dense (``engine``) and the sparse
(``sparse``) trainer engines: opening the transport on trainer rank 0, and the receiver's
``update_weights`` RPC that runs beside the broadcasts.

Why concurrently: the receivers join the transport group while they handle the control-plane call
(``init_weight_transfer_engine``, ``update_weights``), and the sender's own side blocks until they
do; so the RPC runs in a daemon thread while the sender forms the group or broadcasts, and either
side's failure is raised here, naming the receiver's reason when it has one. Daemon threads (not an
executor) so that a call stuck on a dead peer cannot keep the interpreter from exiting after the
error has been raised.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import get_logger

from ..receiver.transport import join_transport_group, open_transport_store

__all__ = ["UpdateRpc", "open_sender", "run_concurrently"]

logger = get_logger(__name__)


def run_concurrently(main: Callable[[], Any], side: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``side`` in a daemon thread while ``main`` runs here; raise the first failure."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = side()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="weightsync-loopback-rpc")
    t.start()
    try:
        out = main()
    except BaseException as e:
        # The transport gave up (e.g. the group never formed): when the receiver's RPC failed too
        # (a dead or refusing server), say so, naming the server, next to the transport's error.
        t.join(min(timeout_s, 5.0))
        if "error" in box:
            raise WeightSyncError(
                f"{e}; the receiver's side failed too: {type(box['error']).__name__}: {box['error']}"
            ) from box["error"]
        raise
    t.join(timeout_s)
    if "error" in box:
        raise box["error"]
    if t.is_alive():
        raise WeightSyncError(f"loopback: the receiver RPC did not return within {timeout_s:.0f}s")
    return out


class UpdateRpc:
    """A client call (``update_weights``) running in a daemon thread while the sender broadcasts;
    ``check()`` raises if it already failed (the receiver rejected the update), ``result()`` waits
    for it, bounded."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._box: dict[str, Any] = {}

        def target() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001
                self._box["error"] = e

        self._t = threading.Thread(target=target, daemon=True, name="weightsync-loopback-rpc")
        self._t.start()

    def check(self) -> None:
        if "error" in self._box:
            raise WeightSyncError(f"loopback receiver rejected the update: {self._box['error']}") from (
                self._box["error"]
            )

    def result(self, timeout_s: float) -> None:
        self._t.join(timeout_s)
        if self._t.is_alive():
            raise WeightSyncError(f"loopback: update_weights did not return within {timeout_s:.0f}s")
        self.check()


def open_sender(init_info: Any, client: VLLMWeightSyncClient) -> tuple[Any, Any]:
    """On the sender: bind the transport's store (port 0: a free one, never released before use),
    then tell the receivers the bound port (``client.init_weight_transfer_engine``) while the group
    forms -- no window in which another process can take the port. Returns ``(store, group)``."""
    store = open_transport_store(
        init_info.master_address,
        init_info.master_port,
        rank=0,
        world_size=init_info.world_size,
        timeout_s=init_info.timeout_s,
    )
    payload = dict(vars(init_info.worker_init_info(master_port=store.port)))
    joined: dict[str, Any] = {}

    def open_endpoint() -> None:
        joined["group"] = join_transport_group(
            store, rank=0, world_size=init_info.world_size, timeout_s=init_info.timeout_s
        )

    run_concurrently(
        open_endpoint,
        lambda: client.init_weight_transfer_engine(payload),
        init_info.timeout_s,
    )
    logger.info(
        "loopback sender joined the transport at %s:%d (world %d, %s)",
        init_info.master_address,
        store.port,
        init_info.world_size,
        ", ".join(f"{k}={payload[k]}" for k in ("packed", "checksums", "sparse") if k in payload),
    )
    return store, joined["group"]
