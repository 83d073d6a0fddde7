"""``WeightSyncCallback`` for ``transformers.Trainer`` (and TRL trainers, which subclass it).

Invariants, and why:

* **Every rank syncs at the same points**: the callback runs on every rank (the Trainer calls its
  callbacks on every process), syncs on ``on_train_begin`` (cold sync: vLLM starts from the
  trainer's initial weights) and on ``on_step_end`` when ``global_step`` is a multiple of ``every``
  -- ``on_step_end`` fires once per *optimizer* step, after gradient accumulation, so a partially
  accumulated step is never sent. There is no rank-conditional branch around the sync; only the
  driver decides, inside, that rank 0 talks HTTP.
* **Reports land in the Trainer's logs without touching the Trainer's own entries**: with
  ``trainer=`` the report is appended to ``state.log_history`` (with ``step`` and ``epoch``, as
  ``Trainer.log`` writes it) and handed to every callback's ``on_log`` (the ``report_to``
  integrations: TensorBoard, W&B, ...; the progress printer) through ``trainer.callback_handler``.
  It deliberately does **not** call ``Trainer.log``: the sync runs inside ``on_step_end``, before the
  Trainer's own ``_maybe_log_save_evaluate`` for that step, and ``Trainer.log`` ->
  ``CallbackHandler.on_log`` clears ``control.should_log``, so that step's ``loss`` / ``grad_norm`` /
  ``learning_rate`` line would never be written (with ``every=1``, no loss ever); subclasses that
  override ``log`` to flush their own pending metrics (TRL's ``GRPOTrainer``: ``reward``,
  ``completions/*``) would also sweep those into the weightsync entry. The callback handler's
  ``on_log`` is called instead and ``control.should_log`` is restored to what it was, so the
  Trainer's own log for the step still happens, once, with its own metrics. Without ``trainer=``
  the report goes into ``state.log_history`` directly and is merged into the next ``on_log``
  payload the Trainer emits (its integrations see it then).
* **The served model ends on the trained weights**: ``on_train_end`` syncs the last optimizer step's
  weights when the last sync was of an earlier step (``sync_on_train_end=True``, the default), so a
  user who evaluates the served model after ``trainer.train()`` evaluates what was trained, not the
  weights of the last multiple of ``every``. Every rank runs ``on_train_end``, so the final sync is
  collective like every other one.
* **Built late**: a callable ``sync`` is called with the model at ``on_train_begin``, after
  accelerate prepared (sharded) it, so the source sees the FSDP2 parameters.
* **Adapter-only with one option** (``adapter_only="/shared/adapters"``, ``hooks/late.py``): a PEFT
  LoRA model's adapter is sent instead of the merged model -- a ``LoRAAdapterSync`` of the model the
  Trainer hands ``on_train_begin``, with the ``WeightSync``'s client, ``every``, pause mode and
  version strings; the same steps sync, the reports land in the same logs. A ``LoRAAdapterSync``
  (or a factory returning one) is also taken as ``sync``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from transformers import TrainerCallback

from weightsync.sources.toolkit import get_logger

from .late import AnySync, HookSync

__all__ = ["WeightSyncCallback"]

# Logged under the module path users import it from (README: ``weightsync.plugins.transformers``).
logger = get_logger("weightsync.plugins.transformers")


class WeightSyncCallback(TrainerCallback):
    """Sync the Trainer's model into vLLM: at train begin, then every ``WeightSync.every`` optimizer
    steps.

    Args:
        sync: a ``WeightSync`` or ``LoRAAdapterSync``, or ``model -> either`` called at
            ``on_train_begin`` with the prepared model (build the source there, e.g. with
            ``weightsync.plugins.accelerate``).
        trainer: the Trainer, to hand reports to its loggers (``report_to`` integrations) at the
            sync step itself (recommended); its own ``Trainer.log`` is not called (module docstring).
        cold_sync: sync at ``on_train_begin`` (step ``state.global_step``, 0 for a fresh run).
        sync_on_train_end: at ``on_train_end``, sync the final weights if the last sync was of an
            earlier step (default True: the served version is the last optimizer step's).
        adapter_only: send only the PEFT LoRA adapter (``LoRAAdapterSync``, module docstring): the
            folder the vLLM server reads adapters from, or a dict of ``LoRAAdapterSync`` arguments
            (``adapter_dir``, ``lora_name``, ``mode``, ``keep``, ``server_dir``...). None: full syncs.
    """

    def __init__(
        self,
        sync: AnySync | Callable[[Any], AnySync],
        *,
        trainer: Any = None,
        cold_sync: bool = True,
        sync_on_train_end: bool = True,
        adapter_only: str | os.PathLike | Mapping[str, Any] | None = None,
    ) -> None:
        self._late = HookSync(sync, owner="WeightSyncCallback", model_arg="model", adapter_only=adapter_only)
        self.trainer = trainer
        self.cold_sync = cold_sync
        self.sync_on_train_end = sync_on_train_end
        self._pending: dict[str, float] = {}

    @property
    def sync(self) -> AnySync | None:
        """The ``WeightSync`` or ``LoRAAdapterSync`` driven (None until ``on_train_begin`` when a
        factory or ``adapter_only`` was given)."""
        return self._late.sync

    def _ensure(self, model: Any) -> AnySync:
        if self.sync is None and model is None:
            raise ValueError("WeightSyncCallback: the Trainer passed no model to on_train_begin")
        return self._late.build(model)

    def _run(self, args: Any, state: Any, control: Any, step: int) -> Any:
        """Sync, then publish the report; returns the ``control`` the Trainer should keep."""
        assert self.sync is not None
        report = self.sync.sync(step)
        metrics: dict[str, float] = dict(report.metrics())
        if self.trainer is None:
            state.log_history.append({**metrics, "step": state.global_step})
            self._pending.update(metrics)
            return control
        if state.epoch is not None:
            metrics["epoch"] = state.epoch
        state.log_history.append({**metrics, "step": state.global_step})
        # CallbackHandler.on_log clears should_log; the Trainer decides after on_step_end whether to
        # write its own log for this step from that flag, so give it back what it was.
        should_log = control.should_log
        control = self.trainer.callback_handler.on_log(args, state, control, dict(metrics))
        control.should_log = should_log
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self._ensure(model)
        if self.cold_sync:
            return self._run(args, state, control, state.global_step)
        return None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        assert self.sync is not None, "on_train_begin did not run"
        if self.sync.should_sync(state.global_step):
            return self._run(args, state, control, state.global_step)
        return None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.sync is None or not self.sync_on_train_end:
            return None
        last = self.sync.last_report
        if last is None or last.step != state.global_step:
            logger.info("WeightSyncCallback: final sync of step %d at train end (last synced: %s)",
                        state.global_step, None if last is None else last.step)
            return self._run(args, state, control, state.global_step)
        return None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs is not None and self._pending:
            logs.update(self._pending)
            self._pending = {}
