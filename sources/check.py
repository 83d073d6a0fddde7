"""Checking a source's stream against its metadata, on every rank.

vLLM 0.33 checks iteration against ``metadata`` only on the NCCL sender (``_checked_iter``); the IPC
engine and every non-sender rank check nothing, so a divergent rank either hangs in the next
collective or ships garbage. Two guarantees live here:

* ``check_stream``: each ``(name, tensor)`` a rank yields is exactly the next entry of
  ``owned_names(rank)`` -- same name, wire dtype, full shape, contiguous -- and the count matches.
  The error names the rank, the index, the declared and the actual parameter. It costs one
  comparison per tensor and never synchronizes the device.
* ``verify_metadata_agreement``: before the first collective of a pass, every rank compares a digest
  of its metadata (names, dtypes, shapes, owners, mesh, placements) in one small gloo collective
  bounded by a timeout; a mismatch raises on every rank with the first differing entry, a missing
  rank raises naming it, instead of a hang in the first gather.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from .errors import CrossRankMismatchError, MetadataMismatchError, SyncTimeoutError
from .logs import get_logger

__all__ = [
    "check_stream",
    "metadata_digest",
    "meta_entry",
    "verify_metadata_agreement",
    "CheckedSource",
    "checked",
    "DEFAULT_TIMEOUT_S",
]

logger = get_logger(__name__)

#: Bound on weightsync's own control collectives (digest exchange, end-of-pass agreement).
DEFAULT_TIMEOUT_S = 300.0


def meta_entry(m: ParamMeta) -> tuple:
    """A plain, comparable, printable tuple for one ParamMeta."""
    return (
        m.name,
        str(m.dtype).removeprefix("torch."),
        tuple(m.shape),
        m.owners,
        m.mesh_shape,
        None if m.placements is None else tuple(repr(p) for p in m.placements),
    )


def metadata_digest(metadata: Iterable[ParamMeta]) -> str:
    """A stable hex digest over every field that engines plan from."""
    h = hashlib.sha256()
    for m in metadata:
        h.update(repr(meta_entry(m)).encode())
        h.update(b"\n")
    return h.hexdigest()


def _fmt(name: str, dtype: Any, shape: Any) -> str:
    return f"{name!r} {str(dtype).removeprefix('torch.')} {tuple(shape)}"


def check_stream(
    pairs: Iterable[tuple[str, torch.Tensor]],
    expected: list[ParamMeta],
    *,
    rank: int,
    what: str = "iter_full",
    local_shapes: list[tuple[int, ...]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``pairs`` unchanged, raising ``MetadataMismatchError`` at the first divergence.

    ``expected`` is the metadata this rank must yield, in order (``owned_names(rank)``).
    ``local_shapes``, when given, replaces the full shape for each entry (``iter_local`` pieces).
    The checks are on the host: name, dtype, shape, contiguity, count. Contiguity is required because
    both of vLLM's sending paths read ``numel`` elements from ``data_ptr()``.
    """
    i = 0
    for name, tensor in pairs:
        if i >= len(expected):
            raise MetadataMismatchError(
                f"rank {rank}: {what} yielded more tensors than metadata declares for this rank "
                f"({len(expected)}); first extra is {_fmt(name, tensor.dtype, tensor.shape)}"
            )
        m = expected[i]
        shape = m.shape if local_shapes is None else local_shapes[i]
        if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(shape):
            which = [
                w
                for w, bad in (
                    ("name/order", name != m.name),
                    ("dtype", tensor.dtype != m.dtype),
                    ("shape", tuple(tensor.shape) != tuple(shape)),
                )
                if bad
            ]
            raise MetadataMismatchError(
                f"rank {rank}: {what} disagrees with metadata at index {i} ({', '.join(which)}): "
                f"declared {_fmt(m.name, m.dtype, shape)}, got {_fmt(name, tensor.dtype, tensor.shape)}"
            )
        if not tensor.is_contiguous():
            raise MetadataMismatchError(
                f"rank {rank}: {what} yielded a non-contiguous tensor at index {i} "
                f"({_fmt(name, tensor.dtype, tensor.shape)}, strides {tuple(tensor.stride())}); "
                "vLLM's engines send numel elements from data_ptr(), so it would ship wrong bytes"
            )
        i += 1
        yield name, tensor
    if i != len(expected):
        missing = expected[i]
        raise MetadataMismatchError(
            f"rank {rank}: {what} stopped after {i} tensors but metadata declares {len(expected)} "
            f"for this rank; first missing is {_fmt(missing.name, missing.dtype, missing.shape)}"
        )


_GLOO_GROUPS: dict[tuple, Any] = {}


def control_group(group: Any = None) -> Any:
    """A gloo group over the same ranks as ``group`` (default: the world), created once.

    weightsync's control collectives run on gloo so they can be bounded (``monitored_barrier``) and
    stay off the device whatever backend the trainer uses. Creating it is itself collective over the
    world, so callers reach it on every rank at the same point (the start of a pass).
    """
    if group is None and dist.get_backend() == "gloo":
        return None
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(ranks=list(ranks) if ranks else None, backend="gloo")
    return _GLOO_GROUPS[key]


