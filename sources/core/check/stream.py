"""Checking a source's stream against its metadata, on every rank, and agreeing across ranks.

vLLM (0.33, 0.34) checks iteration against ``metadata`` only on the NCCL sender(s) (``_checked_iter``);
the IPC engine and every non-sender rank check nothing, so a divergent rank either hangs in the next
collective or ships garbage. The guarantees here:

* ``check_stream``: each ``(name, tensor)`` a rank yields is exactly the next entry of
  ``owned_names(rank)`` -- same name, wire dtype, full shape (``iter_local``: also contiguous, see
  ``check_stream``) -- and the count matches.
  The error names the rank, the index, the declared and the actual parameter. It costs one
  comparison per tensor, never synchronizes the device, and holds no tensor longer
  than its consumer does.
* ``verify_metadata_agreement``: before the first collective, every rank compares a digest of its
  metadata (names, dtypes, shapes, owners, mesh, placements) in one exchange on the default store,
  bounded by ``timeout_s``; a mismatch raises on every rank with the first differing entry, a missing
  rank raises naming it, instead of a hang in the first gather.
* ``CheckedSource`` / ``checked``: both of the above on every pass of any ``WeightSource``, plus an
  end-of-pass exchange of tensor counts, so that no rank returns from a pass another rank failed; a
  failure is posted on the pass's ``groups.Board`` and heard by peers at once (``PeerFailedError``).

Many senders (a source with ``senders="owners"``, vLLM 0.34's NCCL engine): vLLM pulls each
sender's pass only on its own turn, so no exchange can run inside a pass. ``CheckedSource`` then
agrees at construction (every rank builds it, as ``WeightSync`` does) and leaves the count check to
each rank's own ``check_stream``; the driver agrees on every rank's outcome after the send.

Exchanges run on the store rather than on a process group (``groups.Board.exchange``): a rank that
gives up leaves nothing pending, so a failed pass never misaligns a group and the next pass works.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..ground.errors import CrossRankMismatchError, MetadataMismatchError, WeightSyncError
from ..comm.waits import (
    DEFAULT_TIMEOUT_S,
    Board,
    PeerFailedError,
    activate,
    bounded_group,
    deactivate,
    discard_groups,
    group_ranks,
    next_tag,
)
from .integrity import checksum_tensor, resolve_checksums
from ..layouts.rows import chunk_rows
from ..ground.logs import get_logger
from ..ground.ranks import multi_rank
from ..protocols import checks_stream, senders_of

__all__ = [
    "check_stream",
    "metadata_digest",
    "meta_entry",
    "verify_metadata_agreement",
    "CheckedSource",
    "checked",
    "control_group",
    "local_shape",
    "DEFAULT_TIMEOUT_S",
    "PeerFailedError",
]

logger = get_logger(__name__)


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
    contiguous: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``pairs`` unchanged, raising ``MetadataMismatchError`` at the first divergence.

    ``expected`` is the metadata this rank must yield, in order (``owned_names(rank)``).
    ``local_shapes``, when given, replaces the full shape for each entry (``iter_local`` pieces).
    The checks are on the host: name, dtype, shape, count, and -- where an engine ships the tensor
    as it is -- contiguity.

    ``contiguous`` (default: ``what == "iter_local"``) requires contiguous tensors. Only
    ``iter_local`` needs it: its consumer, vLLM's ``nccl_m2n`` trainer engine (0.33, 0.34)
    (``m2n_trainer.py``), hands each shard unchanged to ``nccl.m2n.reshard``, which sends from the
    shard's memory, so a strided view would ship the wrong bytes. Every ``iter_full`` consumer
    linearizes what it gets, so a non-contiguous full tensor is a valid stream there and is accepted
    (vLLM's ``ModuleSource`` yields such tensors): the NCCL engine sends ``tensor.contiguous()``
    (unpacked) or packs through ``pack_tensors`` (``.contiguous().view(-1)``), the IPC engine shares
    ``tensor.detach().contiguous()``, ``sharded_rdt`` exports ``tensor.contiguous()`` or copies small
    tensors into a contiguous ring slot, weightsync's loopback flattens with ``reshape(-1)`` and the
    checkpoint writer copies a non-contiguous tensor once.
    """
    if contiguous is None:
        contiguous = what == "iter_local"
    n = len(expected)
    i = 0
    for name, tensor in pairs:
        if i >= n:
            raise MetadataMismatchError(
                f"rank {rank}: {what} yielded more tensors than metadata declares for this rank "
                f"({len(expected)}); first extra is {_fmt(name, tensor.dtype, tensor.shape)}"
            )
        m = expected[i]
        shape = m.shape if local_shapes is None else local_shapes[i]
        # (torch.Size compares equal to a tuple of the same sizes: no tuple() per tensor)
        if name != m.name or tensor.dtype != m.dtype or (tensor.shape != shape and tuple(tensor.shape) != tuple(shape)):
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
        if contiguous and not tensor.is_contiguous():
            raise MetadataMismatchError(
                f"rank {rank}: {what} yielded a non-contiguous tensor at index {i} "
                f"({_fmt(name, tensor.dtype, tensor.shape)}, strides {tuple(tensor.stride())}); "
                f"the {what} consumer (vLLM's nccl_m2n) sends the piece's memory as it is, so it "
                "would ship wrong bytes: yield .contiguous() pieces"
            )
        i += 1
        yield name, tensor
        del tensor  # never hold the previous tensor while the source produces the next one
    if i != len(expected):
        missing = expected[i]
        raise MetadataMismatchError(
            f"rank {rank}: {what} stopped after {i} tensors but metadata declares {len(expected)} "
            f"for this rank; first missing is {_fmt(missing.name, missing.dtype, missing.shape)}"
        )


