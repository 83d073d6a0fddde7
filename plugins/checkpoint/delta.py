"""Delta patch files: one ``DeltaSource`` round as a sparse safetensors file, and applying a chain of
them to a checkpoint folder written by ``save_safetensors``.

``save_delta(delta, path, base_version=..., version=...)`` (every rank, collectively: it runs one
round) writes, per changed tensor ``name``, ``"name::values"`` (1-D, wire dtype) and, unless the
tensor went whole (``DeltaSource.iter_deltas(whole_when_cheaper=True)``), ``"name::indices"``
(int32 flat indices into the full tensor). The safetensors ``__metadata__`` carries
``weightsync_delta`` (format version), ``base_version``, ``version``, ``anchor`` and ``shapes`` (JSON:
name -> full shape). ``apply_delta(folder, patch_files)`` applies a chain to a folder whose shards
carry ``weightsync_version`` (``save_safetensors(..., version=v)``) and leaves the folder
``save_safetensors(..., version=last)`` would write now: same files, same bytes.

Invariants:

* **Exact chain or nothing.** Every patch's ``base_version`` must equal the version before it (the
  folder's for the first) -- except an anchor patch, which holds every element of every tensor and
  so applies to a folder of any version -- every patched tensor must exist in the folder with the patch's dtype and
  shape and every index must be in range -- all checked before any byte is written. The folder is
  rewritten into a staging folder next to it and swapped into place at the end
  (``files.replace_folder``): a failure leaves it as it was.
* **Bounded memory.** ``save_delta``'s writer (rank 0) streams values to a temporary data file and
  holds only the header; ``apply_delta`` holds one shard of the folder at a time.
* **A failed ``save_delta`` resets the delta on every rank** (the next round is an anchor, which
  covers any base) and raises ``CheckpointError`` on every rank; the target path is untouched.
* Only the version entry of each shard header changes; the header is re-serialised exactly as
  ``save_safetensors`` writes it (``plan.serialise_header``: compact JSON, key order kept,
  space-padded to 8 bytes), so the bytes equal a fresh ``save_safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from weightsync.sources import CheckpointError
from weightsync.sources.toolkit import (
    DEFAULT_TIMEOUT_S,
    Board,
    get_logger,
    group_ranks,
    multi_rank,
    next_tag,
    read_checkpoint,
)

from .files import fsync_dir, mkdir_unique, replace_folder
from .plan import SAFETENSORS_NAMES, safetensors_dtype, serialise_header

__all__ = ["VERSION_KEY", "DeltaFileReport", "save_delta", "apply_delta", "read_delta_header"]

logger = get_logger(__name__)

#: The shard metadata entry naming a checkpoint folder's weight version.
VERSION_KEY = "weightsync_version"
#: Format version of a delta patch file (``__metadata__["weightsync_delta"]``).
DELTA_FORMAT = "1"
_VALUES, _INDICES = "::values", "::indices"
_COPY_BYTES = 16 << 20


@dataclass
class DeltaFileReport:
    """What ``save_delta`` wrote (the same on every rank but ``seconds``)."""

    path: str
    base_version: str
    version: str
    anchor: bool
    tensors: int
    bytes: int
    seconds: float


def save_delta(
    delta: Any,
    path: str | os.PathLike,
    *,
    base_version: str,
    version: str,
    overwrite: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DeltaFileReport:
    """Run one round of ``delta`` (a ``DeltaSource``) and write it to ``path`` as a patch file.

    Collective: every rank, same arguments. ``base_version``: the version the receiver (a folder,
    a replica) holds before this patch; ``version``: the one it holds after. Rank 0 writes.
    """
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    multi = multi_rank()
    rank = dist.get_rank() if multi else 0
    board = Board(next_tag("delta-file")) if multi else None
    err: BaseException | None = None
    writer = _PatchWriter(path, overwrite=overwrite, rank=rank) if rank == 0 else None
    anchor = False
    try:
        if not isinstance(base_version, str) or not isinstance(version, str) or base_version == version:
            raise CheckpointError(
                f"rank {rank}: save_delta needs two different str versions, got base_version="
                f"{base_version!r}, version={version!r}"
            )
        if writer is not None:
            writer.open()
        for d in delta.iter_deltas(whole_when_cheaper=True):
            if writer is not None and err is None:
                try:
                    writer.add(d)
                except BaseException as e:  # noqa: BLE001 - keep the round going: peers are in it
                    err = e
        anchor = bool(getattr(getattr(delta, "last_round", None), "anchor", False))
        if writer is not None and err is None:
            writer.finish({"base_version": base_version, "version": version, "anchor": str(int(anchor))})
    except BaseException as e:  # noqa: BLE001 - agreed below
        err = err or e
    failed = _agree(board, err, rank, timeout_s, path)
    if writer is not None and (failed or err is not None):
        writer.discard()
    if failed:
        try:
            delta.reset()  # every rank: whatever was or was not written, the next round covers all
        except BaseException as e:  # noqa: BLE001
            logger.error("rank %d: delta.reset() after a failed save_delta failed: %s", rank, e)
        if isinstance(err, CheckpointError):
            raise err
        others = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise CheckpointError(f"rank {rank}: patch file {path} was not written: {others}") from err
    if writer is not None:
        writer.commit()
    facts = f"{writer.tensors},{writer.nbytes}" if writer is not None else ""
    if board is not None:
        facts = board.exchange(facts, ranks=group_ranks(None), timeout_s=timeout_s, what=f"the commit of {path}")[0]
    tensors, nbytes = (int(x) for x in facts.split(","))
    return DeltaFileReport(path, base_version, version, anchor, tensors, nbytes, time.perf_counter() - t0)


def _agree(board: Board | None, err: BaseException | None, rank: int, timeout_s: float, path: str) -> dict[int, str]:
    mine = "ok" if err is None else f"{type(err).__name__}: {err}"
    if board is None:
        return {} if err is None else {rank: mine}
    got = board.exchange(mine, ranks=group_ranks(None), timeout_s=timeout_s, what=f"the outcome of save_delta({path})")
    return {r: v for r, v in got.items() if v != "ok"}


class _PatchWriter:
    """Rank 0's side of ``save_delta``: values and indices streamed to a data file next to
    ``path``, the header assembled at the end, the file renamed into place on ``commit``."""

    def __init__(self, path: str, *, overwrite: bool, rank: int) -> None:
        self.path, self.overwrite, self.rank = path, overwrite, rank
        self.entries: dict[str, Any] = {}
        self.shapes: dict[str, list[int]] = {}
        self.tensors = self.nbytes = 0
        self._data: Any = None
        self._data_path: str | None = None
        self._final: str | None = None

    def open(self) -> None:
        if os.path.isdir(self.path):
            raise CheckpointError(f"rank {self.rank}: {self.path} is a folder; a patch file is one file")
        if os.path.exists(self.path) and not self.overwrite:
            raise CheckpointError(f"rank {self.rank}: {self.path} exists (pass overwrite=True to replace it)")
        parent = os.path.dirname(self.path) or "."
        os.makedirs(parent, exist_ok=True)
        self._data_path = f"{self.path}.weightsync-{os.getpid()}.data.tmp"
        self._data = open(self._data_path, "wb")

    def _write(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        begin = self.nbytes
        self._data.write(raw)
        self.nbytes += len(raw)
        self.entries[key] = {
            "dtype": safetensors_dtype(t.dtype, name=key, rank=self.rank),
            "shape": [int(t.numel())],
            "data_offsets": [begin, self.nbytes],
        }

    def add(self, d: Any) -> None:
        if d.name in self.shapes:
            raise CheckpointError(f"rank {self.rank}: the round yielded {d.name!r} twice")
        self.shapes[d.name] = [int(x) for x in d.full_shape]
        if d.indices is not None:
            self._write(d.name + _INDICES, d.indices)
        self._write(d.name + _VALUES, d.values)
        self.tensors += 1

    def finish(self, meta: dict[str, str]) -> None:
        self._data.close()
        head: dict[str, Any] = {
            "__metadata__": {
                "format": "pt",
                "weightsync_delta": DELTA_FORMAT,
                **meta,
                "shapes": json.dumps(self.shapes, separators=(",", ":")),
            },
            **self.entries,
        }
        header = serialise_header(head)
        self._final = f"{self.path}.weightsync-{os.getpid()}.tmp"
        with open(self._final, "wb") as out, open(self._data_path, "rb") as data:
            out.write(header)
            shutil.copyfileobj(data, out, _COPY_BYTES)
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self._data_path)
        self._data_path = None

    def commit(self) -> None:
        assert self._final is not None
        os.replace(self._final, self.path)
        self._final = None
        fsync_dir(os.path.dirname(self.path) or ".")
        logger.info("patch file %s: %d tensors, %d bytes", self.path, self.tensors, self.nbytes)

    def discard(self) -> None:
        if self._data is not None and not self._data.closed:
            self._data.close()
        for p in (self._data_path, self._final):
            if p and os.path.exists(p):
                os.unlink(p)
        self._data_path = self._final = None


def _raw_header(path: str) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file as an ordered dict, and where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8")), 8 + n


@dataclass
class _Patch:
    path: str
    base_version: str
    version: str
    anchor: bool
    shapes: dict[str, list[int]]
    entries: dict[str, Any]
    data_start: int

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        a, b = self.entries[key]["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + a)
            raw = bytearray(f.read(b - a))
        if len(raw) != b - a:
            raise CheckpointError(f"{self.path}: truncated at {key!r}")
        return torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)


def read_delta_header(path: str | os.PathLike) -> dict[str, Any]:
    """A patch file's metadata: ``base_version``, ``version``, ``anchor``, ``shapes``, ``tensors``."""
    p = _open_patch(os.fspath(path))
    return {"base_version": p.base_version, "version": p.version, "anchor": p.anchor,
            "shapes": p.shapes, "tensors": len(p.shapes)}


