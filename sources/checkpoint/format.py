"""The safetensors format, read and validated: a checkpoint folder's headers, never its data.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {dtype, shape, data_offsets: [begin, end]}}`` plus an optional ``__metadata__``), then the
data region. A folder holds either one ``model.safetensors`` or ``model.safetensors.index.json``
plus the shards its ``weight_map`` names (what ``save_pretrained`` and
``weightsync.plugins.checkpoint`` write).

Invariants:

* **Headers only.** ``read_header`` reads those 8 + N bytes of a file and ``stat``s it; nothing here
  reads, maps or touches a byte of tensor data.
* **Validated.** Every reason safetensors would refuse a file later (a truncated or over-long data
  region, offsets that overlap or leave a gap, a size that does not match dtype x shape, an unknown
  dtype, a duplicate key) and every disagreement between the index and the headers (a tensor the
  index maps to a file whose header lacks it; a tensor in a header that the index does not list; a
  name in two files) raises ``CheckpointError`` naming the file and the tensor.
* **Order: shard by shard, data offsets ascending** (``CheckpointLayout.entries``): the shard files
  the index names in file-name order and, inside a file, its tensors by where their bytes lie --
  the order the bytes are laid out, and a pure function of the headers.
* ``check_unchanged`` tells a shard that changed on disk (size, mtime or inode) since its header was read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.ground.errors import CheckpointError
from ..core.ground.logs import get_logger

__all__ = [
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "TensorEntry",
    "ShardHeader",
    "CheckpointLayout",
    "read_header",
    "read_checkpoint",
    "check_unchanged",
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


def stat_key_of(st: os.stat_result) -> tuple[int, int, int]:
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
    return ShardHeader(path, n, tuple(entries), {str(k): str(v) for k, v in meta.items()}, stat_key_of(st))


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


def check_unchanged(shard: ShardHeader) -> None:
    """Raise ``CheckpointError`` if ``shard``'s file changed (size, mtime or inode) or vanished since
    its header was read: the metadata built from it would no longer describe the file."""
    try:
        now = stat_key_of(os.stat(shard.path))
    except OSError as e:
        raise CheckpointError(f"rank 0: {shard.path}: cannot be read any more: {e}") from e
    if now != shard.stat_key:
        raise CheckpointError(
            f"rank 0: {shard.path} changed since the SafetensorsSource was built (size, mtime or inode "
            f"{shard.stat_key} -> {now}); its metadata no longer describes the file: build a new source"
        )
