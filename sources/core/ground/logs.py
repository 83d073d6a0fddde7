"""Logging with the trainer rank in every record.

Invariant: every weightsync logger carries a ``rank`` attribute on its records, read at emit time
(not at import time), so a log line from a multi-rank sync always says which rank wrote it even when
the process group is created after the logger.
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "current_rank"]


def current_rank() -> int:
    """This process's global rank: the default process group's if one exists, else ``$RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch always importable here
        pass
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = current_rank()
        return True


_FILTER = _RankFilter()


def get_logger(name: str) -> logging.Logger:
    """A logger under ``weightsync.`` whose records carry ``rank``.

    weightsync never configures handlers on the root logger; ``configure_logging`` in the CLI adds
    one whose format prints ``[rank N]``.
    """
    logger = logging.getLogger(name if name.startswith("weightsync") else f"weightsync.{name}")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


def configure_logging(level: int = logging.INFO) -> None:
    """Attach a stderr handler to the ``weightsync`` logger with the rank in each line (CLI, demo)."""
    root = logging.getLogger("weightsync")
    if any(getattr(h, "_weightsync", False) for h in root.handlers):
        root.setLevel(level)
        return
    handler = logging.StreamHandler()
    handler.addFilter(_FILTER)
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    handler._weightsync = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