def _open_patch(path: str) -> _Patch:
    try:
        head, start = _raw_header(path)
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors patch file: {e}") from e
    meta = head.pop("__metadata__", {}) or {}
    if meta.get("weightsync_delta") != DELTA_FORMAT:
        raise CheckpointError(
            f"{path}: not a weightsync delta patch file (weightsync_delta={meta.get('weightsync_delta')!r}, "
            f"expected {DELTA_FORMAT!r})"
        )
    try:
        shapes = json.loads(meta["shapes"])
        return _Patch(path, meta["base_version"], meta["version"], meta.get("anchor") == "1", shapes, head, start)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: patch metadata incomplete: {e}") from e


def _folder_version(layout: Any) -> str:
    versions = {s.metadata.get(VERSION_KEY) for s in layout.files}
    if None in versions:
        raise CheckpointError(
            f"{layout.folder}: its shards carry no {VERSION_KEY!r}: write the base folder with "
            "save_safetensors(..., version=...) so a patch chain can be checked against it"
        )
    if len(versions) != 1:
        raise CheckpointError(f"{layout.folder}: its shards disagree on {VERSION_KEY}: {sorted(versions)}")
    return versions.pop()


def apply_delta(folder: str | os.PathLike, patch_files: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """Apply one patch file, or a chain in order, to ``folder`` (written by ``save_safetensors`` with
    a ``version``); returns the folder's new version. Raises ``CheckpointError`` before writing
    anything when a patch's ``base_version`` does not follow on (the folder's version for the
    first; an anchor patch follows on from anything but must hold every tensor of the folder), or a patch names a tensor the folder lacks, with another dtype or shape, or an index out
    of range. The folder is replaced whole at the end, never left half-patched."""
    folder = os.path.abspath(os.fspath(folder))
    files = [patch_files] if isinstance(patch_files, (str, os.PathLike)) else list(patch_files)
    if not files:
        raise CheckpointError("apply_delta: no patch files given")
    layout = read_checkpoint(folder)
    current = _folder_version(layout)
    patches = [_open_patch(os.fspath(f)) for f in files]
    where: dict[str, tuple[int, Any]] = {}
    for k, shard in enumerate(layout.files):
        for e in shard.entries:
            where[e.name] = (k, e)
    for p in patches:
        if p.anchor:  # every element of every tensor: applies whatever the folder held
            missing = sorted(set(where) - set(p.shapes))
            if missing:
                raise CheckpointError(
                    f"{p.path}: an anchor patch must hold every tensor of {folder}; it lacks {missing[:5]}"
                )
        elif p.base_version != current:
            raise CheckpointError(
                f"{p.path}: patch base_version {p.base_version!r} does not match "
                f"{'the folder' if p is patches[0] else 'the previous patch'}'s version {current!r} ({folder})"
            )
        current = p.version
        for name, shape in p.shapes.items():
            if name not in where:
                raise CheckpointError(f"{p.path}: patches tensor {name!r}, which {folder} does not hold")
            e = where[name][1]
            vals = p.entries.get(name + _VALUES)
            if tuple(shape) != e.shape or vals is None or vals["dtype"] != SAFETENSORS_NAMES.get(e.dtype):
                raise CheckpointError(
                    f"{p.path}: tensor {name!r} is patched as {vals and vals['dtype']} {tuple(shape)}, "
                    f"the folder holds {e.dtype} {e.shape}"
                )
    new_version = current
    parent = os.path.dirname(folder) or "."
    tmp = mkdir_unique(parent, f".{os.path.basename(folder)}.weightsync-", ".tmp")
    try:
        shard_paths = {os.path.basename(s.path) for s in layout.files}
        for name in sorted(os.listdir(folder)):
            src = os.path.join(folder, name)
            if name in shard_paths or not os.path.isfile(src):
                continue
            shutil.copy2(src, os.path.join(tmp, name))
        for k, shard in enumerate(layout.files):
            _patch_shard(shard, [e for e in shard.entries], patches, os.path.join(tmp, os.path.basename(shard.path)),
                         new_version)
        for name in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(tmp)
        os.chmod(tmp, os.stat(folder).st_mode & 0o7777)
        replace_folder(tmp, folder)
        tmp = None
        fsync_dir(parent)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("applied %d patch file(s) to %s: version %s", len(patches), folder, new_version)
    return new_version


def _patch_shard(shard: Any, entries: list[Any], patches: list[_Patch], out_path: str, version: str) -> None:
    head, start = _raw_header(shard.path)
    with open(shard.path, "rb") as f:
        f.seek(start)
        data = bytearray(f.read())
    for e in entries:
        todo = [p for p in patches if e.name in p.shapes]
        if not todo:
            continue
        n = 1
        for d in e.shape:
            n *= d
        a = e.begin - start
        flat = torch.frombuffer(data, dtype=e.dtype, count=n, offset=a) if n else torch.empty(0, dtype=e.dtype)
        for p in todo:
            values = p.read(e.name + _VALUES, e.dtype)
            key = e.name + _INDICES
            if key not in p.entries:
                if values.numel() != n:
                    raise CheckpointError(f"{p.path}: whole patch of {e.name!r} has {values.numel()} values for {n}")
                flat.copy_(values)
                continue
            idx = p.read(key, torch.int32).long()
            if idx.numel() != values.numel():
                raise CheckpointError(f"{p.path}: {e.name!r} has {idx.numel()} indices for {values.numel()} values")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise CheckpointError(f"{p.path}: {e.name!r} has an index outside its {n} elements")
            flat[idx] = values
    head["__metadata__"] = {**head.get("__metadata__", {}), VERSION_KEY: version}
    with open(out_path, "wb") as out:
        out.write(serialise_header(head))
        out.write(data)
