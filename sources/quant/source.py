"""``FP8Source``: any ``WeightSource`` -- ``FSDPSource``, ``MegatronSource``, ``SafetensorsSource``,
vLLM's ``ModuleSource`` -- sending block-FP8 weights in the format vLLM loads for an FP8 checkpoint.

Invariants:

* **Metadata is the wrapped source's, rewritten by a pure function of it** (``FP8Config.plan``): each
  quantized ``...weight`` becomes ``float8_e4m3fn`` (same shape, owners, mesh, placements) and is
  followed by its float32 ``...weight_scale_inv``; everything else is unchanged. No collective, the
  same on every rank; a config that cannot hold for this model (a module an FP8 checkpoint
  quantizes that the model does not send, a different scale shape, a scale name the model already
  sends) raises ``FP8ConfigError`` on every rank when metadata is first read -- before bytes move.
* **One tensor at a time, after its gather** (on CPU; on CUDA a bounded window). Each full (or
  local) tensor the wrapped source yields is quantized on its own device as it arrives and dropped.
  On CUDA, consecutive 2-D weights (and the small tensors between them) up to ``batch_bytes``
  (default 512 MiB of inputs) are quantized in one Triton launch and then yielded in order: a launch
  costs about as much host time as the device needs for a few hundred MiB, so smaller windows leave
  quantization host-bound (window sizes measured: docs/evidence.md, "FP8 rollouts"). Peak extra memory:
  ``batch_bytes`` of held inputs plus their codes (half that for BF16) and scales. Never a
  model-size buffer. A source that overlaps (FSDP's next gather already posted, Megatron's next
  receives) keeps doing so while a tensor is quantized and consumed.
* **The stream is checked** against this metadata on every rank (names, FP8/float32 dtypes, scale
  shapes), as weightsync's own sources check theirs; vLLM's IPC engine checks nothing itself.
* ``iter_local`` (``nccl_m2n`` / ``sharded_rdt``) quantizes each rank's piece, which is exact only
  where every piece boundary is a block boundary; otherwise (or for a fused gate/up split along its
  rows) ``iter_local`` raises on every rank naming the parameter, before any byte moves.

Which ranks quantize: every rank that yields. The NCCL engine's non-senders drain ``iter_full`` and
discard, but the IPC engine ships every rank's tensors to its colocated worker, and a source cannot
tell which engine consumes it. A non-sender's quantization runs on its own device in parallel with
rank 0's, so it costs no wall time. ``MegatronSource`` yields on rank 0 only, so only rank 0 quantizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, Shard, WeightSource

from ..core.check.stream import check_stream, local_shape
from ..core.layouts.rows import chunk_rows
from ..core.ground.logs import current_rank, get_logger
from ..core.ground.errors import FP8ConfigError
from ..core.protocols import senders_of
from .config import _FUSED_EXPERTS, FP8Config, QuantPlan
from .fp8 import FP8_DTYPE, quantize_blocks, quantize_many

__all__ = ["FP8Source", "quantized"]

logger = get_logger(__name__)

#: On CUDA, quantize runs of consecutive weights up to this many input bytes in one launch.
DEFAULT_BATCH_BYTES = 512 << 20
#: Unquantized tensors at most this large ride along in a batch (norms); larger ones flush it.
_SMALL_BYTES = 1 << 20


class FP8Source(WeightSource):
    """Wraps ``source``; yields block-FP8 weights + ``weight_scale_inv`` per ``config``.

    ``config``: an ``FP8Config``; a served model's ``quantization_config`` (dict, transformers config,
    ``config.json`` path) or an FP8 checkpoint folder (``FP8Config.from_hf``); None: the default
    (128x128 blocks, float32 scales, vLLM's numerics, the documented default set of weights).
    """

    def __init__(self, source: WeightSource, config: FP8Config | Mapping[str, Any] | str | None = None, *,
                 check: bool = True, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        if isinstance(source, FP8Source):
            raise FP8ConfigError("FP8Source: the source is already quantized (FP8Source over FP8Source)")
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 0:
            raise FP8ConfigError(f"FP8Source(batch_bytes={batch_bytes!r}): a non-negative int")
        self.source = source
        self.config = config if isinstance(config, FP8Config) else (FP8Config() if config is None else FP8Config.from_hf(config))
        self.check = check
        self.batch_bytes = batch_bytes

    # ---- metadata ---------------------------------------------------------------------------

    @cached_property
    def _plans(self) -> dict[str, QuantPlan]:
        plans: dict[str, QuantPlan] = {}
        names = set()
        for m in self.source.metadata:
            names.add(m.name)
            if m.dtype.is_floating_point:
                p = self.config.plan(m.name, tuple(m.shape))
                if p is not None:
                    plans[m.name] = p
        rank = current_rank()
        # A fused expert stack with biases is GPT-OSS's transposed, gate/up-interleaved layout: its
        # blocks are not an FP8 checkpoint's (GPT-OSS ships MXFP4 experts); it goes out as it is.
        for name in [n for n in plans if _FUSED_EXPERTS.search(n) and _stack(n) + ".gate_up_proj_bias" in names]:
            del plans[name]
        clash = sorted(p.scale_name for p in plans.values() if p.scale_name in names)
        if clash:
            raise FP8ConfigError(
                f"rank {rank}: FP8Source: the wrapped source already sends {clash[0]!r} "
                "(is it quantized already?)"
            )
        self.config.check_covers(((m.name, tuple(m.shape)) for m in self.source.metadata),
                                 rank=rank, what="FP8Source")
        if not plans:
            raise FP8ConfigError(
                f"rank {rank}: FP8Source: no tensor of {type(self.source).__name__} is quantized by {self.config!r} "
                "(nothing would be FP8: check modules_to_not_convert and the model's names)"
            )
        return plans

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        plans = self._plans
        out: list[ParamMeta] = []
        for m in self.source.metadata:
            p = plans.get(m.name)
            if p is None:
                out.append(m)
                continue
            out.append(ParamMeta(m.name, FP8_DTYPE, m.shape, owners=m.owners, mesh_shape=m.mesh_shape,
                                 placements=m.placements))
            placements, _ = self._scale_placements(m, p)
            out.append(ParamMeta(p.scale_name, torch.float32, p.scale_shape, owners=m.owners,
                                 mesh_shape=m.mesh_shape, placements=placements))
        return out

    def _scale_placements(self, m: ParamMeta, p: QuantPlan) -> tuple[Any, str | None]:
        """The scale's placements (the weight's, where pieces fall on block boundaries) and, if
        ``iter_local`` cannot be exact for ``m``, why."""
        if m.placements is None or m.owners is None:
            return None, None
        nd = len(m.shape)
        block_of = {nd - 2: self.config.block[0], nd - 1: self.config.block[1]}
        sharded = [(axis, pl.dim) for axis, pl in enumerate(m.placements) if isinstance(pl, Shard)]
        dims = [d for _, d in sharded]
        for axis, dim in sharded:
            if dim not in block_of:
                continue  # a leading (expert) dim: the scale has the same extent there
            if dims.count(dim) > 1:
                return None, f"dim {dim} is sharded over {dims.count(dim)} mesh axes"
            if p.parts > 1 and dim == nd - 2:
                return None, "its gate and up halves are quantized separately, and the rows are sharded"
            size, b, ways = m.shape[dim], block_of[dim], m.mesh_shape[axis]
            ssize = p.scale_shape[dim]
            for r in range(ways):
                start, length = chunk_rows(size, ways, r)
                sstart, slength = chunk_rows(ssize, ways, r)
                if length and (start % b or sstart != start // b or slength != -(-(start + length) // b) - start // b):
                    return None, (f"TP/FSDP piece {r} of dim {dim} starts at {start}, not on a {b}-wide block "
                                  f"boundary (size {size} over {ways})")
        return m.placements, None

    @cached_property
    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` an FP8 checkpoint of this stream carries (``save_safetensors``
        writes it into ``config.json``): block, scale format, and the Linear modules kept unquantized."""
        plans = self._plans
        kept = [m.name[: -len(".weight")] for m in self.source.metadata
                if m.name.endswith(".weight") and len(m.shape) == 2 and m.name not in plans]
        kept += sorted({_stack(m.name) for m in self.source.metadata
                        if _FUSED_EXPERTS.search(m.name) and m.name not in plans})
        return self.config.to_hf(kept)

    # ---- passes -----------------------------------------------------------------------------

    @property
    def checks_stream(self) -> bool:
        return self.check

    @property
    def senders(self) -> str:
        """The wrapped source's: quantization happens where each tensor is yielded."""
        return senders_of(self.source)

    def implements_iter_full(self) -> bool:
        return self.source.implements_iter_full()

    def implements_iter_local(self) -> bool:
        return self.source.implements_iter_local()

    def _quantize(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        p = self._plans.get(name)
        if p is None:
            yield name, tensor
            return
        cfg = self.config
        if p.parts == 1:
            q, s = quantize_blocks(tensor, cfg.block, scale_fmt=cfg.scale_fmt, rule=cfg.rule)
        else:
            halves = [quantize_blocks(h, cfg.block, scale_fmt=cfg.scale_fmt, rule=cfg.rule)
                      for h in tensor.chunk(p.parts, dim=-2)]
            q = torch.cat([h[0] for h in halves], dim=-2)
            s = torch.cat([h[1] for h in halves], dim=-2)
            del halves
        del tensor
        yield name, q
        del q
        yield p.scale_name, s

    def _expected(self) -> list[ParamMeta]:
        r = current_rank()
        return [m for m in self.metadata if m.owners is None or r in m.owners]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped ``iter_full``, each planned weight quantized as it arrives."""
        stream = self._stream(self.source.iter_full())
        if self.check:
            stream = check_stream(stream, self._expected(), rank=current_rank(), what="iter_full")
        yield from stream

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped ``iter_local``, each rank's piece quantized (block-aligned pieces only)."""
        rank = current_rank()
        for m in self.source.metadata:
            p = self._plans.get(m.name)
            if p is not None:
                _, why = self._scale_placements(m, p)
                if why is not None:
                    raise FP8ConfigError(
                        f"rank {rank}: FP8Source.iter_local: {m.name!r} {tuple(m.shape)} cannot be quantized "
                        f"piecewise with weight_block_size={list(self.config.block)}: {why}; use iter_full "
                        "(a full-tensor engine such as nccl or ipc) for this model"
                    )
        stream = self._stream(self.source.iter_local())
        if self.check:
            expected = self._expected()
            shapes = [local_shape(m, rank) for m in expected]
            stream = check_stream(stream, expected, rank=rank, what="iter_local", local_shapes=shapes)
        yield from stream

    def _stream(self, inner: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor at a time; on CUDA, runs of consecutive 2-D weights up to ``batch_bytes`` (and the
        small tensors between them) are quantized in one launch (``quantize_many``), then yielded in
        order -- a bounded window, never more than ``batch_bytes`` of inputs held.

        This loop runs once per tensor of the model, and on a GPU the pass is host-bound (the IPC engine
        and its receiver are too): one plan lookup per tensor."""
        plans, limit = self._plans, self.batch_bytes
        pending: list[tuple[str, torch.Tensor]] = []
        held = 0
        try:
            for name, tensor in inner:
                p = plans.get(name)
                if limit and self._windowed(tensor):
                    nbytes = tensor.numel() * tensor.element_size()
                    if (p is not None and p.parts == 1 and tensor.dim() == 2) or (
                            p is None and pending and nbytes <= _SMALL_BYTES):
                        pending.append((name, tensor))
                        held += nbytes
                        del tensor
                        if held >= limit:
                            yield from self._flush(pending)
                            held = 0
                        continue
                if pending:
                    yield from self._flush(pending)
                    held = 0
                pairs = self._quantize(name, tensor)
                del tensor  # the generator holds the only reference, and drops it once quantized
                yield from pairs
            if pending:
                yield from self._flush(pending)
        finally:
            pending.clear()
            close = getattr(inner, "close", None)
            if callable(close):
                close()

    @staticmethod
    def _windowed(tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` may wait in a launch window: on CUDA, where one launch quantizes the whole
        window (elsewhere ``quantize_many`` goes tensor by tensor, so waiting would only hold memory)."""
        return tensor.is_cuda

    def _flush(self, pending: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Quantize ``pending``'s planned weights in one launch and yield everything in order; empties
        ``pending`` (the inputs are dropped before the first yield)."""
        cfg, plans = self.config, self._plans
        done = iter(quantize_many([t for n, t in pending if n in plans], cfg.block, scale_fmt=cfg.scale_fmt,
                                  rule=cfg.rule))
        out: list[tuple[str, torch.Tensor]] = []
        put = out.append
        for name, t in pending:
            p = plans.get(name)
            if p is None:
                put((name, t))
            else:
                q, s = next(done)
                put((name, q))
                put((p.scale_name, s))
        t = done = None  # the last input: dropped before the first yield, as the others
        pending.clear()
        out.reverse()
        pop = out.pop
        while out:  # pop as we go: nothing yielded stays referenced here
            yield pop()

    def __getattr__(self, name: str) -> Any:  # stats and helpers of the wrapped source
        if name in ("source", "config", "check"):
            raise AttributeError(name)
        return getattr(self.source, name)

    def __repr__(self) -> str:
        return f"FP8Source({self.source!r}, {self.config!r})"


def _stack(name: str) -> str:
    """``<layer>.mlp.experts`` of a fused expert tensor's name."""
    return name.rsplit(".", 1)[0]


def quantized(source: WeightSource, config: FP8Config | Mapping[str, Any] | str | None = None,
              **kwargs: Any) -> FP8Source:
    """``FP8Source(source, config, **kwargs)``: ``source``'s stream with block-FP8 weights."""
    return FP8Source(source, config, **kwargs)
