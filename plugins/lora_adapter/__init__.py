"""Adapter-only LoRA syncs: a sharded PEFT model's LoRA adapter (never the base weights) written as a
PEFT adapter folder and loaded by vLLM's LoRA serving, inside the usual pause / commit / resume.

* ``sync``   -- ``LoRAAdapterSync`` (the lifecycle: check, gather, write, pause, load, commit, resume)
  and ``AdapterRefusedError``;
* ``checks`` -- the servers' LoRA limits (``server_limits``) and the verdict on an adapter (``check_adapter``);
* ``files``  -- ``write_adapter``: the adapter folder, written atomically;
* ``report`` -- ``AdapterSyncReport``, what one adapter sync did.

May import: ``weightsync.sources`` (``LoRAAdapterSource``) and its ``toolkit``, vLLM's LoRA helpers
(lazily), and ``plugins.testbed`` (the layer below); never ``sync`` (its sibling layer) nor anything
above. See ``docs/lora.md``.
"""

from __future__ import annotations

from .sync import (
    MODES,
    AdapterRefusedError,
    AdapterSyncReport,
    LoRAAdapterSync,
    check_adapter,
    server_limits,
    write_adapter,
)

__all__ = [
    "MODES",
    "AdapterRefusedError",
    "AdapterSyncReport",
    "LoRAAdapterSync",
    "check_adapter",
    "server_limits",
    "write_adapter",
]
