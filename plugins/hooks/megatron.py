"""A weight-sync hook for Megatron-core training loops.

Megatron's loop (``megatron.training.train`` or a hand-written one) has no callback system; the hook
is one call placed right after the optimizer step, on every rank::

    hook = MegatronWeightSync(model, init_info, client, hf_config=hf_config, every=4)
    for iteration in range(start, train_iters):
        loss, skipped, grad_norm = train_step(...)           # forward/backward/optimizer.step()
        hook(iteration + 1, update_successful=not skipped)   # every rank, unconditionally

Invariants, and why:

* **The VPP model list, as ``get_model`` returns it**: ``model`` is this rank's list of
  virtual-pipeline chunks (DDP / Float16Module wrappers allowed); ``MegatronSource`` binds every
  chunk, so every stage's tensors reach the sender.
* **Every rank, same iterations**: ``iteration`` is the same on every rank, and so is
  ``update_successful`` -- Megatron reduces found-inf / grad-norm over the model-parallel group after
  the data-parallel gradient all-reduce -- so skipping a sync for a skipped update (the loss scaler
  found inf/nan; the weights did not change) is decided alike on every rank.
* The sync itself is ``WeightSync``'s: rank 0 talks to vLLM, every rank runs the collectives.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, VLLMWeightSyncClient

from ..sync.driver import WeightSync
from ..sync.report import SyncReport

__all__ = ["MegatronWeightSync"]


class MegatronWeightSync:
    """Call ``hook(iteration)`` after each optimizer step on every rank; syncs every ``every``.

    Args:
        model: this rank's model chunk list (or a single chunk without virtual pipelining).
        init_info, client: as for ``WeightSync`` (``init_info.rank`` = this global rank).
        hf_config: the transformers config of the checkpoint vLLM serves (names, vocab trim).
        dtype: wire dtype (default: the parameters' dtype).
        draft: also sync the speculative-decoding draft -- the model's multi-token-prediction block,
            ``MegatronSource(part="mtp")`` -- in the same pause, same ``weight_version``
            (``WeightSync(draft=...)``; vLLM's ``start_draft_weight_update``). Default False: the
            policy only (an MTP block never stops the policy from syncing).
        sync_kwargs: ``every``, ``pause``, ``clear_cache``, ``version_fn``... for ``WeightSync``.
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        init_info: TrainerInitInfo,
        client: VLLMWeightSyncClient,
        *,
        hf_config: Any,
        dtype: torch.dtype | None = None,
        draft: bool = False,
        **sync_kwargs: Any,
    ) -> None:
        from weightsync.sources import MegatronSource

        source = MegatronSource(model, hf_config=hf_config, dtype=dtype)
        if draft:
            sync_kwargs["draft"] = MegatronSource(model, hf_config=hf_config, dtype=dtype, part="mtp")
        # MegatronSource checks its own stream; the driver still runs the cross-rank checks.
        self.sync = WeightSync(source, init_info, client, **sync_kwargs)

    def __call__(self, iteration: int, *, update_successful: bool = True) -> SyncReport | None:
        """After the optimizer step of ``iteration``: sync if the schedule says so and the update
        was applied. Returns the report, or ``None`` when nothing was sent."""
        if not update_successful:
            return None
        return self.sync.maybe_sync(iteration)

    def sync_now(self, iteration: int) -> SyncReport:
        """Sync regardless of the schedule (cold start, before evaluation, at the end)."""
        return self.sync.sync(iteration)

    def shutdown(self) -> None:
        self.sync.shutdown()
