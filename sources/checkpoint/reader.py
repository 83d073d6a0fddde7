"""``SafetensorsSource``: a Hugging Face safetensors checkpoint folder as a vLLM ``WeightSource``.

For the cold-start sync before the first training step, and for replaying a sync from disk. The
folder holds either one ``model.safetensors`` or ``model.safetensors.index.json`` plus the shards its
``weight_map`` names (what ``save_pretrained`` and ``weightsync.plugins.checkpoint`` write).

Invariants:

* **Metadata from the headers alone.** A safetensors file is an 8-byte little-endian header length
  N, N bytes of JSON (``{name: {dtype, shape, data_offsets: [begin, end]}}`` plus an optional
  ``__metadata__``), then the data region. Construction reads those 8 + N bytes of each file and
  ``stat``s it; it never reads, maps or touches a byte of tensor data.
* **Validated at construction, on every rank, before any byte moves.** Every reason safetensors
  would refuse a file later (a truncated or over-long data region, offsets that overlap or leave a
  gap, a size that does not match dtype x shape, an unknown dtype) and every disagreement between the
  index and the headers (a tensor the index maps to a file whose header lacks it; a tensor in a
  header that the index does not list; a name in two files) raises ``CheckpointError`` naming the
  file and the tensor. Rank 0 reads; every rank raises the same error.
* **Order: shard by shard, data offsets ascending.** ``metadata`` (and so ``iter_full``) lists the
  shard files the index names in file-name order (``model-00001-of-0000N`` first) and, inside a
  file, its tensors by where their bytes lie.
  That is the order the bytes are laid out, so each shard is read front to back exactly once (the
  kernel's readahead works, one shard is open at a time), and it is a pure function of the headers,
  so every rank derives the same list. (``weight_map`` itself is alphabetical in ``save_pretrained``
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
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
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

__all__ = [
    "SafetensorsSource",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "INDEX_FILE",
    "TensorEntry",
    "ShardHeader",
    "CheckpointLayout",
    "read_header",
    "read_checkpoint",
]

logger = get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors' own cap on the JSON header (its Rust reader refuses larger ones).
MAX_HEADER_BYTES = 100_000_000


def _dtype_table() -> dict[str, torch.dtype]:
    """safetensors dtype strings -> torch dtypes, for those this torch build has. Sub-byte packed
    types (``F4``, ``F6_*``) are absent: their element counts do not map to a torch shape."""
    names = {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
    }
    return {k: getattr(torch, v) for k, v in names.items() if isinstance(getattr(torch, v, None), torch.dtype)}


#: The safetensors dtypes a checkpoint may hold (``"BF16"`` -> ``torch.bfloat16``, ...).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = _dtype_table()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one file: ``begin``/``end`` are absolute byte offsets in that file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """One safetensors file as its header describes it; ``entries`` sorted by data offset.
    ``stat_key`` (size, mtime_ns, inode) is what ``iter_full`` re-checks before reading."""

    path: str
    header_bytes: int
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    stat_key: tuple[int, int, int]


@dataclass(frozen=True)
class CheckpointLayout:
    """A validated checkpoint folder: its files in read order, and the index (None: single file)."""

    folder: str
    files: tuple[ShardHeader, ...]
    index_path: str | None

    def entries(self) -> Iterator[tuple[ShardHeader, TensorEntry]]:
        for shard in self.files:
            for e in shard.entries:
                yield shard, e


def _no_duplicates(where: str):
    """A ``json.loads`` hook that refuses a key written twice (plain json keeps the last one)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{where}: tensor {k!r} appears twice (duplicate name)")
            out[k] = v
        return out

    return hook


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and validate one safetensors file from its first 8 + N bytes and its size.

    Raises ``CheckpointError`` naming ``path`` (and the tensor, where one is at fault) for every
    reason safetensors' own reader would refuse the file: a header length past the end of the
    file, JSON that is not a header, an unsupported dtype, a byte size that is not dtype x shape,
    offsets that overlap or leave a gap, and a data region shorter (truncated) or longer than the
    offsets cover. Reads no tensor data.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            st = os.fstat(f.fileno())
            if size < 8:
                raise CheckpointError(f"{path}: {size} bytes, shorter than the 8-byte header length (truncated)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length field says {n} bytes but the file has {size} bytes "
                    f"(truncated, or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the {n}-byte header is not JSON ({e}); not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a string-to-string map")
    data_start, data_len = 8 + n, size - 8 - n
    entries = [_entry(path, name, info, data_start) for name, info in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    pos, prev = data_start, None
    for e in entries:
        if e.begin < pos:
            raise CheckpointError(
                f"{path}: tensor {e.name!r} bytes [{e.begin - data_start}, {e.end - data_start}) overlap "
                f"tensor {prev.name!r} bytes [{prev.begin - data_start}, {prev.end - data_start})"
            )
        if e.begin > pos:
            raise CheckpointError(
                f"{path}: tensor {e.name!r} starts at data byte {e.begin - data_start}, leaving a "
                f"{e.begin - pos}-byte gap after {prev.name if prev else 'the header'!r} "
                "(safetensors requires the data region to be fully covered)"
            )
        pos, prev = e.end, e
    covered = pos - data_start
    if covered > data_len:
        last = max(entries, key=lambda e: e.end)
        raise CheckpointError(
            f"{path}: truncated: the header's data offsets need {covered} data bytes (tensor "
            f"{last.name!r} ends at {last.end - data_start}) but the file holds {data_len} "
            f"({size} bytes in all)"
        )
    if covered < data_len:
        raise CheckpointError(
            f"{path}: {data_len - covered} bytes after the last tensor "
            f"{prev.name if prev else '(none)'!r}: the header's data offsets cover {covered} of "
            f"{data_len} data bytes (safetensors refuses such a file)"
        )
    return ShardHeader(path, n, tuple(entries), {str(k): str(v) for k, v in meta.items()}, _stat_key(st))


def _entry(path: str, name: str, info: Any, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{where}: header entry {info!r} lacks dtype / shape / data_offsets")
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise CheckpointError(
            f"{where}: unsupported dtype {info['dtype']!r} (supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    shape, offs = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if (
        not isinstance(offs, list) or len(offs) != 2
        or any(not isinstance(o, int) or isinstance(o, bool) for o in offs) or not 0 <= offs[0] <= offs[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
    want = math.prod(shape) * dtype.itemsize
    if offs[1] - offs[0] != want:
        raise CheckpointError(
            f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes but {info['dtype']} "
            f"{tuple(shape)} needs {want}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])


def read_checkpoint(folder: str | os.PathLike) -> CheckpointLayout:
    """Find, parse and cross-check a checkpoint folder's files (``read_header`` for each).

    ``folder`` holds ``model.safetensors`` or ``model.safetensors.index.json`` and its shards, not
    both. The index must map every tensor of every shard it names, and only those: a tensor it maps
    to a file whose header lacks it, a tensor in a header it does not list, a name in two files, a
    shard it names that does not exist -- each raises ``CheckpointError`` naming the file and the
    tensor. ``metadata.total_size`` of the index is informational (hub checkpoints often get it
    wrong, and no loader uses it): a mismatch is logged, not raised. Other ``*.safetensors`` files
    in the folder (an adapter, a stale shard) are not part of the checkpoint and are only logged.
    """
    folder = os.fspath(folder)
    if not os.path.exists(folder):
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: is a file, not a checkpoint folder (pass the folder holding it)")
    try:
        listing = sorted(os.listdir(folder))
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list the folder: {e}") from e
    has_single, has_index = SINGLE_FILE in listing, INDEX_FILE in listing
    if has_single and has_index:
        raise CheckpointError(
            f"{folder}: holds both {SINGLE_FILE} and {INDEX_FILE}; loaders disagree on which one is "
            "the checkpoint (remove the stale one)"
        )
    if not has_single and not has_index:
        found = [f for f in listing if f.endswith(".safetensors")]
        if not listing:
            raise CheckpointError(f"{folder}: the folder is empty (no {SINGLE_FILE} or {INDEX_FILE})")
        raise CheckpointError(
            f"{folder}: has neither {SINGLE_FILE} nor {INDEX_FILE} "
            f"(safetensors files found: {found or 'none'}; {len(listing)} entries in all)"
        )
    if has_single:
        files = (read_header(os.path.join(folder, SINGLE_FILE)),)
        index_path, used = None, {SINGLE_FILE}
    else:
        index_path = os.path.join(folder, INDEX_FILE)
        files = _read_indexed(folder, index_path)
        used = {os.path.basename(s.path) for s in files}
    stray = [f for f in listing if f.endswith(".safetensors") and f not in used]
    if stray:
        logger.info("%s: safetensors files that are not part of the checkpoint, ignored: %s", folder, stray)
    if not any(s.entries for s in files):
        raise CheckpointError(f"{folder}: the checkpoint holds no tensors")
    return CheckpointLayout(folder, files, index_path)


def _read_indexed(folder: str, index_path: str) -> tuple[ShardHeader, ...]:
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"), object_pairs_hook=_no_duplicates(index_path))
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: not JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{index_path}: no 'weight_map' (a non-empty object of tensor name -> shard file)")
    order: dict[str, list[str]] = {}
    for name, fname in wmap.items():
        if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
            raise CheckpointError(
                f"{index_path}: tensor {name!r} maps to {fname!r}, which is not a file name in the folder"
            )
        order.setdefault(fname, []).append(name)
    shards: list[ShardHeader] = []
    where: dict[str, str] = {}
    order = dict(sorted(order.items()))  # file-name order: model-00001-of-N first
    for fname, names in order.items():
        fpath = os.path.join(folder, fname)
        if not os.path.isfile(fpath):
            raise CheckpointError(
                f"{index_path}: maps tensor {names[0]!r} ({len(names)} tensors in all) to {fpath}, "
                "which does not exist"
            )
        shard = read_header(fpath)
        for e in shard.entries:
            if e.name in where:
                raise CheckpointError(
                    f"{fpath}: tensor {e.name!r} is also in {where[e.name]} (duplicate name across shards)"
                )
            where[e.name] = fpath
        shards.append(shard)
    for shard, names in zip(shards, order.values()):
        have = {e.name for e in shard.entries}
        missing = [n for n in names if n not in have]
        if missing:
            elsewhere = f" (its header is in {where[missing[0]]})" if missing[0] in where else ""
            raise CheckpointError(
                f"{index_path}: maps tensor {missing[0]!r} to {shard.path}, whose header has no such "
                f"tensor{elsewhere}; {len(missing)} such tensors in all"
            )
        extra = [e.name for e in shard.entries if wmap.get(e.name) != os.path.basename(shard.path)]
        if extra:
            raise CheckpointError(
                f"{shard.path}: tensor {extra[0]!r} is in the file's header but missing from the index "
                f"{index_path}; {len(extra)} such tensors in all"
            )
    total = (index.get("metadata") or {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    actual = sum(e.nbytes for s in shards for e in s.entries)
    if total is not None and total != actual:
        logger.warning(
            "%s: metadata.total_size is %s but the shards hold %d tensor bytes", index_path, total, actual
        )
    return tuple(shards)


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
            _check_unchanged(shard)
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


def _check_unchanged(shard: ShardHeader) -> None:
    try:
        now = _stat_key(os.stat(shard.path))
    except OSError as e:
        raise CheckpointError(f"rank 0: {shard.path}: cannot be read any more: {e}") from e
    if now != shard.stat_key:
        raise CheckpointError(
            f"rank 0: {shard.path} changed since the SafetensorsSource was built (size, mtime or inode "
            f"{shard.stat_key} -> {now}); its metadata no longer describes the file: build a new source"
        )
