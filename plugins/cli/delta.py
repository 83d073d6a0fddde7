"""``weightsync demo --delta`` and ``weightsync check --delta``: delta sync on CPU ranks.

``demo --delta`` trains the demo's FSDP2 model (fp32 parameters) with Adam at an RL learning rate
(``--lr``, default 1e-6) and syncs it after every step through ``WeightSync(DeltaSource(FSDPSource
(model, dtype=bf16)), LoopbackSparseTrainerInitInfo(...))`` into a bf16 receiver process that applies
the patches through vLLM's own ``load_checkpoint_weight_patches`` -- the loop of ``loop.train_and_sync``,
with a cold-start sync (an anchor) before the first step. Per sync it prints whether the round was
an anchor, the changed fraction, the bytes on the wire against the dense sync's, and
whether the receiver equals the trainer: the sparse loopback engine's ``verify_round`` compares the
receiver's full tensors with a dense pass of the source and raises otherwise, so a sync that returns
is a verified one.

``check --delta`` builds the preset in the given layout (as ``check`` does), wraps its source in a
``DeltaSource`` and runs two rounds into a receiver on rank 0 that starts from zeros: an anchor,
then -- after a perturbation of about 2% of every rank's local parameter elements -- a delta round.
After each round rank 0 applies the patches through vLLM's ``load_checkpoint_weight_patches`` and
compares every tensor, bitwise, with a dense ``iter_full`` pass of the same source. PASS iff both
rounds match, the first is an anchor and the second is not, and the second changed some but not all
elements.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources.toolkit import get_logger

from ..testbed.presets import build_model, load_config
from .build import build_model_and_source, shard_fsdp2
from .common import format_bytes, layout_label, rank0_printer, share, sync_timeout_s
from .loop import DemoResult, Verdict, train_and_sync

__all__ = ["run_delta_demo", "run_check_delta", "DEFAULT_DELTA_LR"]

logger = get_logger(__name__)

#: An RL learning rate: most bf16 weights do not move in a step.
DEFAULT_DELTA_LR = 1e-6


def _receiver_model(config: Any, seed: int) -> torch.nn.Module:
    return build_model(config, seed).to(torch.bfloat16)


def run_delta_demo(
    *,
    steps: int = 3,
    preset: str = "tiny-qwen3",
    config_path: str | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    lr: float = DEFAULT_DELTA_LR,
    checksums: bool = True,
    out: Any = print,
) -> DemoResult:
    """The delta demo on the initialised default process group; every rank calls it. Returns the
    same ``DemoResult`` on every rank (``bytes``: the delta bytes sent). ``checksums=False`` skips
    the per-round dense pass: the syncs then count as not verified."""
    from weightsync.sources import DeltaSource, FSDPSource

    from ..loopback import LoopbackSparseTrainerInitInfo
    from ..loopback.receiver import ReceiverClient, start_receiver_process
    from ..sync import SyncReport, WeightSync

    rank, world = dist.get_rank(), dist.get_world_size()
    say = rank0_printer(out)
    config = load_config(preset, config_path, hidden=hidden, layers=layers)
    model = shard_fsdp2(build_model(config, seed=0))
    n_params = sum(p.numel() for p in model.parameters())
    result = DemoResult(steps=steps)
    handle, url = None, None
    if rank == 0:
        _, handle = start_receiver_process(functools.partial(_receiver_model, config, 1))
        url = handle.url
    url = share(url)
    try:
        delta = DeltaSource(FSDPSource(model, dtype=torch.bfloat16, expert_layout="fused"))
        info = LoopbackSparseTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, checksums=checksums)
        ws = WeightSync(delta, info, ReceiverClient(url), pause="keep", timeout_s=sync_timeout_s())
        say(
            f"weightsync demo --delta: {config.model_type} ({n_params:,} params, fp32 on the trainer, "
            f"bf16 on the wire) on {world} CPU rank(s), FSDP2 + DeltaSource(FSDPSource) -> loopback_sparse "
            f"receiver (pid {handle.pid if handle else '?'}), Adam lr {lr:g}, checksums={checksums}"
        )

        def verify(step: int, loss: float | None, rep: SyncReport, seconds: float) -> Verdict:
            # the sparse loopback engine's verify_round raised unless the receiver equals a dense pass
            verified = checksums and ws.engine.verified_rounds == step + 1
            sent = rep.delta_wire_bytes or 0
            frac = rep.changed_fraction or 0.0
            line = (
                ("  cold start (sync 0): " if loss is None else f"  sync {step}/{steps}: loss {loss:.4f}")
                + f" | {'anchor' if rep.delta_anchor else 'delta'}: {frac:.4%} changed "
                f"({rep.delta_changed:,}/{rep.delta_elements:,} elements, {rep.delta_tensors} tensors), "
                f"{format_bytes(sent)} sent vs {format_bytes(rep.delta_dense_bytes)} dense "
                f"({sent / max(rep.delta_dense_bytes, 1):.2%}), {seconds:.3f} s | receiver "
                + ("EQUALS the trainer (all tensors, bitwise, vs a dense pass)" if checksums and verified
                   else "not verified (--no-checksums)" if not checksums else "DIFFERS")
            )
            return Verdict(ok=bool(verified) if checksums else None, line=line, bytes=sent, seconds=seconds)

        optim = torch.optim.Adam(model.parameters(), lr=lr)
        train_and_sync(ws, model, optim, result, vocab_size=config.vocab_size, rank=rank, verify=verify, say=say,
                       cold_start=True)
        ws.shutdown()
    finally:
        if handle is not None:
            handle.stop()
    say(result.finish("weightsync demo --delta", world, config.model_type, n_params))
    return result


# ---- check --delta ---------------------------------------------------------------------------------


@torch.no_grad()
def _perturb(modules: list[torch.nn.Module], fraction: float = 0.02) -> None:
    """Change about ``fraction`` of every local parameter's elements, enough to move the bf16 value
    (x1.03 + 1e-3). The mask depends on the parameter's position and local shape only, so replicated
    parameters change alike on every rank that holds a copy."""
    k = 0
    for m in modules:
        for p in m.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            k += 1
            if not t.is_floating_point() or t.numel() == 0:
                continue
            gen = torch.Generator().manual_seed(7919 * k + t.numel())
            mask = torch.rand(t.shape, generator=gen) < fraction
            t[mask] = t[mask] * 1.03 + 1e-3


def run_check_delta(args: argparse.Namespace) -> int:
    """``check --delta`` (see the module docstring); every rank; returns the exit code."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from weightsync.sources import DeltaSource

    from ..loopback.receiver.receiver import CheckpointLoader

    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args.model, args.config, hidden=args.hidden, layers=args.layers)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16
    hf_model = build_model(config, seed=0) if args.layout == "fsdp" or rank == 0 else None
    modules, source = build_model_and_source(args, config, dtype, hf_model=hf_model)
    delta = DeltaSource(source)
    held: dict[str, torch.Tensor] = {}
    loader = None
    if rank == 0:
        held = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in delta.metadata}
        loader = CheckpointLoader({n: (i, t) for i, (n, t) in enumerate(held.items())})
    problems: list[str] = []
    lines = []
    for label in ("anchor", "delta"):
        if label == "delta":
            _perturb(modules)
        patches = []
        for p in delta.iter_patches():
            patches.append(CheckpointWeightPatch(p.name, tuple(p.full_shape), p.values.dtype, p.values, p.indices))
        if rank == 0 and patches:
            load_checkpoint_weight_patches(loader, patches)
        st = delta.last_round
        # vLLM's patches carry an int32 index beside every value (an anchor too: 3x its dense bf16
        # bytes); the loopback_sparse engine, and so `demo --delta`, send a tensor whole where that
        # is cheaper (an anchor always): the same round in those bytes, to compare with the demo's
        whole_when_cheaper = sum(
            min(v.numel() * v.element_size() + (0 if st.anchor else 4 * v.numel()), math.prod(shape) * v.element_size())
            for _, shape, _, v, _ in patches
        )
        differ = []
        for name, t in delta.source.iter_full():
            if rank == 0 and not torch.equal(held[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                differ.append(name)
        want_anchor = label == "anchor"
        if rank == 0:
            if differ:
                problems.append(f"{label} round: the receiver differs from a dense pass in {len(differ)} tensors: {differ[:5]}")
            if st.anchor != want_anchor:
                problems.append(f"{label} round: anchor={st.anchor}, expected {want_anchor}")
            if label == "delta" and not 0 < st.changed < st.elements:
                problems.append(f"delta round changed {st.changed} of {st.elements} elements")
            lines.append(
                f"  {label} round: {st.changed_fraction:.4%} changed ({st.changed:,}/{st.elements:,} elements, "
                f"{st.tensors} tensors), {format_bytes(st.wire_bytes)} as vLLM sparse patches (an int32 index "
                f"per value; {format_bytes(whole_when_cheaper)} whole where cheaper, as `demo --delta` sends) vs "
                f"{format_bytes(st.dense_bytes)} dense, trainer collectives {format_bytes(st.collective_bytes)}, snapshot "
                f"{format_bytes(st.snapshot_bytes)} (rank 0) | receiver "
                + ("EQUALS a dense pass" if not differ else f"DIFFERS in {len(differ)} tensors")
            )
    code = None
    if rank == 0:
        print(f"weightsync check --delta: {config.model_type} {layout_label(args, world)}, "
              f"{len(delta.metadata)} tensors, wire {str(dtype).removeprefix('torch.')}")
        for line in lines:
            print(line)
        for p in problems:
            print(f"  FAIL: {p}")
        code = 0 if not problems else 1
        print("PASS" if code == 0 else "FAIL")
    return int(share(code))
