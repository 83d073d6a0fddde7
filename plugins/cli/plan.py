"""``weightsync plan``: what one refit of a model moves and costs (``weightsync.plugins.planner``).

Runs in this process on CPU: the model is built on the meta device, no rank is launched, no weight
allocated, no collective run. Prints per source the checkpoint tensors, bytes (total and per
sender), per-rank collectives and bytes received, peak extra memory and a time estimate in parts,
with every assumed constant named, and which transport it assumed (``--backend``; the README's
"What to expect" timings are ``--backend ipc``); ``--json`` prints the same as one JSON object.
Exit 0, or 2 for a usage error: one line naming the flag the user typed, never a traceback. The
layout is checked by the rules ``check`` applies (``testbed.layout_rules``), so a layout ``check``
refuses is never planned.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

__all__ = ["add_parser", "run_plan", "BACKEND_HELP"]

#: ``--backend`` choices, each with what it models (the plan's "transport" line lists the others)
BACKEND_HELP = {
    "nccl": "vLLM's NCCL engine, rank 0 sending over the network (separate inference GPUs)",
    "ipc": "vLLM's IPC engine, colocated on the trainer's GPUs (the README's 'What to expect' timings)",
    "sparse": "vLLM's sparse_nccl, DeltaSource rounds (with --changed FRACTION)",
}


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
    p.add_argument("--tp", type=int, default=None, help="--layout megatron: tensor parallel (default 1)")
    p.add_argument("--pp", type=int, default=None, help="--layout megatron: pipeline stages (default 1)")
    p.add_argument("--vpp", type=int, default=None, help="--layout megatron: virtual stages per pipeline stage")
    p.add_argument("--ep", type=int, default=None, help="--layout megatron: expert parallel (default 1)")
    p.add_argument("--backend", choices=BACKEND_HELP, default=None,
                   help="the transport: " + "; ".join(f"{k}: {v}" for k, v in BACKEND_HELP.items())
                   + " (default nccl)")
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
    """Validate, plan and print; 0, or 2 with one line naming the flag for a bad argument."""
    from ..planner import plan, render
    from .progress import heartbeat, phase

    try:
        _validate(args)
        with heartbeat("plan"):  # torch and transformers load, the model is built on meta: seconds
            phase("building the model on the meta device")
            p = plan(
                args.config or args.model or "tiny-qwen3", layout=args.layout, world=args.world, replicas=args.replicas,
                tp=args.tp or 1, pp=args.pp or 1, vpp=args.vpp, ep=args.ep or 1, backend=args.backend or "nccl",
                senders=args.senders, changed=args.changed, fp8=args.quantize == "fp8", dtype=args.dtype,
                expert_layout=args.expert_layout, device=args.device, wire_gbps=args.wire_gbps,
                gather_gbps=args.gather_gbps, ipc_packed=args.ipc_packed,
            )
    except (ValueError, TypeError) as e:
        print(f"weightsync: error: {as_flags(str(e), args)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.as_dict(), indent=1))
    else:
        print(render(p))
        print(transport_line(args.backend))
    return 0


def transport_line(chosen: str | None) -> str:
    """Which transport the plan assumed and how to get the others: the default (NCCL, one sender)
    is not what the README's "What to expect" table measured (IPC), and a user comparing the two
    must know to pass ``--backend ipc``."""
    backend = chosen or "nccl"
    how = "assumed: the default, pass --backend to change it" if chosen is None else "from --backend"
    others = "; ".join(f"--backend {k}: {v}" for k, v in BACKEND_HELP.items() if k != backend)
    return f"  transport: {backend} ({how}); {others}"


def _validate(args: argparse.Namespace) -> None:
    """The usage checks ``check`` makes, on ``plan``'s flags: the preset or config.json exists and
    is readable, ``--tp/--pp/--vpp/--ep`` only with ``--layout megatron`` and then by the same layout
    rules, ``--dtype`` a torch dtype. Raises ``UserError`` naming the flag."""
    from ..testbed.layout_rules import check_megatron_layout
    from ..testbed.presets import UserError, config_facts
    from .validate import TORCH_DTYPES, layout_options

    if args.model and args.config:
        raise UserError("give --model or --config, not both")
    facts = config_facts(args.model, args.config)
    layout_options(args)
    if args.world is not None and args.world < 1:
        raise UserError(f"--world {args.world} must be >= 1")
    if args.layout == "megatron":
        world = args.world if args.world is not None else args.tp * args.pp * args.ep
        check_megatron_layout(facts, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, world=world,
                              world_flag="world")
    if args.dtype not in TORCH_DTYPES:
        raise UserError(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float32)")


#: ``planner.plan()``'s keyword arguments, as the CLI's flags spell them
_FLAGS = {"world": "--world", "replicas": "--replicas", "tp": "--tp", "pp": "--pp", "vpp": "--vpp", "ep": "--ep",
          "backend": "--backend", "senders": "--senders", "changed": "--changed", "dtype": "--dtype",
          "expert_layout": "--expert-layout", "device": "--device", "wire_gbps": "--wire-gbps",
          "gather_gbps": "--gather-gbps", "ipc_packed": "--ipc-packed", "layout": "--layout"}


def as_flags(message: str, args: argparse.Namespace) -> str:
    """``planner.plan()`` words its refusals for Python callers (``backend='ipc'``, ``world=3``);
    the CLI user typed flags: ``--backend ipc``, ``--world 3``, ``--config PATH`` for ``model=``."""
    flags = dict(_FLAGS, model="--config" if args.config else "--model")

    def one(m: re.Match) -> str:
        flag = flags[m.group(1)]
        value = m.group(3)
        return f"{flag} {value}" if value else flag

    return re.sub(r"\b(" + "|".join(flags) + r")=('?)([^\s,;'()]*)\2", one, message)
