"""What a source or stream transform declares it can do, read one way everywhere (the source-side twin
of ``plugins/sync/capabilities.py``; docs/design.md "Capabilities").

* ``checks_stream`` -- the source checks its own stream against its metadata on every pass, so
  ``CheckedSource`` need not check it again (default False);
* ``senders`` -- ``"rank0"`` (default) or ``"owners"`` (each tensor sent by its first owner);
* the delta round API (``RoundSource``: ``iter_patches``, ``iter_deltas``, ``reset``), which picks the
  sparse send phase in the driver and in the loopback alike;
* the pieces protocol (``PiecesSource``, ``core/layouts/pieces.py``) and ``ReportsChecksums``.

Invariant: a capability is what the object itself declares -- its class, or its own attributes --
never what a wrapper's ``__getattr__`` forwards from the source it wraps (lookups go through
``inspect.getattr_static``). A new transform that declares nothing therefore has none: its stream is
checked, it sends from rank 0, it is no round source. Forwarding had made a transform inherit its
inner source's ``checks_stream`` and silently skip the check of what the transform itself yields.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from .layouts.pieces import PiecesSource, has_pieces

__all__ = [
    "PiecesSource", "ReportsChecksums", "RoundSource", "checks_stream", "declared", "has_pieces",
    "is_round_source", "senders_of",
]

#: the delta round API (``DeltaSource``)
ROUND_METHODS = ("iter_patches", "iter_deltas", "reset")


@runtime_checkable
class RoundSource(Protocol):
    """A source of delta rounds (``DeltaSource``): what a sparse engine is fed from."""

    def iter_patches(self) -> Iterator[Any]: ...

    def iter_deltas(self, *, whole_when_cheaper: bool = False) -> Iterator[Any]: ...

    def reset(self) -> None: ...


@runtime_checkable
class ReportsChecksums(Protocol):
    """A source that records each yielded tensor's integrity checksum (``CheckedSource(checksums=True)``)."""

    last_checksums: dict[str, str]


def declared(src: object, name: str, default: Any = None) -> Any:
    """``src.name`` if ``src`` itself declares it (class or instance attribute, property), else
    ``default`` -- never a value a ``__getattr__`` forwards from a wrapped source."""
    try:
        inspect.getattr_static(src, name)
    except AttributeError:
        return default
    return getattr(src, name)


def checks_stream(src: object) -> bool:
    """Whether ``src`` checks its own stream against its metadata on every pass."""
    return bool(declared(src, "checks_stream", False))


def senders_of(src: object) -> str:
    """Who sends ``src``'s tensors: ``"rank0"`` or ``"owners"``."""
    return str(declared(src, "senders", "rank0"))


def is_round_source(src: object) -> bool:
    """Whether ``src`` has the delta round API (``RoundSource``) of its own."""
    return src is not None and all(callable(declared(src, m)) for m in ROUND_METHODS)
