"""The README's main job: train a sharded model on CPU and sync it into a receiver after every step.

Under ``torchrun`` (or ``weightsync demo --nproc N``, which launches it): every rank builds the same
small transformers causal LM from a config (random init, no downloads), shards it with FSDP2 on a
CPU mesh (gloo), and trains it with AdamW on next-token cross-entropy over random ids. Rank 0 starts
a receiver process (``LoopbackReceiver`` behind vLLM's dev-mode HTTP routes) holding the same
architecture with *different* initial weights. After each step every rank syncs through
``WeightSync`` (``FSDPSource`` + vLLM's ``"loopback"`` trainer engine, pause ``keep``: the loop of
``loop.train_and_sync``); then every rank runs the FSDP forward on a fixed batch and rank 0 compares
those logits with the receiver's, computed in its own process.

A sync is *verified* iff the receiver's logits equal the trainer's bit for bit: same fp32 weights,
same CPU kernels, one thread each, eager attention -- nothing is allowed to differ, so no tolerance
is used. The demo prints one line per sync and a one-line summary; ``run_demo`` returns 0 only if
every sync verified.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..testbed.presets import build_model, load_config
from .build import shard_fsdp2
from .progress import phase
from .common import format_bytes, rank0_printer, share, sync_timeout_s
from .loop import DemoResult, Verdict, train_and_sync

__all__ = ["run_demo", "FP8_LOGITS_TOL"]

#: ``--quantize fp8``: the receiver's logits (FP8 weights, dequantized) may differ from the trainer's
#: by this much relative to the largest |logit|. e4m3 keeps 3 mantissa bits (relative rounding error
#: up to 1/16 per weight), and the rounding errors of a few layers' weights add up in the logits;
#: the margin over what the presets' tiny models show is recorded in docs/evidence.md.
FP8_LOGITS_TOL = 0.08


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        return model(input_ids=ids).logits.float()
    finally:
        model.train()


def run_demo(
    *,
    steps: int = 3,
    preset: str = "tiny-qwen3",
    config_path: str | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    packed: bool = True,
    checksums: bool = True,
    quantize: str | None = None,
    out: Any = print,
) -> DemoResult:
    """Run the demo on the initialized default process group; every rank calls it.

    ``quantize="fp8"``: the source is ``FP8Source(FSDPSource(...))`` (block-FP8 weights + scales) and
    the receiver holds an FP8 checkpoint's tensors (``FP8CheckpointModel``); a sync is verified when
    the wire checksums match and the receiver's dequantized logits are within ``FP8_LOGITS_TOL`` of
    the trainer's (relative to the largest |logit|). ``out`` prints on rank 0 only (the CLI passes
    ``print``). Returns the same ``DemoResult`` on every rank.
    """
    from weightsync.sources import FP8Source, FSDPSource

    from ..loopback import LoopbackTrainerInitInfo
    from ..loopback.receiver import ReceiverClient
    from ..sync import SyncReport, WeightSync

    rank, world = dist.get_rank(), dist.get_world_size()
    say = rank0_printer(out)
    config = load_config(preset, config_path, hidden=hidden, layers=layers)
    phase("building and sharding the model (FSDP2)")
    model = shard_fsdp2(build_model(config, seed=0))
    n_params = sum(p.numel() for p in model.parameters())

    # The receiver is a transformers model: MoE experts travel under its in-memory (fused) names,
    # a layout vLLM loads too; a dense model has none and is unaffected.
    source = FSDPSource(model, expert_layout="fused")
    if quantize == "fp8":
        source = FP8Source(source)
    elif quantize is not None:
        raise ValueError(f"quantize={quantize!r}: 'fp8' or None")
    qcfg = getattr(source, "quantization_config", None)
    result = DemoResult(steps=steps)
    phase("starting the loopback receiver (a transformers model in its own process)")
    handle, url, port = _start_receiver(config, rank, qcfg)
    try:
        client = ReceiverClient(url)
        info = LoopbackTrainerInitInfo(
            "127.0.0.1", port, 2, rank=rank, packed=packed, checksums=checksums
        )
        ws = WeightSync(source, info, client, pause="keep", timeout_s=sync_timeout_s())
        try:
            say(
                f"weightsync demo: {config.model_type} ({n_params:,} params, {config.num_hidden_layers} "
                f"layers, hidden {config.hidden_size}) on {world} CPU rank(s), FSDP2 + FSDPSource -> "
                f"loopback receiver (pid {handle.pid if handle else '?'}), packed={packed}, "
                f"checksums={checksums}" + (f", FP8 {qcfg['weight_block_size']} blocks" if qcfg else "")
            )
            # before any forward, as in a training loop: after a forward outside backward FSDP2 may
            # leave the root's parameters unsharded, and the optimizer must hold the sharded ones
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            eval_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
            trainer_logits = _logits(model, eval_ids)
            if rank == 0:
                before, _ = client.logits(eval_ids.tolist())
                rel = float((before - trainer_logits).abs().max() / trainer_logits.abs().max().clamp(min=1e-30))
                say(f"  before any sync: receiver logits equal trainer's: {torch.equal(before, trainer_logits)} "
                    f"(max rel |diff| {rel:.3g})")

            def verify(step: int, loss: float | None, report: SyncReport, seconds: float) -> Verdict:
                equal, diff, version = _compare_logits(model, client, eval_ids, rank)
                close = qcfg is not None and diff <= FP8_LOGITS_TOL
                equal = (equal or close) and version == f"step-{step}"
                src, wire = source.last_pass, ws.engine.last_send
                line = (
                    f"  sync {step}/{steps}: loss {loss:.4f} | {wire.tensors} tensors, "
                    f"{format_bytes(wire.bytes)}, {src.collectives} gathers + {wire.collectives} "
                    f"broadcasts, {report.send_seconds:.3f} s | receiver {version}: logits "
                    + (f"within FP8 tolerance (max rel |diff| {diff:.3g} <= {FP8_LOGITS_TOL})" if equal and close
                       else "EQUAL (bit-exact)" if equal else f"DIFFER (max rel |diff| {diff:.3g})")
                )
                return Verdict(ok=equal, line=line, bytes=wire.bytes, seconds=report.send_seconds)

            train_and_sync(ws, model, optim, result, vocab_size=config.vocab_size, rank=rank, verify=verify, say=say)
        finally:
            ws.shutdown()
    finally:
        if handle is not None:
            phase("stopping the loopback receiver")
            handle.stop()
    say(result.finish("weightsync demo", world, config.model_type, n_params))
    return result


def _start_receiver(config: Any, rank: int, quantization: dict | None = None) -> tuple[Any, str, int]:
    """Rank 0 starts the receiver process (the same architecture, other initial weights: seed 1;
    held as an FP8 checkpoint of ``quantization`` when given); every rank gets ``(handle or None,
    url, port)``. Port 0: the loopback sender binds a free port and tells the receiver."""
    from ..loopback.receiver import start_receiver_process
    from ..testbed.fp8_model import build_fp8_model

    handle, where = None, None
    if rank == 0:
        factory = (functools.partial(build_model, config, 1) if quantization is None
                   else functools.partial(build_fp8_model, config, 1, quantization))
        _, handle = start_receiver_process(factory)
        where = (handle.url, 0)
    url, port = share(where)
    return handle, url, port


def _compare_logits(
    model: torch.nn.Module, client: Any, eval_ids: torch.Tensor, rank: int
) -> tuple[bool, float, str]:
    """Every rank runs the FSDP forward; rank 0 compares the receiver's logits with it. Returns
    ``(bit-equal, max |diff| relative to the largest |logit|, the receiver's weight_version)`` on
    every rank."""
    trainer_logits = _logits(model, eval_ids)
    verdict = None
    if rank == 0:
        got, _ = client.logits(eval_ids.tolist())
        diff = float((got - trainer_logits).abs().max() / trainer_logits.abs().max().clamp(min=1e-30))
        verdict = (bool(torch.equal(got, trainer_logits)), diff, client.weight_version())
    return share(verdict)
