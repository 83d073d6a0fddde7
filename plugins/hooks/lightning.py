"""``WeightSyncCallback`` for Lightning (optional extra: ``pip install weightsync[lightning]``).

Invariants, and why:

* **Every rank, same steps**: Lightning runs callbacks on every rank. The sync happens on
  ``on_train_start`` (cold sync, after the strategy wrapped/sharded the module) and on
  ``on_train_batch_end`` when ``trainer.global_step`` -- which counts *optimizer* steps, so gradient
  accumulation is respected -- is a multiple of ``every`` and was not synced yet. No
  rank-conditional branch: only the driver decides, inside, that rank 0 talks HTTP.
* **Reports go to the trainer's loggers** (``logger.log_metrics``; Lightning's loggers write on
  global rank 0 only) and are kept in ``reports``.
* **The served model ends on the trained weights**: ``on_train_end`` syncs the last optimizer
  step's weights when the last sync was of an earlier step (``sync_on_train_end=True``, the
  default): evaluating the served model after ``trainer.fit`` evaluates what was trained.
* **Built late**: a callable ``sync`` gets the ``LightningModule`` at ``on_train_start``.
* **Adapter-only with one option** (``adapter_only="/shared/adapters"``, ``hooks/late.py``): the
  PEFT LoRA adapter of the ``PeftModel`` inside the ``LightningModule`` (exactly one) is sent
  instead of the merged model, by a ``LoRAAdapterSync`` with the ``WeightSync``'s client,
  ``every``, pause mode and version strings: the same steps sync. A ``LoRAAdapterSync`` (or a
  factory returning one) is also taken as ``sync``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the classic package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from ..lora_adapter import AdapterSyncReport
from ..sync.report import SyncReport
from .late import AnySync, HookSync

__all__ = ["WeightSyncCallback"]


class WeightSyncCallback(Callback):
    """Sync the module into vLLM at train start, then every ``WeightSync.every`` optimizer steps.

    Args:
        sync: a ``WeightSync`` or ``LoRAAdapterSync``, or ``pl_module -> either`` called at
            ``on_train_start``.
        cold_sync: sync at train start (step ``trainer.global_step``).
        log: send each report's metrics to ``trainer.loggers``.
        sync_on_train_end: at ``on_train_end``, sync the final weights if the last sync was of an
            earlier step (default True).
        adapter_only: send only the PEFT LoRA adapter (``LoRAAdapterSync``, module docstring): the
            folder the vLLM server reads adapters from, or a dict of ``LoRAAdapterSync`` arguments.
    """

    def __init__(
        self,
        sync: AnySync | Callable[[Any], AnySync],
        *,
        cold_sync: bool = True,
        log: bool = True,
        sync_on_train_end: bool = True,
        adapter_only: str | os.PathLike | Mapping[str, Any] | None = None,
    ) -> None:
        self._late = HookSync(sync, owner="WeightSyncCallback", model_arg="pl_module", adapter_only=adapter_only)
        self.cold_sync = cold_sync
        self.log = log
        self.sync_on_train_end = sync_on_train_end
        self.reports: list[SyncReport | AdapterSyncReport] = []
        self._start_step: int | None = None

    @property
    def sync(self) -> AnySync | None:
        """The ``WeightSync`` or ``LoRAAdapterSync`` driven (None until ``on_train_start`` when a
        factory or ``adapter_only`` was given)."""
        return self._late.sync

    def _run(self, trainer: Any, step: int) -> None:
        assert self.sync is not None
        report = self.sync.sync(step)
        self.reports.append(report)
        if self.log:
            for lg in trainer.loggers:
                lg.log_metrics(report.metrics(), step=step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._late.build(pl_module)
        self._start_step = trainer.global_step
        if self.cold_sync:
            self._run(trainer, trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.sync is not None, "on_train_start did not run"
        step = trainer.global_step
        if step != self._start_step and self.sync.should_sync(step):
            self._run(trainer, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.sync is None or not self.sync_on_train_end:
            return
        last = self.sync.last_report
        if last is None or last.step != trainer.global_step:
            self._run(trainer, trainer.global_step)
