"""Names a package exports lazily (PEP 562): the one implementation of every ``_LAZY`` table.

A package's public names often live in modules whose import costs seconds (vLLM, megatron-core,
transformers). Importing the package must not pay for them -- a loopback receiver process, a CLI
usage error or ``import weightsync.plugins`` stays cheap -- so the package keeps a table
``{name: module}`` and a name's module is imported when the name is first read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for module ``package``: ``table`` maps each lazy name to the module that
    defines it, absolute or relative to ``package`` (``".sync"``)."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(sys.modules[package].__dict__) | set(table))

    return __getattr__, __dir__
