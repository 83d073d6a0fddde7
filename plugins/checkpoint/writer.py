"""``save_safetensors``: a Hugging Face checkpoint folder straight from any ``WeightSource``.

Called collectively on every rank with the same source (``FSDPSource``, ``MegatronSource``, a
``checked()`` one, vLLM's ``ModuleSource``); it drives ``iter_full()`` exactly once and the *writer*
-- the lowest rank that owns every tensor (rank 0 for FSDP2 and ``MegatronSource(mode="full")``) --
streams each tensor into its planned place as it arrives. What it guarantees:

* **Same files as ``save_pretrained``.** File names, the split, headers, data order and the index are
  planned from ``metadata`` before any byte moves (``plan``), byte-identical to transformers
  5 for the same tensors; ``config.json`` and ``generation_config.json`` are written with transformers'
  own ``save_pretrained`` of a copy of the config (``dtype`` = the first floating wire dtype,
  ``architectures`` = the model class), as ``save_pretrained`` does.
* **Writes overlap the source.** The writer's host copies and ``pwrite``s run on a thread
  (``queue.WriteQueue``) while the calling thread drives the source on (its next gathers and
  collectives); ``write_queue_bytes=0`` writes synchronously.
* **Bounded memory.** The writer holds the plan's headers plus at most one tensor's host copy (none
  for a contiguous CPU tensor: its bytes go from the tensor to the file), never a shard, never the
  model; ``SaveReport.peak_extra_bytes`` is that figure, tracked. On top, the write queue keeps
  yielded tensors until they are written: at most ``max(write_queue_bytes, largest tensor)``
  (default 256 MiB), measured as ``SaveReport.peak_queued_bytes``. What the source itself holds
  during its pass (an FSDP unit's gather, the next one posted ahead) is the source's, as for any sync.
* **Checked stream.** The source runs under ``checked()`` (cross-rank metadata agreement, the stream
  against metadata on every rank, the end-of-pass count exchange), and the writer compares every
  tensor with the plan (name, dtype, shape, order, byte count) before writing it.
* **All or nothing, on every rank.** Bytes go to a staging folder next to ``path`` (same filesystem)
  with disk space reserved up front; only after every rank reported success does the writer rename it
  into place (``files``). Any failure on any rank -- a source raising mid-stream, a full
  disk, a peer that never arrives -- removes the staging folder, leaves ``path`` as it was, and raises
  ``CheckpointError`` (chained to the cause) on every rank. Every wait is bounded by the source's
  ``timeout_s`` (default 300 s; pass ``checked(source, timeout_s=...)`` to change it). The
  control exchanges and collective waits (FSDP gathers) hear a peer's failure at once through a
  ``Board``; a gloo point-to-point wait (``MegatronSource``'s PP/EP gathers) cannot be
  polled without breaking the pair, so it hears it when the peer's process exits or at
  ``timeout_s`` (on NCCL: NCCL's own timeout). The one window left: a non-writer that loses the
  writer during the final confirmation (after the rename) raises saying the commit was not confirmed.
* **Target rules.** ``path`` existing and non-empty raises on every rank before any collective byte
  moves unless ``overwrite=True`` (then the old folder stays intact until the new one replaces it).

The three control exchanges (target ready, all ranks done, committed) run on the default process
group's store, a few hundred bytes each.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from weightsync.sources import CheckpointError, PeerFailedError, checked, verify_metadata_agreement
from weightsync.sources.toolkit import (
    DEFAULT_TIMEOUT_S,
    Board,
    active_board,
    get_logger,
    group_ranks,
    hf_root,
    multi_rank,
    next_tag,
)

from .files import StagedFolder
from .queue import DEFAULT_WRITE_QUEUE_BYTES, WriteQueue
from .plan import INDEX_FILE, CheckpointPlan, model_class, plan_checkpoint, transformers_save_layout

__all__ = ["save_safetensors", "SaveReport", "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_WRITE_QUEUE_BYTES"]

logger = get_logger(__name__)

#: 5 GB as transformers parses "5GB" (the issue's default; ``save_pretrained``'s own is "50GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass
class SaveReport:
    """What ``save_safetensors`` wrote; the same on every rank except ``seconds`` (this rank's own).

    ``files``: every file in the folder (shards, index, configs). ``total_size``: tensor bytes, as the
    index's ``metadata.total_size``. ``peak_extra_bytes``: the writer's most bytes held at once beyond
    what the source yielded (headers + one tensor's host copy). ``peak_queued_bytes``: the most bytes
    of yielded tensors held in the write queue at once (``<= max(write_queue_bytes, largest
    tensor)``; 0 with ``write_queue_bytes=0``). ``order``: where the shard order came
    from (``"transformers"``: a meta instance of the model; ``"metadata"``: the source's order).
    """

    path: str
    files: list[str]
    num_tensors: int
    total_size: int
    seconds: float
    peak_extra_bytes: int
    peak_queued_bytes: int
    write_queue_bytes: int
    writer: int
    num_shards: int
    largest_shard_bytes: int
    max_shard_bytes: int
    order: str
    overwrote: bool = False
    config_written: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        return asdict(self)


def _hf_model(source: WeightSource) -> nn.Module | None:
    """The transformers model behind ``source`` (through ``checked()``, ``torch.compile``/activation
    checkpointing/DDP wrappers and PEFT), or None. ``FSDPSource`` exposes it as ``module``; vLLM's
    ``ModuleSource`` keeps it as ``_module`` (vLLM's own attribute: it has no public one); other
    sources may expose ``model``."""
    inner = source
    while isinstance(inner.__dict__.get("source"), WeightSource):  # checked() and similar wrappers
        inner = inner.__dict__["source"]
    for attr in ("model", "module", "_module"):
        try:
            model = getattr(inner, attr, None)
        except Exception:  # noqa: BLE001 - a property that cannot answer: no model
            model = None
        if isinstance(model, nn.Module):
            break
    else:
        return None
    model = hf_root(model)
    base = getattr(model, "get_base_model", None)  # PEFT: the transformers model inside the tuner
    if callable(base):
        model = hf_root(base())
    return model if model_class(model) is not None else None


def _default_config(source: WeightSource, model: nn.Module | None) -> Any:
    cfg = getattr(source, "hf_config", None)
    if cfg is None and model is not None:
        cfg = getattr(model, "config", None)
    return cfg


def _validate_args(max_shard_bytes: Any, metadata: Any, write_queue_bytes: Any, rank: int) -> dict[str, str]:
    """Check the user's arguments (errors name them) and return the user's safetensors metadata."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise CheckpointError(f"rank {rank}: max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if isinstance(write_queue_bytes, bool) or not isinstance(write_queue_bytes, int) or write_queue_bytes < 0:
        raise CheckpointError(f"rank {rank}: write_queue_bytes must be a non-negative int, got {write_queue_bytes!r}")
    user = dict(metadata or {})
    for k, v in user.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(
                f"rank {rank}: safetensors metadata must map str to str; entry {k!r}: {v!r} "
                f"({type(k).__name__} -> {type(v).__name__})"
            )
    if user.get("format", "pt") != "pt":
        raise CheckpointError(
            f"rank {rank}: metadata['format'] is {user['format']!r}; transformers loads only 'pt' "
            "checkpoints of torch tensors"
        )
    user.pop("format", None)
    return user


def _writer(metadata: list[ParamMeta], world: int, rank: int) -> int:
    """The lowest rank that owns every tensor (``owners=None``: every rank)."""
    common = set(range(world))
    for m in metadata:
        if m.owners is not None:
            common &= set(m.owners)
            if not common:
                raise CheckpointError(
                    f"rank {rank}: no rank owns every tensor (e.g. {m.name!r} is owned by ranks "
                    f"{list(m.owners)}); save_safetensors needs one rank whose iter_full yields the "
                    "whole model (MegatronSource(mode='full'), FSDPSource)"
                )
    return min(common)


def _model_dtype(metadata: list[ParamMeta]) -> torch.dtype | None:
    """``save_pretrained``'s ``config.dtype``: its model's first floating-point parameter's dtype
    (FP8 weights of a quantized stream excepted: the config names the unquantized dtype)."""
    return next((m.dtype for m in metadata if m.dtype.is_floating_point and m.dtype.itemsize > 1), None)


def save_safetensors(
    source: WeightSource,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
    config: Any = None,
    overwrite: bool = False,
    write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES,
    version: str | None = None,
) -> SaveReport:
    """Write ``source``'s tensors as a Hugging Face safetensors checkpoint folder at ``path``.

    Collective: call it on every rank of the default process group, with the same arguments (see
    the module docstring for what is guaranteed).

    Args:
        source: any ``WeightSource`` implementing ``iter_full``; one rank must own every tensor.
        path: the checkpoint folder to create (its parent is created if needed).
        max_shard_bytes: shard size limit, split as ``save_pretrained(max_shard_size=...)`` splits.
        metadata: extra safetensors ``__metadata__`` entries (str -> str) for every shard, after
            ``"format": "pt"``.
        config: a transformers ``PretrainedConfig`` to write as ``config.json`` (default: the
            source's ``hf_config`` or its model's ``config`` when present; None writes no config).
        overwrite: replace an existing non-empty folder at ``path`` (atomically, at the end).
        write_queue_bytes: the writer's tensors are written (host copy + ``pwrite``) on a thread
            while the source gathers the next ones, with at most this many bytes of tensors queued
            (a larger tensor alone); 0 writes each tensor before the next is gathered (``queue``).
        version: the weight version the folder holds, stored in every shard's metadata as
            ``weightsync_version`` (after the caller's ``metadata``): what ``apply_delta`` checks a
            patch chain's ``base_version`` against.

    Returns the ``SaveReport`` on every rank. Raises ``CheckpointError`` on every rank on any failure.
    """
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    multi = multi_rank()
    rank = dist.get_rank() if multi else 0
    world = dist.get_world_size() if multi else 1
    timeout_s = float(getattr(source, "timeout_s", DEFAULT_TIMEOUT_S))
    board = Board(next_tag("checkpoint")) if multi else None
    ranks = group_ranks(None) if multi else (0,)
    staged: StagedFolder | None = None
    writer = -1
    committing = False
    try:
        user = _validate_args(max_shard_bytes, metadata, write_queue_bytes, rank)
        if version is not None:
            user["weightsync_version"] = str(version)  # delta.VERSION_KEY: apply_delta's base check
        stream_source = checked(source, timeout_s=timeout_s)
        meta = list(stream_source.metadata)
        if multi:
            verify_metadata_agreement(meta, timeout_s=timeout_s, board=board, what="metadata (save_safetensors)")
        writer = _writer(meta, world, rank)
        model = _hf_model(source)
        cfg = config if config is not None else _default_config(source, model)
        layout = transformers_save_layout(model_class(model) if model is not None else None, cfg)
        plan = plan_checkpoint(meta, max_shard_bytes=max_shard_bytes, user_metadata=user, layout=layout, rank=rank)
        existed = os.path.isdir(path) and bool(os.listdir(path)) if rank == writer else False
        if rank == writer:
            staged = StagedFolder(path, plan, overwrite=overwrite, rank=rank)
        if multi:
            board.exchange(
                "ready", ranks=ranks, timeout_s=timeout_s,
                what=f"the checkpoint target check (writer rank {writer}, {path})",
            )
        peak, queued = _stream(stream_source, plan, staged, rank, write_queue_bytes)
        files = [f.name for f in plan.files]
        if staged is not None:
            files += _write_metadata_files(staged, plan, cfg, model, meta, getattr(source, "quantization_config", None))
        if multi:
            board.exchange("done", ranks=ranks, timeout_s=timeout_s, what=f"the checkpoint completion check ({path})")
        committing = True
        if staged is not None:
            staged.commit()
            staged = None
            logger.info("checkpoint %s: %d tensors, %d bytes in %d file(s)", path, len(plan.tensors), plan.total_size, len(plan.files))
        verdict = f"{peak},{queued}|{int(existed)}|{'|'.join(files)}"
        if multi:
            verdict = board.exchange(
                verdict if rank == writer else "", ranks=ranks, timeout_s=timeout_s,
                what=f"the commit of {path} by writer rank {writer}",
            )[writer]
    except BaseException as e:
        if staged is not None:
            staged.discard()
        if board is not None:
            board.fail(f"rank {rank}: {type(e).__name__}: {e}")
        if isinstance(e, (CheckpointError, KeyboardInterrupt, SystemExit)):
            raise
        who = f"writer rank {writer}" if writer >= 0 else "before a writer was chosen"
        outcome = (
            f"the commit of {path} by {who} was not confirmed to this rank (it may be in place)"
            if committing and rank != writer and not isinstance(e, PeerFailedError)
            else f"checkpoint {path} was not written ({path} is as it was; {who})"
        )
        raise CheckpointError(f"rank {rank}: {outcome}: {type(e).__name__}: {e}") from e
    return _report(verdict, plan, path=path, seconds=time.perf_counter() - t0, writer=writer,
                   write_queue_bytes=write_queue_bytes, max_shard_bytes=max_shard_bytes)


def _report(verdict: str, plan: CheckpointPlan, *, path: str, seconds: float, writer: int,
            write_queue_bytes: int, max_shard_bytes: int) -> SaveReport:
    """The ``SaveReport`` every rank returns, from the writer's verdict
    (``"peak,queued|existed|file|file..."``, the same string on every rank) and the plan."""
    peaks_s, existed_s, *files = verdict.split("|")
    peak_s, queued_s = peaks_s.split(",")
    return SaveReport(
        path=path,
        files=files,
        num_tensors=len(plan.tensors),
        total_size=plan.total_size,
        seconds=seconds,
        peak_extra_bytes=int(peak_s),
        peak_queued_bytes=int(queued_s),
        write_queue_bytes=write_queue_bytes,
        writer=writer,
        num_shards=len(plan.files),
        largest_shard_bytes=plan.largest_file_bytes,
        max_shard_bytes=max_shard_bytes,
        order=plan.order,
        overwrote=bool(int(existed_s)),
        config_written="config.json" in files,
    )


def _stream(
    source: WeightSource, plan: CheckpointPlan, staged: StagedFolder | None, rank: int, queue_bytes: int
) -> tuple[int, int]:
    """Drive one ``iter_full`` pass; the writer (``staged`` set) checks each tensor against the plan
    and hands it to a ``WriteQueue`` (written on its thread while the pass goes on; ``queue_bytes=0``:
    written here). Returns the writer's peak extra bytes (headers + the largest host copy) and the
    peak bytes of tensors queued for writing."""
    expected = plan.tensors
    headers = sum(len(f.header) for f in plan.files)
    queue = WriteQueue(staged, queue_bytes) if staged is not None else None
    i = 0
    stream = source.iter_full()
    try:
        for name, tensor in stream:
            if queue is not None:
                try:
                    if i >= len(expected):
                        raise CheckpointError(
                            f"rank {rank}: the source yielded {name!r} after the {len(expected)} planned tensors"
                        )
                    e = expected[i]
                    if name != e.name or tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
                        raise CheckpointError(
                            f"rank {rank}: tensor {i} of the stream is {name!r} {tensor.dtype} "
                            f"{tuple(tensor.shape)}, the plan expects {e.name!r} {e.dtype} {e.shape} "
                            f"(file {plan.files[e.file].name})"
                        )
                    queue.put(e, tensor)
                except BaseException as err:
                    # The peers are inside the source's collectives: tell them why before stopping the
                    # pass (closing it posts only "the consumer stopped").
                    board = active_board()
                    if board is not None:
                        board.fail(f"rank {rank}: the checkpoint writer stopped: {type(err).__name__}: {err}")
                    stream.close()
                    raise
            i += 1
            del tensor
        if queue is not None:
            queue.finish()  # the last writes (their errors) before the count check and the exchanges
    finally:
        if queue is not None:
            queue.abort()  # on an error: stop the thread before the caller removes the staging folder
    if queue is not None and i != len(expected):
        raise CheckpointError(
            f"rank {rank}: the source yielded {i} tensors, the plan has {len(expected)}; first "
            f"missing {expected[i].name!r} ({plan.files[expected[i].file].name})"
        )
    if queue is None:
        return 0, 0
    return headers + queue.peak_copy_bytes, queue.peak_queued_bytes


def _write_metadata_files(
    staged: StagedFolder, plan: CheckpointPlan, cfg: Any, model: nn.Module | None, meta: list[ParamMeta],
    quantization: dict[str, Any] | None = None,
) -> list[str]:
    """The index (sharded checkpoints) and, with a transformers config, ``config.json`` plus
    ``generation_config.json`` as ``save_pretrained`` writes them. Returns the file names."""
    files: list[str] = []
    if plan.index is not None:
        staged.write_text(INDEX_FILE, plan.index_json())
        files.append(INDEX_FILE)
    if cfg is None or not hasattr(cfg, "save_pretrained"):
        return files
    cfg = copy.deepcopy(cfg)  # the caller's config is never modified
    dtype = _model_dtype(meta)
    if dtype is not None:
        cfg.dtype = str(dtype).split(".")[1]
    if quantization is not None:  # an FP8Source's stream: the config an FP8 checkpoint carries
        cfg.quantization_config = copy.deepcopy(quantization)
    cls = model_class(model) if model is not None else None
    arch = cls.__name__ if cls is not None else (plan.layout.architecture if plan.layout else None)
    if arch is not None:
        cfg.architectures = [arch]
    staged.save_with(cfg, "config.json")
    files.append("config.json")
    gen = None
    if model is not None and model.can_generate():
        gen = getattr(model, "generation_config", None)
    elif plan.layout is not None:
        gen = plan.layout.generation_config
    if gen is not None:
        staged.save_with(copy.deepcopy(gen), "generation_config.json")
        files.append("generation_config.json")
    return files
