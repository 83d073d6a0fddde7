"""``SafetensorsSource``: a Hugging Face safetensors checkpoint folder as a vLLM ``WeightSource``.

For the cold-start sync before the first training step, and for replaying a sync from disk. The
folder holds either one ``model.safetensors`` or ``model.safetensors.index.json`` plus the shards its
``weight_map`` names (what ``save_pretrained`` and ``weightsync.plugins.checkpoint`` write).

Invariants:

* **Metadata from the headers alone, validated at construction, on every rank, before any byte
  moves** (``format.py``: what is read, what is refused, the order). Rank 0 reads; every rank raises
  the same ``CheckpointError``, naming the file and the tensor.
* **Order: shard by shard, data offsets ascending** (``CheckpointLayout.entries``): each shard is
  read front to back exactly once (the kernel's readahead works, one shard is open at a time), and
  every rank derives the same list. (``weight_map`` itself is alphabetical in ``save_pretrained``
  output -- ``layers.10`` before ``layers.2`` -- and jumps between shards.)
* **Ownership: ``owners=(0,)`` on every entry.** Rank 0 is vLLM's only sender and the only rank
  that yields; ``owned_names(r)`` is empty for every other rank, so their ``iter_full()`` yields
  nothing and runs no collective -- exactly what vLLM's NCCL trainer engine does with non-senders
  (it drains ``iter_full()``). vLLM's IPC engine needs every rank to own every parameter, so through
  IPC this source runs with one trainer rank (``preflight`` refuses more).
* **Only rank 0 touches the disk.** With an initialized process group of more than one rank,
  construction is collective: rank 0 reads and validates the headers and posts the result (or its
  error) on the default store (``groups.Board.exchange``, bounded by ``DEFAULT_TIMEOUT_S``); every
  rank builds ``metadata`` from that one list. Ranks other than 0 never open ``path`` -- it need
  only exist on rank 0's disk, their own ``path`` argument is ignored. Every rank must construct
  the source, in the same order relative to other weightsync sources. The ranks' ``dtype``
  arguments are exchanged too: ranks that disagree all raise, naming the ranks.
* **Lazy, one tensor at a time.** ``iter_full`` on rank 0 opens each shard with safetensors'
  ``safe_open`` and takes one tensor at a time: safetensors (0.8) hands out a CPU tensor backed by
  a private, copy-on-write mapping of the file, so a page is read from disk only when something
  touches it -- the cast to the wire dtype, the copy to ``device``, or (CPU, no cast) the consumer.
  The source holds no reference to a tensor after yielding it. A CPU tensor yielded without a cast
  is that mapping: writing to it never reaches the file, but truncating the file while the tensor
  is alive makes reading it fault (as with any memory-mapped loader). A shard whose size, mtime or
  inode changed since construction raises ``CheckpointError`` before its first tensor is taken
  (the metadata the receiver sized its buffers from would no longer describe it).
* ``dtype`` follows ``wire.WirePolicy`` exactly as ``FSDPSource``: floating tensors are cast to it
  except MoE routers / gates / score-correction biases (``DEFAULT_KEEP_FP32``); integer and bool
  tensors keep their own dtype. Leave it ``None`` for quantized (FP8) checkpoints.
"""

from __future__ import annotations

import base64
import json
import math
import os
import zlib
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..core.ground.errors import CheckpointError
from ..core.comm.waits import DEFAULT_TIMEOUT_S, Board, group_ranks, next_tag
from ..core.ground.logs import get_logger
from ..core.ground.ranks import multi_rank
from ..core.ground.stats import PassStats
from ..core.ground.dtype_policy import WirePolicy
from .format import CheckpointLayout, check_unchanged, read_checkpoint

__all__ = ["SafetensorsSource"]

logger = get_logger(__name__)

