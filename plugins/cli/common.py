"""What the CLI's commands share: the CPU process group, one value from rank 0 to every rank, rank 0's
voice, byte counts and layouts in words.

Invariant: each helper behaves the same on every rank of the default process group (``share`` is a
collective every rank calls; ``rank0_printer`` is a no-op on the others), so a command's rank code
can call them without branching on the rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["TIMEOUT_ENV", "sync_timeout_s", "init_cpu_process_group", "share", "rank0_printer", "format_bytes", "layout_label"]


#: The CLI's sync timeout in seconds, from the environment (default: weightsync's ``DEFAULT_TIMEOUT_S``).
TIMEOUT_ENV = "WEIGHTSYNC_TIMEOUT_S"


def sync_timeout_s() -> float:
    """The bound every demo's ``WeightSync`` gets (``timeout_s``) and the trainer's own process group
    gets too (``init_cpu_process_group``): ``$WEIGHTSYNC_TIMEOUT_S``, else weightsync's default."""
    from weightsync.sources.toolkit import DEFAULT_TIMEOUT_S

    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else float(DEFAULT_TIMEOUT_S)


def init_cpu_process_group() -> None:
    """The default process group for the demo/check/export: gloo, from torchrun's env, or a 1-rank one.

    Its timeout is the sync timeout (``sync_timeout_s``): weightsync bounds its own waits inside a
    sync, but between syncs a rank waits in the trainer's collectives (FSDP2's all-gathers, the
    demo's checks), which only the process group's timeout bounds -- gloo's default is 30 minutes.
    With the same bound a stopped peer ends the job within about the sync timeout wherever the
    other ranks wait (the launcher then kills the stopped rank: ``launch``)."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=sync_timeout_s())
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        # one rank: an in-process store, no port to pick
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def share(obj: Any) -> Any:
    """Collective: rank 0's ``obj`` on every rank (``broadcast_object_list`` from rank 0)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_printer(out: Callable[..., Any]) -> Callable[..., Any]:
    """``out`` on rank 0, a no-op on every other rank: what a command prints, once."""
    return out if dist.get_rank() == 0 else (lambda *a, **k: None)


def format_bytes(n: float) -> str:
    """``n`` bytes in words: ``"512 B"``, ``"1.5 KB"``, ... ``"GB"`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def layout_label(args: argparse.Namespace, world: int) -> str:
    """The layout ``check`` / ``check --delta`` ran, in words (``fsdp x2``, ``megatron tp2 pp1 vpp1 ep1 x2``)."""
    if getattr(args, "layout", "fsdp") != "megatron":
        return f"fsdp x{world}"
    return f"megatron tp{args.tp} pp{args.pp} vpp{args.vpp or 1} ep{args.ep} x{world}"
