"""``WeightSyncAsyncGRPOTrainer``: TRL's asynchronous GRPO (``trl.experimental.async_grpo``) whose
weight sync into the vLLM server is weightsync's instead of TRL's.

The one-line change from TRL's own setup::

    trainer = WeightSyncAsyncGRPOTrainer(sync=build_sync, model="Qwen/Qwen3-0.6B", reward_funcs=...,
        args=AsyncGRPOConfig(vllm_server_base_url=url, ...), train_dataset=...)

where ``build_sync(model) -> WeightSync`` is called once, on every rank, with the model as accelerate
prepared it (build the source there, e.g. ``source_from_accelerator(trainer.accelerator, model)``);
a ready ``WeightSync`` works too. Every other argument is ``AsyncGRPOTrainer``'s.

Invariants, and why:

* **Only TRL's sync is replaced; its rollouts are untouched.** The rollout worker (TRL's default
  ``AsyncRolloutWorker``, or the one given as ``rollout_worker=``) still generates from the server
  and tags samples with the trainer's ``model_version``. TRL 1.16's merged sync
  (``AsyncGRPOTrainer._sync_weight_merged``: the cold sync on train begin, then every
  ``weight_sync_steps``) becomes, on every rank, ``WeightSync.sync(v)`` with ``v`` = rank 0's
  ``model_version + 1``: the source's own gathers, pause / commit ``weight_version`` / resume as the
  ``WeightSync`` is configured. Then, as TRL does and only once the sync succeeded on every rank,
  rank 0 sets ``model_version = v`` and calls ``rollout_worker.update_model_version(v)``. So the
  version the server reports is ``ws.version_fn(model_version)`` -- ``str(model_version)`` by
  default: the sample tags and the server agree. ``v`` is broadcast from rank 0 (TRL keeps
  ``model_version`` on rank 0 only, a resumed run included), so every rank's report names it.
* **TRL's transfer is never built.** ``AsyncGRPOTrainer`` takes a ``weight_transfer=`` object on
  rank 0; given one, TRL neither builds its NCCL ``WeightTransferClient`` nor probes the server for
  adapter-only LoRA sync. This trainer passes ``NoWeightTransfer`` (every call a no-op), so the
  merged sync above is the only path, and refuses a ``weight_transfer=`` of the caller's.
* **PEFT models are sent merged by the source**, not by TRL: ``FSDPSource`` merges LoRA on the
  fly, so TRL's ``merge_adapter`` / ``unmerge_adapter`` around the send is not called (it would merge
  twice). Adapter-only sync (TRL's ``--enable-lora`` path) is not offered here.
* **Pinned to TRL 1.16's layout.** ``_sync_weight_merged(t0) -> (t_pause, t_barrier, t_transfer)``
  is private to TRL; a TRL without it (or without ``weight_transfer=``) fails when the class is first
  imported, naming the TRL version found -- never a silent fallback to TRL's own sync.
* **Reports land in TRL's metrics**: each sync's numeric report (``weightsync/...``) is appended to
  ``_metrics["train"]`` beside TRL's own loss and rollout metrics (TRL's reducer sums keys with a
  ``total`` word, e.g. ``weightsync/total_seconds``: sync seconds per logging window). TRL's
  ``perf/weight_sync_*`` phases stay: pause = weightsync's pause, barrier = 0 (ranks agree through
  weightsync's bounded exchanges inside the sync, not a barrier), transfer = the rest.
* **Shutdown is the caller's**: ``trainer.weight_sync.shutdown()`` on every rank when done (TRL calls
  ``weight_transfer.destroy()`` on rank 0 only, where nothing can be torn down collectively).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

from weightsync.sources.toolkit import get_logger

from ..sync import LateSync, WeightSync

__all__ = ["WeightSyncAsyncGRPOTrainer", "NoWeightTransfer", "check_trl_async_layout"]

logger = get_logger("weightsync.plugins.trl")

#: The TRL release whose ``AsyncGRPOTrainer`` layout this trainer is written against.
TRL_LAYOUT = "1.16"


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol`` with every call a no-op: injected as ``weight_transfer=`` so
    TRL builds no transfer of its own (weightsync syncs instead)."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[Any]) -> None:
        pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def check_trl_async_layout(base: type, trl_version: str | None = None) -> None:
    """Raise ``ImportError`` naming ``trl_version`` (default: the installed TRL's) unless ``base``
    has what this trainer replaces and injects: ``_sync_weight_merged(self, t0)`` and ``__init__``'s
    ``weight_transfer`` and ``rollout_worker`` arguments (TRL 1.16's ``AsyncGRPOTrainer``)."""
    problems = []
    merged = getattr(base, "_sync_weight_merged", None)
    if not callable(merged):
        problems.append("no _sync_weight_merged method")
    else:
        params = list(inspect.signature(merged).parameters)
        if params != ["self", "t0"]:
            problems.append(f"_sync_weight_merged takes {params}, not (self, t0)")
    init_params = inspect.signature(base.__init__).parameters
    problems += [f"__init__ takes no {name}=" for name in ("weight_transfer", "rollout_worker") if name not in init_params]
    if problems:
        if trl_version is None:
            trl_version = _trl_version()
        raise ImportError(
            f"WeightSyncAsyncGRPOTrainer is written against TRL {TRL_LAYOUT}'s AsyncGRPOTrainer; the installed "
            f"TRL {trl_version} has {base.__module__}.{base.__qualname__} with " + "; ".join(problems)
            + f". Install trl=={TRL_LAYOUT}.* (or sync with WeightSyncCallback / WeightSync yourself)."
        )


def _trl_version() -> str:
    try:
        import trl

        return str(getattr(trl, "__version__", "unknown"))
    except ImportError:
        return "(not installed)"


def _async_grpo_trainer() -> type:
    try:
        from trl.experimental.async_grpo import AsyncGRPOTrainer
    except ImportError as e:
        raise ImportError(
            f"WeightSyncAsyncGRPOTrainer needs TRL {TRL_LAYOUT}'s trl.experimental.async_grpo; TRL {_trl_version()} "
            f"has none ({e})"
        ) from e
    return AsyncGRPOTrainer


def __getattr__(name: str) -> Any:  # WeightSyncAsyncGRPOTrainer is built on first access (TRL imported then)
    if name != "WeightSyncAsyncGRPOTrainer":
        raise AttributeError(name)
    cls = _build_class(_async_grpo_trainer())
    globals()[name] = cls
    return cls


def _build_class(base: type) -> type:
    check_trl_async_layout(base)
    from accelerate.utils import broadcast_object_list

    class WeightSyncAsyncGRPOTrainer(base):  # type: ignore[misc, valid-type]
        """TRL's ``AsyncGRPOTrainer`` whose weight sync is ``sync`` (a ``WeightSync``, or
        ``model -> WeightSync`` built at the first sync with the prepared model). Every other argument
        is ``AsyncGRPOTrainer``'s; ``weight_transfer=`` is refused. See the module docstring."""

        def __init__(self, *args: Any, sync: WeightSync | Callable[[Any], WeightSync], **kwargs: Any) -> None:
            if kwargs.get("weight_transfer") is not None:
                raise ValueError(
                    "WeightSyncAsyncGRPOTrainer: weight_transfer= is not taken (weightsync does the sync; "
                    "TRL gets a no-op transfer)"
                )
            self._weightsync = LateSync(sync, owner="WeightSyncAsyncGRPOTrainer", model_arg="model")
            kwargs["weight_transfer"] = NoWeightTransfer()
            super().__init__(*args, **kwargs)

        @property
        def weight_sync(self) -> WeightSync | None:
            """The ``WeightSync`` (None before the first sync when a factory was given)."""
            return self._weightsync.sync

        def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
            """In place of TRL's merged sync: every rank, from ``_sync_weight``."""
            ws = self._weightsync.build(self.model_wrapped if self.model_wrapped is not None else self.model)
            version = int(broadcast_object_list([self.model_version + 1 if self.accelerator.is_main_process else None])[0])
            t_start = time.time()
            report = ws.sync(version)
            t_end = time.time()
            for key, value in report.metrics().items():
                self._metrics["train"][key].append(value)
            if self.accelerator.is_main_process:
                self.model_version = version
                if self.rollout_worker:
                    self.rollout_worker.update_model_version(self.model_version)
            t_pause = t_start + report.pause_seconds
            return t_pause, t_pause, t_end

    WeightSyncAsyncGRPOTrainer.__module__ = __name__
    return WeightSyncAsyncGRPOTrainer
