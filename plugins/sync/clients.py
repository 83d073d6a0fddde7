"""The clients a trainer engine talks through when ``WeightSync`` drives it: the user's control-plane
client, with the driver's ``weight_version`` added at commit (``CommittingClient``) and, for the
draft round, the draft model's start (``DraftClient``).

Why: vLLM's engines call ``finish_weight_update()`` without a version, but the commit must be vLLM's
own ``finish_weight_update(weight_version)`` (the version set in the same call that finishes the
update), so the driver hands engines a thin client that adds it. Everything else is forwarded
unchanged, so an engine sees the user's client's other methods (``full_checksums``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightTransferUpdatePayload

from weightsync.sources.toolkit import Board

__all__ = ["CommittingClient", "DraftClient"]


class CommittingClient:
    """Forwards the four ``VLLMWeightSyncClient`` calls; ``finish_weight_update`` carries the
    driver's pending ``version`` when the engine passes none, and records what it committed."""

    def __init__(self, client: VLLMWeightSyncClient) -> None:
        self.client = client
        #: the version the driver wants committed by this sync's finish
        self.version: str | None = None
        #: what the last finish committed (None: nothing)
        self.committed: str | None = None
        #: many senders: the sync's sender board; a failure posted there withholds the version
        self.turns: Board | None = None
        #: this rank's own broadcaster failed and completed its turn with zeros (``dense_pass``)
        self.sender_failed: Callable[[], bool] = lambda: False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        if self.sender_failed() or (self.turns is not None and self.turns.failure() is not None):
            version = None  # a sender completed its turn with zeros: finish, commit nothing
        self.client.finish_weight_update(version)
        self.committed = version

    def __getattr__(self, name: str) -> Any:
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)


class DraftClient:
    """The draft round's client: ``start_weight_update`` is ``start_draft_weight_update``; the rest
    (and the version the committing client adds at finish) as the policy round's."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def start_weight_update(self) -> None:
        self.client.start_draft_weight_update()

    def __getattr__(self, name: str) -> Any:
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)
