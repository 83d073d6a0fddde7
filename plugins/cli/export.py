"""``weightsync export``: a Hugging Face safetensors checkpoint from CPU ranks, via ``save_safetensors``.

The model and source are the ones ``weightsync check`` runs (``build.build_source``: FSDP2 +
``FSDPSource``, or a megatron-core ``GPTModel`` + ``MegatronSource(mode="full")``), built from a
preset or a ``config.json`` with random weights (seed 0); every rank calls
``save_safetensors(source, --out, max_shard_bytes=--max-shard-size, config=the config,
overwrite=--overwrite)`` and rank 0 prints what was written. Exit 0 when the folder is in place, 1
when the export failed (nothing is left at ``--out``), 2 for usage errors -- including a non-empty
``--out`` without ``--overwrite``, caught before any rank starts. Only ``run_export`` imports
torch: the CLI validates its arguments (``validate_export``) before any heavy import.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..presets import UserError, load_config

__all__ = ["run_export", "validate_export", "parse_size"]


def parse_size(text: str) -> int:
    """``--max-shard-size``: bytes as an int, or digits + KB/MB/GB/TB (powers of 10, as transformers'
    ``max_shard_size`` parses them). Raises ``UserError``."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(text).strip()
    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text.upper())
    except ValueError as e:
        raise UserError(f"--max-shard-size {text!r}: {e}") from None
    if size <= 0:
        raise UserError(f"--max-shard-size {text!r} must be positive")
    return size


def validate_export(args: argparse.Namespace) -> None:
    """Usage errors of ``export`` (exit 2): the size, and ``--out`` (a file, or a non-empty folder
    without ``--overwrite``). Sets ``args.max_shard_bytes``."""
    args.max_shard_bytes = parse_size(args.max_shard_size)
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--out {args.out}: exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        raise UserError(f"--out {args.out}: folder exists and is not empty (pass --overwrite to replace it)")


def run_export(args: argparse.Namespace) -> int:
    """One export on every rank; rank 0 prints the report or the failure."""
    import torch
    import torch.distributed as dist

    from ..checkpoint import save_safetensors
    from .build import build_source
    from .demo import format_bytes

    rank = dist.get_rank()
    config = load_config(args.model, args.config, hidden=args.hidden, layers=args.layers)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        source = build_source(args, config, dtype)
        report = save_safetensors(
            source, args.out, max_shard_bytes=parse_size(args.max_shard_size), config=config, overwrite=args.overwrite
        )
    except Exception as e:  # noqa: BLE001 - a failed export is a verdict, in words
        if rank == 0:
            print(f"weightsync export: FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        rate = report.total_size / report.seconds / 1e6 if report.seconds > 0 else float("inf")
        print(
            f"weightsync export: {report.path}: {report.num_tensors} tensors, "
            f"{format_bytes(report.total_size)} in {report.num_shards} shard(s) "
            f"(largest {format_bytes(report.largest_shard_bytes)}), {report.seconds:.2f}s ({rate:.0f} MB/s), "
            f"written by rank {report.writer}; writer peak extra memory {format_bytes(report.peak_extra_bytes)}"
        )
        print(f"  files: {', '.join(report.files)}")
        print("PASS")
    return 0
