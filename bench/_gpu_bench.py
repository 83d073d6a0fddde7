"""What every GPU benchmark (``bench_gpu_*.py``) sets up the same way: its common flags, the device
and repetition counts (a dry run on CPU, else CUDA device 0), and its regression guard.

The guard records under ``.ci/gpu`` (``OUT`` set: the device machine's tree is thrown away, ``$OUT``
comes back) or with ``--record``, never for a dry run.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from _history import Guard


def parser(doc: str, *, dry_help: str = "CPU, tiny model, loopback transport") -> argparse.ArgumentParser:
    """``--reps``, ``--warmup``, ``--dry-run``, ``--json``, ``--record``; the bench adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help=dry_help)
    ap.add_argument("--json", default=None)
    ap.add_argument("--record", action="store_true", help="append this run's ratios to bench/results/history.jsonl")
    return ap


def device_and_reps(args: argparse.Namespace, facts: Any) -> tuple[str, int, int] | None:
    """``(device, reps, warmup)``; None (after a failed "CUDA available" check) without CUDA."""
    if args.dry_run:
        return "cpu", 2, 1
    import torch

    if not torch.cuda.is_available():
        facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
        return None
    torch.cuda.set_device(0)
    return "cuda:0", args.reps, args.warmup


def guard(bench: str, shape: str, args: argparse.Namespace, *, record: bool = True) -> Guard:
    """The bench's ``Guard`` for ``shape`` (a dry run is its own shape); ``record=False`` never
    records (a deliberate slowdown, a profile)."""
    wants = args.record or (bool(os.environ.get("OUT")) and not args.dry_run)
    return Guard(bench, shape + (" dry-run" if args.dry_run else ""), record=record and wants,
                 printer=lambda line: None)  # facts.check prints it
