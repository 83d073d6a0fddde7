"""``weightsync plan``: what one refit of a model moves and costs (``weightsync.plugins.planner``).

Runs in this process on CPU: the model is built on the meta device, no rank is launched, no weight
allocated, no collective run. Prints per source the checkpoint tensors, bytes (total and per
sender), per-rank collectives and bytes received, peak extra memory and a time estimate in parts,
with every assumed constant named; ``--json`` prints the same as one JSON object. Exit 0, or 2 for a
usage error (one line naming the argument).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser", "run_plan"]


def add_parser(sub: argparse._SubParsersAction, presets: str) -> argparse.ArgumentParser:
    """Register ``plan`` on the CLI's sub-parsers."""
    p = sub.add_parser(
        "plan",
        help="predict what a refit moves and costs (tensors, bytes, collectives, time) without running it",
        description="Build the model on the meta device from a preset or config.json, apply a trainer "
        "layout and a transfer backend, and print what one refit moves and costs: checkpoint tensors, "
        "bytes per sender, collectives and bytes received per rank, peak extra memory, and a time "
        "estimate split into trainer gathers, per-tensor host work, wire and receiver apply. Constants "
        "that were not measured are named. Exit 0, 2 for usage errors.",
    )
    p.add_argument("--model", default=None, help=f"preset: {presets} (default tiny-qwen3)")
    p.add_argument("--config", help="a transformers config.json (file or directory) instead of --model")
    p.add_argument("--layout", choices=("fsdp", "megatron"), default="fsdp")
    p.add_argument("--world", type=int, default=None,
                   help="trainer ranks (fsdp: default 1; megatron: default tp*pp*ep, more are data-parallel replicas)")
    p.add_argument("--replicas", type=int, default=1, help="HSDP replicas (--layout fsdp; world = replicas x shard)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--backend", choices=("ipc", "nccl", "sparse"), default="nccl")
    p.add_argument("--senders", choices=("rank0", "owners"), default="rank0",
                   help="nccl: one sender (rank0) or each HSDP replica's first rank (owners, vLLM 0.34)")
    p.add_argument("--changed", type=float, default=None, help="--backend sparse: fraction of elements changed per round")
    p.add_argument("--quantize", choices=("fp8",), default=None, help="FP8Source: block-FP8 weights + scales")
    p.add_argument("--dtype", default="bfloat16", help="wire dtype (default bfloat16)")
    p.add_argument("--expert-layout", choices=("per_expert", "fused"), default=None)
    p.add_argument("--ipc-packed", action="store_true",
                   help="--backend ipc with vLLM's packed buffers (default: one IPC handle per tensor, vLLM's default)")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="which measured constants to use")
    p.add_argument("--wire-gbps", type=float, default=None, help="GB/s of one sender's link to the inference engines")
    p.add_argument("--gather-gbps", type=float, default=None, help="GB/s of the trainer's gathers per rank")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Plan and print; 0, or 2 with one line for a bad argument."""
    from ..planner import plan, render

    if args.model and args.config:
        print("weightsync: error: give --model or --config, not both", file=sys.stderr)
        return 2
    try:
        p = plan(
            args.config or args.model or "tiny-qwen3", layout=args.layout, world=args.world, replicas=args.replicas,
            tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, backend=args.backend, senders=args.senders,
            changed=args.changed, fp8=args.quantize == "fp8", dtype=args.dtype, expert_layout=args.expert_layout,
            device=args.device, wire_gbps=args.wire_gbps, gather_gbps=args.gather_gbps, ipc_packed=args.ipc_packed,
        )
    except (ValueError, TypeError) as e:
        print(f"weightsync: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.as_dict(), indent=1) if args.json else render(p))
    return 0
