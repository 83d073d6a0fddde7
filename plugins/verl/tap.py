"""The actor-side hook: verl's actor asks its engine for weights; weightsync answers with the engine.

verl 0.9.1's actor (``ActorRolloutRefWorker.update_weights``) does, on every actor rank::

    per_tensor_param, _ = self.actor.engine.get_per_tensor_param()
    await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)

and the checkpoint engine has no other handle on the model. ``install()`` (run when verl imports this
plugin as its ``custom_backend_module``) wraps ``get_per_tensor_param`` of verl's ``FSDPEngine`` and
``MegatronEngine`` so that a call **with no arguments** (that line; verl's colocated ``naive`` path and
LoRA syncs pass arguments and get verl's own result) returns ``EngineWeights``: a lazy iterable that
carries the engine. Invariants:

* nothing runs at the call: verl's own export (one all-gather per parameter for FSDP, Megatron-Bridge
  for Megatron) runs only if a consumer iterates ``EngineWeights`` -- any verl backend (nccl, nixl, ...)
  then gets exactly verl's stream, unchanged;
* the ``weightsync`` backend (``backend.py``) reads ``EngineWeights.engine`` instead and iterates
  weightsync's source of that engine (``stream.py``) on every actor rank, in lockstep, so verl's
  export never runs;
* ``install()`` is idempotent (verl imports the module on the actor, the rollout workers and the
  manager; a process may import it more than once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.sources.toolkit import get_logger

__all__ = ["EngineWeights", "install"]

logger = get_logger("weightsync.plugins.verl")

_WRAPPED = "__weightsync_tap__"


class EngineWeights:
    """What verl's ``engine.get_per_tensor_param()`` returns once the tap is installed.

    ``engine`` is verl's engine (``kind``: ``"fsdp"`` or ``"megatron"``); iterating the object runs
    verl's own ``get_per_tensor_param()`` and yields its ``(name, tensor)`` pairs."""

    def __init__(self, engine: Any, kind: str, verl_export: Callable[[], tuple[Any, Any]]) -> None:
        self.engine = engine
        self.kind = kind
        self._verl_export = verl_export

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        per_tensor_param, _ = self._verl_export()
        yield from per_tensor_param


def _wrap(cls: type, kind: str) -> None:
    original = cls.get_per_tensor_param
    if getattr(original, _WRAPPED, False):
        return

    def get_per_tensor_param(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if args or kwargs:  # verl's naive (colocated) and LoRA paths: verl's own result
            return original(self, *args, **kwargs)
        return EngineWeights(self, kind, lambda: original(self)), None

    setattr(get_per_tensor_param, _WRAPPED, True)
    get_per_tensor_param.__doc__ = original.__doc__
    get_per_tensor_param.__wrapped__ = original  # type: ignore[attr-defined]
    cls.get_per_tensor_param = get_per_tensor_param


def install() -> None:
    """Wrap verl 0.9.1's FSDP and Megatron engines' ``get_per_tensor_param`` (see the module docstring)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    _wrap(FSDPEngine, "fsdp")
    try:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    except ImportError as e:  # megatron-core absent: the FSDP engine alone is tapped
        logger.info("verl's Megatron engine not importable (%s): only the FSDP engine feeds weightsync", e)
    else:
        _wrap(MegatronEngine, "megatron")