class SafetensorsSource(WeightSource):
    """A checkpoint folder as a vLLM ``WeightSource`` (see the module docstring for the invariants).

    Args:
        path: the checkpoint folder (read on rank 0 only).
        dtype: wire dtype of floating tensors (None: the checkpoint's own dtypes); MoE routers and
            gates keep theirs (``core.ground.dtype_policy.DEFAULT_KEEP_FP32``), as in ``FSDPSource``.
        device: where ``iter_full`` puts each tensor (``"cuda"`` for vLLM's IPC/NCCL engines).

    Attributes: ``layout`` (rank 0: the validated ``CheckpointLayout``; None elsewhere),
    ``last_pass`` (``PassStats`` of the latest pass), ``hf_config`` (the folder's ``config.json``
    as a transformers config, or None).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        multi = multi_rank()
        self.rank = dist.get_rank() if multi else 0
        self.last_pass = PassStats()
        self.layout: CheckpointLayout | None = None
        self.path = str(path)
        problem, rows = None, None
        # Argument errors go through the exchange too: no rank may raise alone and leave peers waiting.
        try:
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"path= must be a str or os.PathLike folder, got {type(path).__name__}")
            self.path = os.fspath(path)
            self.wire = WirePolicy.build(dtype, ())
            try:
                self.device = torch.device(device)
            except (TypeError, RuntimeError) as e:
                raise ValueError(f"device={device!r} is not a torch device: {e}") from None
        except (TypeError, ValueError) as e:
            problem = f"bad argument: {e}"
        if problem is None and self.rank == 0:
            try:
                self.layout = read_checkpoint(self.path)
                rows = [(e.name, _dtype_name(e.dtype), list(e.shape)) for _, e in self.layout.entries()]
            except CheckpointError as e:
                problem = str(e)
        if multi:
            rows = self._exchange(dtype, problem, rows)
        elif problem is not None:
            raise CheckpointError(f"rank {self.rank}: {problem}")
        self._rows = [(n, getattr(torch, d), tuple(s)) for n, d, s in rows]
        logger.info(
            "checkpoint %s: %d tensors, %d bytes on disk%s", self.path, len(self._rows),
            sum(math.prod(s) * d.itemsize for _, d, s in self._rows),
            f" in {len(self.layout.files)} file(s)" if self.layout else " (read by rank 0)",
        )

    def _exchange(self, dtype: Any, problem: str | None, rows: Any) -> list:
        """One store exchange: rank 0's header list or error, every rank's ``dtype`` and argument
        errors. Raises ``CheckpointError`` on every rank if any rank has a problem.

        Every rank reads rank 0's post from the store, so it travels compressed: names repeat their
        prefixes, and zlib shrinks a list of 50k tensors (~5 MB of JSON) about tenfold."""
        mine = {"dtype": str(dtype), "problem": problem, "rows": rows if self.rank == 0 else None}
        board = Board(next_tag("checkpoint"))
        got = board.exchange(
            _pack(mine), ranks=group_ranks(None), timeout_s=DEFAULT_TIMEOUT_S,
            what=f"the exchange of checkpoint {self.path}'s headers (SafetensorsSource construction)",
        )
        posts = {r: _unpack(v) for r, v in got.items()}
        bad = {r: p["problem"] for r, p in posts.items() if p["problem"]}
        if bad:
            r, why = min(bad.items())
            who = "this rank" if r == self.rank else f"rank {r}"
            raise CheckpointError(f"rank {self.rank}: {who} could not build the checkpoint source: {why}")
        dtypes = {r: p["dtype"] for r, p in posts.items()}
        if len(set(dtypes.values())) > 1:
            raise CheckpointError(
                f"rank {self.rank}: ranks pass different dtype= for checkpoint {self.path}: {dtypes}; "
                "every rank must declare the same wire dtypes"
            )
        return posts[0]["rows"]

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.wire.dtype_for(n, d), s, owners=(0,)) for n, d, s in self._rows]

    @cached_property
    def hf_config(self) -> Any:
        """The folder's ``config.json`` as a transformers config (None when absent on this rank)."""
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            return None
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: every tensor, in metadata order, read lazily; other ranks: nothing."""
        if self.rank != 0:
            return
        from safetensors import safe_open

        assert self.layout is not None
        stats = self.last_pass = PassStats().start()
        wire = [m.dtype for m in self.metadata]
        i = 0
        for shard in self.layout.files:
            check_unchanged(shard)
            with safe_open(shard.path, framework="pt", device="cpu") as f:
                for e in shard.entries:
                    t = f.get_tensor(e.name).to(device=self.device, dtype=wire[i])
                    i += 1
                    stats.yielded(t.numel() * t.element_size())
                    yield e.name, t
                    del t
        stats.stop()

    def __repr__(self) -> str:
        return (
            f"SafetensorsSource({self.path!r}, dtype={self.wire.dtype}, device={str(self.device)!r}, "
            f"{len(self._rows)} tensors, rank {self.rank})"
        )


def _pack(obj: Any) -> str:
    return base64.b85encode(zlib.compress(json.dumps(obj).encode(), 6)).decode("ascii")


def _unpack(text: str) -> Any:
    return json.loads(zlib.decompress(base64.b85decode(text)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