def control_group(group: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A gloo group over the same ranks as ``group`` (default: the world) whose ops time out.

    weightsync's control collectives run on gloo so they are bounded and stay off the device whatever
    backend the trainer uses. Created once per (ranks, timeout); only the members synchronize on
    creation, at the first control exchange they all reach.
    """
    return bounded_group(group_ranks(group), timeout_s=timeout_s)


def verify_metadata_agreement(
    metadata: list[ParamMeta],
    *,
    group: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "metadata",
    board: Board | None = None,
) -> None:
    """Raise on every rank of ``group`` unless all ranks hold identical ``metadata``.

    One exchange of a digest (sha256 of names, dtypes, shapes, owners, mesh, placements, plus the
    entry count) on the default store (``Board.exchange``; no process group is involved): a rank that does not arrive within ``timeout_s`` is
    named in a ``SyncTimeoutError``; a rank that failed before arriving (its ``metadata`` raised,
    say) and posted on ``board`` is quoted in a ``PeerFailedError``. Only on mismatch is the full
    metadata exchanged, to name the first differing entry in a ``CrossRankMismatchError`` raised
    identically on every rank. No-op without an initialized process group or with one rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    ranks = group_ranks(group)
    if len(ranks) == 1:
        return
    board = board or Board(next_tag("agree"))
    rank = dist.get_rank()
    digest = f"{metadata_digest(metadata)}:{len(metadata)}"
    digests = board.exchange(
        digest, ranks=ranks, timeout_s=timeout_s,
        what=f"the cross-rank {what} agreement (before the first collective)", parse=_parse_digest,
    )
    if all(d == digest for d in digests.values()):
        return
    entries = board.exchange(
        repr([meta_entry(m) for m in metadata]), ranks=ranks, timeout_s=timeout_s,
        what=f"the exchange of differing {what}", parse=_parse_entries,
    )
    everyone = [entries[r] for r in ranks]
    raise CrossRankMismatchError(_first_difference(rank, ranks, everyone, what))


def _parse_digest(text: str) -> str:
    """``<sha256 hex>:<entry count>``, as ``verify_metadata_agreement`` posts it."""
    if not re.fullmatch(r"[0-9a-f]{64}:\d+", text):
        raise ValueError("not a '<sha256>:<count>' metadata digest")
    return text


def _parse_entries(text: str) -> list:
    """The ``repr`` of a list of ``meta_entry`` tuples (plain literals only: ``ast.literal_eval``)."""
    entries = ast.literal_eval(text)
    if not isinstance(entries, list) or not all(isinstance(e, tuple) for e in entries):
        raise ValueError("not a list of metadata entries")
    return entries


def _parse_count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise ValueError("a negative tensor count")
    return count


def _first_difference(rank: int, ranks: tuple[int, ...], everyone: list[Any], what: str) -> str:
    ref_rank, ref = ranks[0], everyone[0]
    differing = [r for r, other in zip(ranks, everyone) if other != ref]
    other_rank = differing[0]
    other = everyone[ranks.index(other_rank)]
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else "<no entry>"
        b = other[i] if i < len(other) else "<no entry>"
        if a != b:
            field = _which_field(a, b)
            return (
                f"rank {rank}: trainer ranks disagree about {what}: rank{'s' if len(differing) > 1 else ''} "
                f"{', '.join(map(str, differing))} differ{'' if len(differing) > 1 else 's'} from rank "
                f"{ref_rank}; first difference (rank {other_rank}) at entry {i} of "
                f"{len(ref)}/{len(other)}{field}: rank {ref_rank} has {a}, rank {other_rank} has {b}. "
                "Every rank must build the same model with the same config and the same wrapping."
            )
    return f"rank {rank}: {what} digests differ across ranks {differing} but entries are equal"


_FIELDS = ("name", "dtype", "shape", "owners", "mesh_shape", "placements")


def _which_field(a: Any, b: Any) -> str:
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        return " (count)"
    diff = [f for f, x, y in zip(_FIELDS, a, b) if x != y]
    return f" ({', '.join(diff)})"


def _owned_count(metadata: list[ParamMeta], rank: int) -> int:
    return sum(1 for m in metadata if m.owners is None or rank in m.owners)


class CheckedSource(WeightSource):
    """Wraps any ``WeightSource``; every pass is checked on this rank and agreed across ranks.

    ``metadata`` is the wrapped source's, unchanged (same objects, no collective). ``iter_full`` and
    ``iter_local`` exist iff the wrapped source implements them. A pass:

    1. (first pass, ``agree=True``) verifies every rank holds the same metadata before the wrapped
       source runs any collective (``verify_metadata_agreement``);
    2. checks each yielded pair against this rank's share of metadata (``check_stream``), unless the
       wrapped source declares that it does that itself (``core/protocols.checks_stream``: weightsync's
       own sources with ``check=True``; a wrapper that declares nothing is checked, whatever it wraps) --
       the same check twice would only cost host time per tensor;
    3. (``end_check=True``) ends with one bounded 8-byte all-gather of every rank's tensor count, so a
       rank whose source runs no collective still learns that another rank failed, and the pass
       returns on no rank unless it completed on all.

    Any error on this rank is posted on the pass's ``Board`` before it propagates, so peers blocked in
    a weightsync wait raise ``PeerFailedError`` quoting it instead of waiting out a timeout; an error
    of the wrapped source's own collectives (its process group timed out) is re-raised as
    ``PeerFailedError`` when another rank posted first. With ``checksums=True`` each yielded tensor's
    ``integrity.checksum`` is recorded in ``last_checksums`` (resolved at the end of the pass, one
    device sync). Nothing here copies, casts or mutates a tensor.
    """

    def __init__(
        self,
        source: WeightSource,
        *,
        rank: int | None = None,
        agree: bool = True,
        end_check: bool = True,
        checksums: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.source = source
        self._rank = rank
        self.agree = agree
        self.end_check = end_check
        self.checksums = checksums
        self.timeout_s = timeout_s
        self._agreed = False
        self.last_checksums: dict[str, str] = {}
        #: Passes started on this rank (the driver compares it around ``send_weights``).
        self.passes = 0
        #: the wrapped source sends from many ranks (``senders="owners"``): no exchange inside a pass
        self.many_senders = senders_of(source) == "owners"
        if self.many_senders and agree and multi_rank():
            verify_metadata_agreement(self.metadata, timeout_s=timeout_s, what="metadata (many senders)")
            self._agreed = True

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata

    @property
    def senders(self) -> str:
        """The wrapped source's (``core/protocols.py``: declared, not forwarded)."""
        return senders_of(self.source)

    @property
    def checks_stream(self) -> bool:
        """Every pass is checked, here or by the wrapped source itself."""
        return True

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

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.source.implements_iter_full():
            raise NotImplementedError(f"{type(self.source).__name__} does not implement iter_full")
        return self._pass("iter_full", self.source.iter_full, local=False)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.source.implements_iter_local():
            raise NotImplementedError(f"{type(self.source).__name__} does not implement iter_local")
        return self._pass("iter_local", self.source.iter_local, local=True)

    def _pass(self, what: str, make_iter: Any, *, local: bool) -> Iterator[tuple[str, torch.Tensor]]:
        multi = multi_rank()
        self.passes += 1
        board = Board(next_tag("pass")) if multi else None
        count, last = 0, None
        sums: list[tuple[str, torch.Tensor]] = []
        inner = stream = None
        if board is not None:
            activate(board)
        try:
            metadata = self.metadata
            if multi and self.agree and not self._agreed and not self.many_senders:
                verify_metadata_agreement(metadata, timeout_s=self.timeout_s, board=board)
                self._agreed = True
            stream = inner = make_iter()
            if not checks_stream(self.source):
                expected = self._expected()
                shapes = [local_shape(m, self.rank) for m in expected] if local else None
                stream = check_stream(stream, expected, rank=self.rank, what=what, local_shapes=shapes)
            for name, tensor in stream:
                if self.checksums:
                    sums.append((name, checksum_tensor(tensor)))
                count, last = count + 1, name
                yield name, tensor
                del tensor  # as in check_stream: no extra reference across the next gather
            if multi and self.end_check and not self.many_senders:
                self._end_of_pass(board, what, count, metadata)
            if self.checksums:
                self.last_checksums = resolve_checksums(sums)
        except GeneratorExit:
            if board is not None:
                board.fail(
                    f"rank {self.rank}: the consumer of {what} stopped the pass after {count} of "
                    f"{len(self._expected())} tensors (last {last!r})"
                )
                discard_groups()
            raise
        except PeerFailedError:
            discard_groups()
            raise
        except BaseException as e:
            if board is None:
                raise
            failure = board.failure()
            if failure is not None and failure[0] != dist.get_rank() and not isinstance(e, WeightSyncError):
                discard_groups()
                raise PeerFailedError(
                    f"rank {self.rank}: {what} failed at tensor {count} after rank {failure[0]} "
                    f"failed: {failure[1]} (this rank's own error: {type(e).__name__}: {e})"
                ) from e
            board.fail(f"{type(e).__name__}: {e}")
            discard_groups()
            raise
        finally:
            # Close the wrapped pass now (not at garbage collection), while this pass's board is
            # still active: a source that posted collectives ahead (overlap) waits them out here.
            for it in (stream, inner):
                close = getattr(it, "close", None)
                if callable(close):
                    close()
            if board is not None:
                deactivate(board)

    def _end_of_pass(self, board: Board, what: str, count: int, metadata: list[ParamMeta]) -> None:
        ranks = group_ranks(None)
        counts = board.exchange(
            str(count), ranks=ranks, timeout_s=self.timeout_s,
            what=f"the end-of-pass check of {what} (this rank yielded {count} tensors)", parse=_parse_count,
        )
        for r, c in counts.items():
            want = _owned_count(metadata, r)
            if c != want:
                raise CrossRankMismatchError(
                    f"rank {self.rank}: rank {r} finished {what} after {c} tensors but "
                    f"metadata declares {want} for it"
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
        shape[dim] = chunk_rows(shape[dim], m.mesh_shape[axis], coords[axis])[1]
    return tuple(shape)


def checked(source: WeightSource, **kwargs: Any) -> WeightSource:
    """``CheckedSource(source, **kwargs)``, unless ``source`` is already checked."""
    if isinstance(source, CheckedSource):
        return source
    return CheckedSource(source, **kwargs)
