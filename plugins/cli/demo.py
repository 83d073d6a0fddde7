"""The README's main job: train a sharded model on CPU and sync it into a receiver after every step.

Under ``torchrun`` (or ``weightsync demo --nproc N``, which launches it): every rank builds the same
small transformers causal LM from a config (random init, no downloads), shards it with FSDP2 on a
CPU mesh (gloo), and trains it with AdamW on next-token cross-entropy over random ids. Rank 0 starts
a receiver process (``LoopbackReceiver`` behind vLLM's dev-mode HTTP routes) holding the same
architecture with *different* initial weights. After each step every rank calls
``engine.send_weights()`` on a loopback engine built by vLLM's ``WeightTransferTrainerFactory``
over an ``FSDPSource``; then every rank runs the FSDP forward on a fixed batch and rank 0 compares
those logits with the receiver's, computed in its own process.

A sync is *verified* iff the receiver's logits equal the trainer's bit for bit: same fp32 weights,
same CPU kernels, one thread each, eager attention -- nothing is allowed to differ, so no tolerance
is used. The demo prints one line per sync and a one-line summary; ``run_demo`` returns 0 only if
every sync verified.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources.toolkit import get_logger

from ..testbed.presets import build_model, load_config
from .build import shard_fsdp2

__all__ = ["DemoResult", "run_demo", "progress", "FP8_LOGITS_TOL"]

#: ``--quantize fp8``: the receiver's logits (FP8 weights, dequantized) may differ from the trainer's
#: by this much relative to the largest |logit|. e4m3 keeps 3 mantissa bits (relative rounding error
#: up to 1/16 per weight); measured on the presets' tiny models after a few steps: 0.01-0.03.
FP8_LOGITS_TOL = 0.08

logger = get_logger(__name__)


#: The demo running in this process (``progress``: what Ctrl-C reports).
_CURRENT: "DemoResult | None" = None


@dataclass
class DemoResult:
    """One demo's tally. ``steps``: the syncs asked for (one per training step); creating a result
    makes it this process's current demo, which ``progress`` reads. ``failed_extra``: checks outside
    the counted syncs that failed (the delta demo's cold-start anchor)."""

    steps: int = 0
    syncs: int = 0
    verified: int = 0
    bytes: int = 0
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)
    summary: str = ""
    failed_extra: int = 0

    def __post_init__(self) -> None:
        global _CURRENT
        _CURRENT = self

    @property
    def ok(self) -> bool:
        return self.syncs > 0 and self.verified == self.syncs and not self.failed_extra

    def finish(self, demo: str, world: int, model: str, n_params: int, target: str = "") -> str:
        """Set and return the one summary line every demo ends with (``target``: what it synced into)."""
        self.summary = (
            f"{demo}: {self.verified}/{self.syncs} syncs verified, "
            f"{format_bytes(self.bytes)} sent in {self.seconds:.2f} s "
            f"({world} ranks, {model}, {n_params:,} params) -> {target}" + ("PASS" if self.ok else "FAIL")
        )
        return self.summary


def progress() -> tuple[int, int]:
    """``(syncs done, syncs asked for)`` of the demo running in this process ((0, 0) before one starts)."""
    return (_CURRENT.syncs, _CURRENT.steps) if _CURRENT is not None else (0, 0)


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        return model(input_ids=ids).logits.float()
    finally:
        model.train()


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def _share(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.sources import FP8Source, FSDPSource

    from ..loopback import LoopbackTrainerInitInfo
    from ..loopback.receiver import ReceiverClient

    rank, world = dist.get_rank(), dist.get_world_size()
    say = out if rank == 0 else (lambda *a, **k: None)
    config = load_config(preset, config_path, hidden=hidden, layers=layers)
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
    handle, url, port = _start_receiver(config, rank, qcfg)
    try:
        client = ReceiverClient(url)
        info = LoopbackTrainerInitInfo(
            "127.0.0.1", port, 2, rank=rank, packed=packed, checksums=checksums
        )
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        say(
            f"weightsync demo: {config.model_type} ({n_params:,} params, {config.num_hidden_layers} "
            f"layers, hidden {config.hidden_size}) on {world} CPU rank(s), FSDP2 + FSDPSource -> "
            f"loopback receiver (pid {handle.pid if handle else '?'}), packed={packed}, "
            f"checksums={checksums}" + (f", FP8 {qcfg['weight_block_size']} blocks" if qcfg else "")
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as in DP
        eval_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
        trainer_logits = _logits(model, eval_ids)
        if rank == 0:
            before, _ = client.logits(eval_ids.tolist())
            rel = float((before - trainer_logits).abs().max() / trainer_logits.abs().max().clamp(min=1e-30))
            say(f"  before any sync: receiver logits equal trainer's: {torch.equal(before, trainer_logits)} "
                f"(max rel |diff| {rel:.3g})")

        for step in range(1, steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()

            t0 = time.perf_counter()
            engine.send_weights(weight_version=f"step-{step}")
            seconds = time.perf_counter() - t0
            equal, diff, version = _compare_logits(model, client, eval_ids, rank)
            close = qcfg is not None and diff <= FP8_LOGITS_TOL
            equal = (equal or close) and version == f"step-{step}"
            src, wire = source.last_pass, engine.last_send
            result.syncs += 1
            result.verified += int(equal)
            result.bytes += wire.bytes
            result.seconds += seconds
            line = (
                f"  sync {step}/{steps}: loss {loss.item():.4f} | {wire.tensors} tensors, "
                f"{format_bytes(wire.bytes)}, {src.collectives} gathers + {wire.collectives} "
                f"broadcasts, {seconds:.3f} s | receiver {version}: logits "
                + (f"within FP8 tolerance (max rel |diff| {diff:.3g} <= {FP8_LOGITS_TOL})" if equal and close
                   else "EQUAL (bit-exact)" if equal else f"DIFFER (max rel |diff| {diff:.3g})")
            )
            result.lines.append(line)
            say(line)
    finally:
        if handle is not None:
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
    url, port = _share(where)
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
    return _share(verdict)


def init_cpu_process_group() -> None:
    """The default process group for the demo/check: gloo, from torchrun's env, or a 1-rank one."""
    import datetime

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        # one rank: an in-process store, no port to pick
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=300)
        )
