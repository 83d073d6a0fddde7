"""What a training-loop hook drives: a full ``WeightSync`` or an adapter-only ``LoRAAdapterSync``,
given now or built by a factory once the framework prepared (sharded) the model -- and the hooks'
one adapter-only option, ``adapter_only=``.

Invariants, and why:

* **One option switches a hook to adapter-only.** ``adapter_only="/shared/adapters"`` (the folder
  the vLLM server reads; or a dict of ``LoRAAdapterSync`` keyword arguments holding ``adapter_dir``)
  makes the hook build ``LoRAAdapterSync(model, ws.client, every=ws.every, pause=ws.pause_mode,
  clear_cache=ws.clear_cache, version_fn=ws.version_fn, timeout_s=ws.timeout_s, **options)`` from
  the ``WeightSync`` it was given (or its factory returned) and the model the framework hands the
  hook: same client, same cadence (``every``, ``should_sync``: the step semantics of the hook's
  normal path), same pause mode and version strings. The ``WeightSync`` itself never syncs (its
  transfer engine is built at a first sync, which never comes). A dict's keys override those.
* **A ``LoRAAdapterSync`` is taken as is** (given, or returned by the factory): the hook drives it
  like a ``WeightSync`` (``sync(step)``, ``should_sync``, ``last_report``, ``report.metrics()``).
  Passing ``adapter_only=`` as well is refused: the sync is already adapter-only.
* **A model without a LoRA adapter fails at the hook's first call, on every rank alike** (module
  structure only), as ``UnsupportedAdapterError`` naming the hook, the option and the rank, and
  saying to drop ``adapter_only=`` to send the whole (merged) model.
* **Bad arguments fail at the hook's construction** (before training starts): a ``sync`` of another
  type, ``adapter_only=True`` (no folder), a dict without ``adapter_dir`` or with a key
  ``LoRAAdapterSync`` does not take.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, Union

from weightsync.sources import UnsupportedAdapterError
from weightsync.sources.toolkit import get_logger

from ..lora_adapter import LoRAAdapterSync
from ..sync.driver import WeightSync

__all__ = ["HookSync", "AnySync", "adapter_options"]

logger = get_logger("weightsync.plugins.hooks")

#: what a hook drives
AnySync = Union[WeightSync, LoRAAdapterSync]

#: ``LoRAAdapterSync`` keyword arguments ``adapter_only={...}`` may carry (all but the model and client)
_ADAPTER_KEYS = tuple(n for n in inspect.signature(LoRAAdapterSync.__init__).parameters if n not in ("self", "model", "client"))


def adapter_options(adapter_only: Any, owner: str) -> dict[str, Any] | None:
    """``adapter_only=`` as ``LoRAAdapterSync`` keyword arguments (None: full syncs). Raises
    ``TypeError`` / ``ValueError`` naming ``owner`` for anything else."""
    if adapter_only is None or adapter_only is False:
        return None
    if adapter_only is True:
        raise ValueError(f"{owner}: adapter_only=True needs the folder the vLLM server reads adapters from: "
                         "adapter_only='/shared/adapters' (or a dict of LoRAAdapterSync arguments with adapter_dir)")
    if isinstance(adapter_only, (str, os.PathLike)):
        if not os.fspath(adapter_only):
            raise ValueError(f"{owner}: adapter_only must name a folder, got ''")
        return {"adapter_dir": os.fspath(adapter_only)}
    if isinstance(adapter_only, Mapping):
        opts = dict(adapter_only)
        unknown = sorted(set(opts) - set(_ADAPTER_KEYS))
        if unknown:
            raise TypeError(f"{owner}: adapter_only has key(s) {unknown} that LoRAAdapterSync does not take "
                            f"(it takes {list(_ADAPTER_KEYS)})")
        if not opts.get("adapter_dir"):
            raise ValueError(f"{owner}: adapter_only={{...}} must hold adapter_dir, the folder the vLLM server "
                             "reads adapters from")
        return opts
    raise TypeError(f"{owner}: adapter_only must be a folder path or a dict of LoRAAdapterSync arguments, "
                    f"got {type(adapter_only).__name__}")


class HookSync:
    """The sync a hook drives (module docstring): given now, or ``factory(model)`` at the hook's
    first call; with ``adapter_only``, the ``LoRAAdapterSync`` built from it.

    Args:
        sync: a ``WeightSync`` or ``LoRAAdapterSync``, or ``model -> either``.
        owner: the hook's name, for messages.
        model_arg: what the factory is called with, for messages (``model``, ``pl_module``).
        adapter_only: the hooks' option (``adapter_options``).
    """

    def __init__(self, sync: AnySync | Callable[[Any], AnySync], *, owner: str, model_arg: str,
                 adapter_only: Any = None) -> None:
        if not isinstance(sync, (WeightSync, LoRAAdapterSync)) and not callable(sync):
            raise TypeError(
                f"{owner}: sync must be a WeightSync or a callable {model_arg} -> WeightSync, got "
                f"{type(sync).__name__} (a LoRAAdapterSync, or a factory returning one, is taken too)"
            )
        self._owner = owner
        self._options = adapter_options(adapter_only, owner)
        if isinstance(sync, LoRAAdapterSync) and self._options is not None:
            raise ValueError(f"{owner}: sync is a LoRAAdapterSync (adapter-only already); drop adapter_only=")
        self._given = sync if isinstance(sync, (WeightSync, LoRAAdapterSync)) else None
        self._factory = None if self._given is not None else sync
        #: the sync the hook drives; None until ``build`` ran (always, with ``adapter_only``)
        self.sync: AnySync | None = None if self._options is not None else self._given

    @property
    def adapter_only(self) -> bool:
        return self._options is not None

    def build(self, model: Any) -> AnySync:
        """The sync, built the first time: the factory called with ``model``, then, with
        ``adapter_only``, the ``LoRAAdapterSync`` of ``model`` (module docstring)."""
        if self.sync is not None:
            return self.sync
        built = self._given if self._given is not None else self._factory(model)  # type: ignore[misc]
        if not isinstance(built, (WeightSync, LoRAAdapterSync)):
            raise TypeError(f"{self._owner}: the sync factory returned {type(built).__name__}, not a WeightSync "
                            "(or LoRAAdapterSync)")
        if self._options is not None:
            if isinstance(built, LoRAAdapterSync):
                raise ValueError(f"{self._owner}: the sync factory returned a LoRAAdapterSync (adapter-only "
                                 "already); drop adapter_only=")
            built = self._adapter_sync(built, model)
        self.sync = built
        return built

    def _adapter_sync(self, ws: WeightSync, model: Any) -> LoRAAdapterSync:
        opts = dict(every=ws.every, pause=ws.pause_mode, clear_cache=ws.clear_cache, version_fn=ws.version_fn,
                    timeout_s=ws.timeout_s)
        opts.update(self._options or {})
        try:
            sync = LoRAAdapterSync(model, ws.client, **opts)
        except UnsupportedAdapterError as e:
            raise UnsupportedAdapterError(
                f"{self._owner}(adapter_only=...): {e}. adapter_only sends a PEFT LoRA adapter; drop it to "
                "send the whole (merged) model"
            ) from e
        logger.info("%s: adapter-only: LoRAAdapterSync(%r, every=%d, lora_name=%r, adapter_dir=%s) in place of "
                    "the WeightSync (its client, cadence and pause mode)", self._owner, sync.source, sync.every,
                    sync.lora_name, sync.adapter_dir)
        return sync
