"""weightsync's stream of a verl engine: the source built from verl's engine, checked, in lockstep.

Invariants:

* **Source**: ``FSDPSource(engine.module)`` for verl's FSDP engine (FSDP2 / FSDP1 module as verl holds
  it), ``MegatronSource(engine.module, hf_config=engine.model_config.hf_config)`` for its Megatron
  engine (the model chunks and the HF config verl already holds); optionally wrapped in ``FP8Source``.
  Built once per engine and reused (its plan is cached); every actor rank builds and iterates it, so
  the collectives inside stay in lockstep.
* **Names** are what ``save_pretrained`` writes, which is what verl's rollout loads (verl's own FSDP
  export yields ``state_dict`` keys run through ``convert_weight_keys``: the same names for
  transformers models).
* **A bad tensor** (NaN or Inf, with ``check_finite``) stops what the rank yields at that tensor, but the
  rank keeps draining its source so its peers' collectives complete; at the end of every pass the
  actor ranks exchange their outcome (one bounded exchange on the default store, ``timeout_s``) and every rank
  raises ``BadTensorError`` naming the tensor and the rank that saw it. So no rank returns from a pass
  another rank failed, and nothing after the bad tensor is sent.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources import WeightSyncError
from weightsync.sources.toolkit import Board, get_logger, multi_rank, next_tag

from .options import VerlOptions

__all__ = ["BadTensorError", "engine_source", "engine_stream"]

logger = get_logger("weightsync.plugins.verl")

_SOURCES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class BadTensorError(WeightSyncError):
    """A tensor of the trainer's weights holds NaN or Inf; raised on every actor rank."""


def engine_source(engine: Any, kind: str, options: VerlOptions) -> Any:
    """weightsync's ``WeightSource`` over verl's engine (built on first use, then reused)."""
    source = _SOURCES.get(engine)
    if source is not None:
        return source
    from weightsync.sources import FP8Source, FSDPSource, MegatronSource

    if kind == "fsdp":
        source = FSDPSource(engine.module, dtype=options.dtype, check=options.check)
    elif kind == "megatron":
        modules = engine.module if isinstance(engine.module, (list, tuple)) else [engine.module]
        source = MegatronSource(list(modules), hf_config=engine.model_config.hf_config, dtype=options.dtype,
                                check=options.check)
    else:
        raise ValueError(f"weightsync.plugins.verl: no source for a verl engine of kind {kind!r}")
    if options.fp8:
        source = FP8Source(source, None if options.fp8 is True else options.fp8, check=options.check)
    _SOURCES[engine] = source
    logger.info("rank %d: weightsync %s for verl's %s engine", _rank(), type(source).__name__, kind)
    return source


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agree(bad: str | None, timeout_s: float) -> None:
    """Every actor rank learns every rank's outcome, within ``timeout_s`` (one bounded exchange on the
    default store, ``Board.exchange``: a dead or stopped peer is named in a ``SyncTimeoutError``
    instead of holding this rank for the process group's timeout); a bad tensor anywhere raises
    everywhere."""
    outcomes: dict[int, str] = {_rank(): bad or "ok"}
    if multi_rank():
        outcomes = Board(next_tag("verl-outcome")).exchange(
            bad or "ok", ranks=list(range(dist.get_world_size())), timeout_s=timeout_s,
            what="the verl sync's bad-tensor outcome exchange")
    for rank, what in sorted(outcomes.items()):
        if what != "ok":
            message = f"rank {_rank()}: weightsync refused the sync: {what} (seen on rank {rank})"
            logger.error("%s", message)
            raise BadTensorError(message)


def engine_stream(engine: Any, kind: str, options: VerlOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass of weightsync's source over verl's engine, on this actor rank (module docstring)."""
    source = engine_source(engine, kind, options)
    bad: str | None = None
    for name, tensor in source.iter_full():
        if bad is not None:
            continue  # drain: the peers' collectives of this pass must complete
        if options.check_finite and tensor.is_floating_point() and tensor.element_size() > 1 and not bool(torch.isfinite(tensor).all()):
            bad = f"tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} holds NaN or Inf"
            logger.error("rank %d: %s; draining the pass, nothing after it is sent", _rank(), bad)
            continue
        yield name, tensor
    _agree(bad, options.timeout_s)
