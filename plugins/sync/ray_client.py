"""``RayDraftWeightSyncClient``: vLLM's ``RayVLLMWeightSyncClient`` plus the draft model's start.

vLLM 0.34's ``RayVLLMWeightSyncClient`` (``vllm/distributed/weight_transfer/clients.py``) drives
``AsyncLLM`` / ``LLM`` Ray actors through the four weight-update calls but has no
``start_draft_weight_update``, although both actors serve one (``AsyncLLM.start_draft_weight_update``,
``RLOfflineMixin.start_draft_weight_update``: ``collective_rpc("start_draft_weight_update")``, after
which the update rounds load into the speculative-decoding draft model until
``finish_weight_update``). This subclass adds exactly that call, so ``WeightSync(..., draft=...)``
can run its draft round through Ray actors.

The vLLM calls it makes, on every handle, blocking on all of them (``ray.get`` of the list, as the
parent class does): everything ``RayVLLMWeightSyncClient`` makes (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update`` then ``update_weight_version``
when a version is given, ``shutdown_weight_transfer_engine``), plus
``start_draft_weight_update.remote()``. A failure on any actor raises from ``ray.get`` (Ray's
``RayTaskError`` carrying the actor's exception, e.g. vLLM's "no draft model is configured"), on the
rank that called it; ``WeightSync`` then raises on every rank.

It pauses nothing (neither does vLLM's client: ``LLM`` actors have no ``pause_generation``): build
``WeightSync`` with ``pause=None``. Ray is imported at call time, as in vLLM's client.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

from weightsync.sources.toolkit import get_logger

__all__ = ["RayDraftWeightSyncClient"]

logger = get_logger(__name__)


class RayDraftWeightSyncClient(RayVLLMWeightSyncClient):
    """vLLM's Ray client (one or more ``AsyncLLM`` / ``LLM`` actor handles) with
    ``start_draft_weight_update`` fanned out to every handle (module docstring)."""

    def start_draft_weight_update(self) -> None:
        """``start_draft_weight_update.remote()`` on every handle, then ``ray.get`` of all of them."""
        import ray

        logger.debug("start_draft_weight_update on %d Ray actor(s)", len(self.handles))
        ray.get([h.start_draft_weight_update.remote() for h in self.handles])
