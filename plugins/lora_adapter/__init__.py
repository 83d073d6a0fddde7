"""Adapter-only LoRA syncs: a sharded PEFT model's LoRA adapter (never the base weights) written as a
PEFT adapter folder and loaded by vLLM's LoRA serving, inside the usual pause / commit / resume.
See ``sync.py`` (``LoRAAdapterSync``) and ``docs/lora.md``."""

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
