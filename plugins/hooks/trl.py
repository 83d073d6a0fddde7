"""``WeightSyncGRPOTrainer``: TRL's ``GRPOTrainer`` generating from a vLLM server (``use_vllm=True,
vllm_mode="server"``) whose weight sync is weightsync's instead of TRL's.

The one-line change from TRL's own setup::

    trainer = WeightSyncGRPOTrainer(sync=build_sync, model=..., reward_funcs=..., args=GRPOConfig(
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, ...), train_dataset=...)

where ``build_sync(model) -> WeightSync`` (called once, on every rank, with the model as accelerate
prepared it: build the source there, e.g. ``source_from_accelerator(trainer.accelerator, model)``).

Invariants, and why:

* **TRL's generation is untouched; only its sync is replaced.** TRL still talks to the server for
  rollouts (``/v1/completions``) through its ``VLLMClient``; ``VLLMGeneration.sync_weights`` -- which
  TRL calls on every rank before generating whenever ``global_step`` moved -- is replaced on the
  instance by ``WeightSync.sync(global_step, weight_version=str(global_step))`` (pause, send, commit
  the version, resume, as configured on the ``WeightSync``), then TRL's own prefix-cache reset.
* **TRL's NCCL communicator is never opened.** ``GRPOTrainer.__init__`` asks the server to join an
  NCCL group with the trainer (``init_communicator``, CUDA only); weightsync opens its own transfer
  engine with the server on its first sync, with the backend the ``WeightSync`` names. During
  ``__init__`` only, ``VLLMClient.init_communicator`` is a no-op for this trainer's client.
* **Reports land in TRL's metrics**: each sync's numeric report (``weightsync/...``) is appended to
  the trainer's ``_metrics["train"]``, which GRPO averages and logs beside its own loss and rewards at
  the next logging step; TRL's loss entries are not touched.
* **The served model ends on the trained weights**: TRL syncs *before* each generation, so nothing
  would sync after the last optimizer step (3 steps ended on version "2"). At ``on_train_end``
  (every rank) the trainer syncs once more when the last sync was of an earlier step
  (``sync_on_train_end=True``, the default): the served ``weight_version`` is the last step's.
* **Async GRPO** (``trl.experimental.async_grpo``) is ``trl_async.WeightSyncAsyncGRPOTrainer``: the
  same idea through TRL's ``weight_transfer=`` seam and its merged sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from weightsync.sources.toolkit import get_logger

from ..sync.driver import LateSync, WeightSync

__all__ = ["WeightSyncGRPOTrainer"]

logger = get_logger("weightsync.plugins.trl")


@contextlib.contextmanager
def _without_trl_communicator() -> Iterator[None]:
    """``VLLMClient.init_communicator`` does nothing inside the block (weightsync opens its own
    transfer engine with the server)."""
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator
    VLLMClient.init_communicator = lambda self, *a, **k: logger.info(
        "WeightSyncGRPOTrainer: TRL's NCCL communicator skipped; weightsync syncs the server at %s", self.base_url
    )
    try:
        yield
    finally:
        VLLMClient.init_communicator = original


def _grpo_trainer() -> type:
    from trl import GRPOTrainer

    return GRPOTrainer


def __getattr__(name: str) -> Any:  # WeightSyncGRPOTrainer is built on first access (TRL imported then)
    if name != "WeightSyncGRPOTrainer":
        raise AttributeError(name)
    cls = _build_class(_grpo_trainer())
    globals()[name] = cls
    return cls


def _final_sync_callback() -> type:
    from transformers import TrainerCallback

    class FinalSync(TrainerCallback):
        """Calls the trainer's final sync at ``on_train_end`` (which the Trainer runs on every rank)."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.trainer._weightsync_final()

    return FinalSync


def _FinalSync(trainer: Any) -> Any:  # noqa: N802 - builds the callback class on first use (transformers imported then)
    return _final_sync_callback()(trainer)


def _build_class(base: type) -> type:
    class WeightSyncGRPOTrainer(base):  # type: ignore[misc, valid-type]
        """TRL's ``GRPOTrainer`` (``use_vllm=True, vllm_mode="server"``) whose weight sync is
        ``sync`` (a ``WeightSync``, or ``model -> WeightSync`` built at the first sync with the
        prepared model). Every other argument is ``GRPOTrainer``'s. See the module docstring."""

        def __init__(self, *args: Any, sync: WeightSync | Callable[[Any], WeightSync],
                     sync_on_train_end: bool = True, **kwargs: Any) -> None:
            grpo_args = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
            if grpo_args is None or not getattr(grpo_args, "use_vllm", False) or getattr(
                grpo_args, "vllm_mode", None
            ) != "server":
                raise ValueError(
                    "WeightSyncGRPOTrainer: args must be a GRPOConfig with use_vllm=True and vllm_mode='server' "
                    "(weightsync syncs a vLLM server); got "
                    + ("no args" if grpo_args is None else
                       f"use_vllm={getattr(grpo_args, 'use_vllm', None)!r}, vllm_mode={getattr(grpo_args, 'vllm_mode', None)!r}")
                )
            self._weightsync = LateSync(sync, owner="WeightSyncGRPOTrainer", model_arg="model")
            with _without_trl_communicator():
                super().__init__(*args, **kwargs)
            self.vllm_generation.sync_weights = self._weightsync_sync
            if sync_on_train_end:
                self.add_callback(_FinalSync(self))

        @property
        def weight_sync(self) -> WeightSync | None:
            """The ``WeightSync`` (None before the first sync when a factory was given)."""
            return self._weightsync.sync

        def _weightsync_sync(self) -> None:
            """In place of ``VLLMGeneration.sync_weights``: every rank, before a generation."""
            ws = self._weightsync.build(self.model_wrapped if self.model_wrapped is not None else self.model)
            step = int(self.state.global_step)
            report = ws.sync(step, weight_version=str(step))
            for key, value in report.metrics().items():
                self._metrics["train"][key].append(value)
            if self.accelerator.is_main_process:
                self.vllm_generation.vllm_client.reset_prefix_cache()

        def _weightsync_final(self) -> None:
            """At train end, every rank: sync the last optimizer step's weights unless the last
            sync already sent them (or no sync ever ran: no server state to bring up to date)."""
            ws = self._weightsync.sync
            last = None if ws is None else ws.last_report
            if ws is None or (last is not None and last.step == int(self.state.global_step)):
                return
            logger.info("WeightSyncGRPOTrainer: final sync of step %d at train end (last synced: %s)",
                        int(self.state.global_step), None if last is None else last.step)
            self._weightsync_sync()

    WeightSyncGRPOTrainer.__module__ = __name__
    return WeightSyncGRPOTrainer