def verify_metadata_agreement(
    metadata: list[ParamMeta],
    *,
    group: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "metadata",
) -> None:
    """Raise on every rank of ``group`` unless all ranks hold identical ``metadata``.

    One bounded barrier (names the late rank on timeout) and one all-gather of a 64-byte digest.
    Only on mismatch is the full metadata exchanged, to name the first differing entry.
    No-op without an initialized process group or with one rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    cgroup = control_group(group)
    rank = dist.get_rank()
    try:
        dist.monitored_barrier(
            group=cgroup, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
        )
    except RuntimeError as e:
        raise SyncTimeoutError(
            f"rank {rank}: not every trainer rank reached the start of the {what} check within "
            f"{timeout_s:.0f}s ({e}). A rank that is late here is usually still in its previous "
            "step or is not calling the sync at all (rank-conditional call?)."
        ) from e
    digest = metadata_digest(metadata)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, (rank, digest, len(metadata)), group=cgroup)
    if all(d[1] == digest for d in digests):
        return
    entries = [meta_entry(m) for m in metadata]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (rank, entries), group=cgroup)
    ref_rank, ref = everyone[0]
    for other_rank, other in everyone[1:]:
        if other == ref:
            continue
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "<none>"
            b = other[i] if i < len(other) else "<none>"
            if a != b:
                raise CrossRankMismatchError(
                    f"rank {rank}: trainer ranks disagree about {what}: rank {other_rank} differs "
                    f"from rank {ref_rank} at entry {i} of {len(ref)}/{len(other)}: "
                    f"rank {ref_rank} has {a}, rank {other_rank} has {b}. Every rank must build "
                    "the same model with the same config and wrapping."
                )
    raise CrossRankMismatchError(f"rank {rank}: metadata digests differ across ranks: {digests}")


class CheckedSource(WeightSource):
    """Wraps any ``WeightSource``; every pass checks the stream against ``metadata`` on this rank.

    ``metadata`` is the wrapped source's, unchanged (same objects, no collective). ``iter_full`` and
    ``iter_local`` exist iff the wrapped source implements them. With ``agree=True`` (default) the
    first pass also verifies that every rank holds the same metadata before the wrapped source runs
    any collective.
    """

    def __init__(
        self,
        source: WeightSource,
        *,
        rank: int | None = None,
        agree: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.source = source
        self._rank = rank
        self.agree = agree
        self.timeout_s = timeout_s
        self._agreed = False

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def implements_iter_full(self) -> bool:
        return self.source.implements_iter_full()

    def implements_iter_local(self) -> bool:
        return self.source.implements_iter_local()

    def _expected(self) -> list[ParamMeta]:
        r = self.rank
        return [m for m in self.metadata if m.owners is None or r in m.owners]

    def _agree(self) -> None:
        if self.agree and not self._agreed:
            verify_metadata_agreement(self.metadata, timeout_s=self.timeout_s)
            self._agreed = True

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.source.implements_iter_full():
            raise NotImplementedError(f"{type(self.source).__name__} does not implement iter_full")
        self._agree()
        yield from check_stream(self.source.iter_full(), self._expected(), rank=self.rank)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.source.implements_iter_local():
            raise NotImplementedError(f"{type(self.source).__name__} does not implement iter_local")
        self._agree()
        expected = self._expected()
        shapes = [local_shape(m, self.rank) for m in expected]
        yield from check_stream(
            self.source.iter_local(), expected, rank=self.rank, what="iter_local", local_shapes=shapes
        )

    def __getattr__(self, name: str) -> Any:  # stats and helpers of the wrapped source
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)


def local_shape(m: ParamMeta, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s ``iter_local`` piece of ``m``: ``torch.chunk`` semantics per mesh axis,
    outer axis first when two axes shard one dim (the vLLM ``ParamMeta`` contract)."""
    shape = list(m.shape)
    if m.owners is None or m.placements is None:
        return tuple(shape)
    idx = m.owners.index(rank)
    coords = []
    for d in reversed(m.mesh_shape):
        coords.append(idx % d)
        idx //= d
    coords.reverse()
    for axis, p in enumerate(m.placements):
        dim = getattr(p, "dim", None)
        if dim is None:
            continue
        n = m.mesh_shape[axis]
        size = shape[dim]
        chunk = -(-size // n)
        start = min(coords[axis] * chunk, size)
        shape[dim] = max(0, min(chunk, size - start))
    return tuple(shape)


def checked(source: WeightSource, **kwargs: Any) -> WeightSource:
    """``CheckedSource(source)``, unless ``source`` is already checked."""
    if isinstance(source, CheckedSource):
        return source
    return CheckedSource(source, **kwargs)
