"""Bitwise diff of a piece against the snapshot of what the receiver holds for it.

Invariants:

* **Exact**: elements are compared as the integers of their wire bytes (bf16 as int16, fp32 as int32,
  FP8 as uint8), so every changed byte pattern counts -- ``-0.0`` vs ``0.0``, one NaN payload vs
  another -- and nothing else does. No tolerance, no hash, no sampled detector.
* **Bounded memory**: one snapshot per piece, in the wire dtype (bytes per element of the rank's
  shard: 2 for bf16), where the piece lives (``"device"``) or in host memory (``"cpu"``, pinned when
  the piece is on an accelerator). Nothing else is kept between rounds.
* The snapshot changes only with exactly the values the round delivers: through ``commit`` /
  ``commit_group`` on the torch path; on the kernel's path (``diff_triton``) the kernel writes the
  new bits as it diffs, and a round that stops before delivering them drops that bucket's snapshot
  (``drop_pending``), so its next diff carries every element.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..core.layouts.pieces import Piece

__all__ = ["Snapshots", "Changed", "bits", "has_nan", "any_nan", "changed_positions"]

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, viewed as the integers of its bytes (no copy when ``t`` is contiguous)."""
    flat = t.reshape(-1)
    return flat.view(_INT_OF[flat.element_size()]) if flat.dtype.is_floating_point else flat


def has_nan(values: torch.Tensor) -> bool:
    """Whether any of ``values`` is a NaN (vLLM's sparse apply reads NaN as "unchanged")."""
    if not values.dtype.is_floating_point or values.numel() == 0:
        return False
    if values.element_size() == 1:  # float8: e4m3fn NaN is S.1111.111, e5m2 NaN is S.11111.xx (xx != 0)
        b = values.view(torch.uint8)
        if values.dtype == torch.float8_e4m3fn:
            return bool(((b & 0x7F) == 0x7F).any())
        return bool((((b & 0x7C) == 0x7C) & ((b & 0x03) != 0)).any())
    return bool(torch.isnan(values).any())


def any_nan(found: list[Changed]) -> bool:
    """Whether any of ``found``'s new values is a NaN: the kernel's flags where every piece has one,
    else one check over all values (one pass and one host sync, not one per piece)."""
    if all(ch.nan is not None for ch in found):
        return any(ch.nan for ch in found)
    return has_nan(torch.cat([ch.values.reshape(-1) for ch in found])) if found else False


Key = tuple[str, tuple[int, ...], tuple[int, ...]]


def changed_positions(cur: torch.Tensor, snap: torch.Tensor) -> torch.Tensor:
    """Row-major positions (int64, ascending) where the bytes of ``cur`` and ``snap`` (same dtype,
    contiguous, 1-D) differ.

    Compared 8 bytes at a time where the layout allows (4 bf16 per int64 word), then lane by lane only
    in the words that differ: with a few percent of elements changed, the scan and ``nonzero`` run over
    a quarter of the elements (figures: docs/evidence.md, "Delta sync")."""
    n, es = cur.numel(), cur.element_size()
    k = 8 // es
    if (k > 1 and n % k == 0 and cur.is_contiguous() and snap.is_contiguous()
            and (cur.storage_offset() * es) % 8 == 0 and (snap.storage_offset() * es) % 8 == 0):
        w, sw = cur.view(torch.int64), snap.view(torch.int64)
        words = (w != sw).nonzero().view(-1)
        if not words.numel():
            return words
        a = w.index_select(0, words).view(_INT_OF[es]).view(-1, k)
        b = sw.index_select(0, words).view(_INT_OF[es]).view(-1, k)
        lanes = (a != b).view(-1).nonzero().view(-1)
        return words[lanes // k] * k + lanes % k
    return (bits(cur) != bits(snap)).nonzero().view(-1)


@dataclass
class Changed:
    """What a piece changed since the snapshot: ``pos`` (row-major positions in the box, ascending;
    int64, or int32 from the CUDA kernels) and
    ``values`` (the new wire values there), or ``pos=None`` for every element (``values`` is then the
    whole box in the wire dtype, flattened)."""

    piece: Piece
    pos: torch.Tensor | None
    values: torch.Tensor
    #: whether ``values`` hold a NaN, where the diff already knows (the kernel's flags); None: ask them
    nan: bool | None = None

    @property
    def count(self) -> int:
        return self.values.numel()

    def has_nan(self) -> bool:
        """Whether a new value is a NaN (the kernel's flag where it ran: no pass, no sync)."""
        return has_nan(self.values) if self.nan is None else self.nan

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole box in the wire ``dtype``, shaped as the box."""
        if self.pos is None:
            return self.values.view(self.piece.tensor.shape)
        t = self.piece.tensor
        return t if t.dtype == dtype else t.to(dtype)


class Snapshots:
    """The receiver's bytes for each of this rank's pieces, as of the last delivered round."""

    def __init__(self, where: str = "device") -> None:
        if where not in ("device", "cpu"):
            raise ValueError(f"snapshot= must be 'device' or 'cpu', got {where!r}")
        self.where = where
        self._store: dict[Key, torch.Tensor] = {}
        #: per exchange group and (wire dtype, device): (pieces' signature, flat snapshot)
        self._groups: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}
        #: per bucket: (pieces' signature, ``diff_triton.Layout``), for the kernel's block table
        self._layouts: dict[tuple, tuple[tuple, Any]] = {}
        #: per bucket: changed elements of its last kernel diff (the next output's capacity guess)
        self._last_changed: dict[tuple, int] = {}
        #: buckets diffed by ``diff_triton`` so far (a count the round's stats report)
        self.kernel_buckets = 0

    @staticmethod
    def key(piece: Piece) -> Key:
        return piece.name, tuple(piece.offsets), tuple(piece.tensor.shape)

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self._store.values())
                + sum(t.numel() * t.element_size() for _, t in self._groups.values()))

    def placement(self) -> tuple[frozenset[str], bool]:
        """Where the snapshot lives: the device types of its tensors, and whether every host tensor
        among them is pinned (True when none is on the host)."""
        held = list(self._store.values()) + [t for _, t in self._groups.values()]
        return (frozenset(t.device.type for t in held),
                all(t.is_pinned() for t in held if t.device.type == "cpu"))

    def clear(self) -> None:
        self._store.clear()
        self._groups.clear()
        self._scratch.clear()
        self._layouts.clear()
        self._last_changed.clear()

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` in ``dtype``, flattened, in a scratch buffer reused across pieces and rounds: a fresh
        allocation per piece costs page faults larger than the cast itself."""
        nbytes = t.numel() * torch.empty((), dtype=dtype).element_size()
        buf = self._scratch.get(t.device)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[t.device] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=t.device)
        out = buf[:nbytes].view(dtype)
        out.view(t.shape).copy_(t)
        return out

    def diff(self, piece: Piece, dtype: torch.dtype, *, everything: bool) -> Changed:
        """``piece``'s changes in the wire ``dtype``: every element when ``everything`` or when there is no
        snapshot yet. Values are fresh tensors (never the scratch, never the piece's storage)."""
        t = piece.tensor
        snap = None if everything else self._store.get(self.key(piece))
        if snap is None:
            whole = t.reshape(-1).to(dtype) if t.dtype != dtype else t.reshape(-1)
            return Changed(piece, None, whole)
        cur = self._cast(t, dtype) if t.dtype != dtype else t.reshape(-1)
        if snap.device != cur.device:
            snap = snap.to(cur.device, non_blocking=True)
        pos = changed_positions(cur, snap.view(-1))
        return Changed(piece, pos, bits(cur).index_select(0, pos).view(dtype))

    def commit(self, ch: Changed) -> None:
        """Make the snapshot what the receiver holds once ``ch`` is delivered."""
        key = self.key(ch.piece)
        snap = self._store.get(key)
        if ch.pos is None:
            if snap is None:
                self._store[key] = self._fresh(ch.values)
            else:
                snap.view(-1).copy_(ch.values, non_blocking=True)
            return
        if not ch.pos.numel():
            return
        assert snap is not None
        flat = bits(snap)  # as integers: index_copy_ has no float8 kernel on CPU
        if flat.device == ch.pos.device:
            flat.index_copy_(0, ch.pos, bits(ch.values))
        else:
            flat.index_copy_(0, ch.pos.to(flat.device), bits(ch.values).to(flat.device))

    # ---- a group of pieces at once ------------------------------------------------------------------

    def diff_group(self, key: Any, items: list[tuple[Piece, torch.dtype]], *, everything: bool) -> list[Changed]:
        """Every piece of one exchange group, diffed as one flat buffer per (wire dtype, device): one
        cast copy per piece into the group's scratch, then one word compare, one ``nonzero`` and one
        gather for the whole group, split back per piece (``searchsorted`` on the pieces' starts).
        Per-piece work is what a pass of many small tensors pays for (a MoE checkpoint's 18,432 expert
        tensors; on a GPU each op is a launch and each ``nonzero`` a sync), so it is done once per group.

        The snapshot of a group is one flat tensor per bucket, kept with the pieces' signature (names,
        offsets, shapes): a group whose pieces changed shape or place has no snapshot (every element).
        ``commit_group`` makes it what the round delivers. Same results as ``diff`` piece by piece.

        On CUDA (or Triton's interpreter) a bucket of contiguous pieces of one dtype is one
        ``diff_triton`` launch instead: cast, compare, compact and snapshot update in one read of each
        element, one host sync per bucket; its output is sized from the bucket's last count."""
        out: list[Changed | None] = [None] * len(items)
        buckets: dict[tuple, list[int]] = {}
        for j, (p, dt) in enumerate(items):
            buckets.setdefault((dt, p.tensor.device), []).append(j)
        pending = self.__dict__.setdefault("_pending", [])
        for (dt, dev), js in buckets.items():
            pieces = [items[j][0] for j in js]
            sig = tuple((p.name, tuple(p.offsets), tuple(p.tensor.shape)) for p in pieces)
            sizes = [p.tensor.numel() for p in pieces]
            starts = [0]
            for n in sizes:
                starts.append(starts[-1] + n)
            bkey = (key, dt, str(dev))
            held = None if everything else self._groups.get(bkey)
            snap = held[1] if held is not None and held[0] == sig else None
            if snap is None:
                whole = torch.empty(starts[-1], dtype=dt, device=dev)
                _fill(whole, pieces, starts)
                for j, p, a, n in zip(js, pieces, starts, sizes):
                    out[j] = Changed(p, None, whole[a: a + n])
                pending.append((bkey, sig, whole, None, None))
                continue
            if snap.device != dev:
                snap = snap.to(dev, non_blocking=True)
            kern = _kernels(dev)
            tensors = [p.tensor for p in pieces]
            if kern is not None and kern.eligible(tensors, snap, dt):
                layout = self._layouts.get(bkey)
                if layout is None or layout[0] != sig:
                    layout = self._layouts[bkey] = (sig, kern.Layout(sizes, dev))
                n = starts[-1]
                cap = min(n, max(n // 16, self._last_changed.get(bkey, 0) * 5 // 4) + kern.BLOCK)
                # the kernel writes the new bits into ``snap`` as it diffs: the held snapshot itself
                # (committed now; ``drop_pending`` forgets it if the round stops), or a device copy of a
                # host one (committed by positions at ``commit_group``, as the torch path does)
                r = kern.diff(tensors, snap, dt, layout[1], capacity=cap)
                self._last_changed[bkey] = sum(r.counts)
                for j, p, ps, vs, nan in zip(js, pieces, r.pos.split(r.counts), r.values.split(r.counts), r.nan):
                    out[j] = Changed(p, ps, vs, nan)
                if snap is held[1]:
                    pending.append((bkey, sig, "written", None, None))
                else:
                    cnt = torch.tensor(r.counts, dtype=torch.int64).to(dev, non_blocking=True)
                    flat = r.pos.long() + layout[1].pflat.repeat_interleave(cnt, output_size=r.pos.numel())
                    pending.append((bkey, sig, None, flat, r.values))
                self.kernel_buckets += 1
                continue
            cur = self._flat_scratch(starts[-1], dt, dev)
            _fill(cur, pieces, starts)
            pos = changed_positions(cur, snap)
            vals = bits(cur).index_select(0, pos).view(dt)
            if pos.numel():
                bounds = torch.tensor(starts[1:-1], dtype=pos.dtype, device=pos.device)
                counts = torch.bincount(torch.searchsorted(bounds, pos, right=True), minlength=len(pieces)).tolist()
            else:
                counts = [0] * len(pieces)
            for j, p, a, ps, vs in zip(js, pieces, starts, pos.split(counts), vals.split(counts)):
                out[j] = Changed(p, ps - a if a else ps, vs)
            pending.append((bkey, sig, None, pos, vals))
        return out  # type: ignore[return-value]

    def commit_group(self) -> None:
        """Make the group snapshots what the groups diffed since the last call deliver."""
        for bkey, sig, whole, pos, vals in self.__dict__.pop("_pending", []):
            if isinstance(whole, str):  # "written": the kernel updated the held snapshot as it diffed
                continue
            if whole is not None:
                self._groups[bkey] = (sig, whole if self.where == "device" or whole.device.type == "cpu" else self._fresh(whole))
                continue
            if pos.numel():
                flat = bits(self._groups[bkey][1])
                flat.index_copy_(0, pos.to(flat.device), bits(vals).to(flat.device))

    def drop_pending(self) -> None:
        """Forget diffs not committed (a round that stopped before its snapshot update). A snapshot the
        kernel already wrote holds values the receiver may not: it is dropped, so the bucket's next
        diff carries every element (the next round is an anchor anyway: ``DeltaSource``)."""
        for bkey, _, whole, _, _ in self.__dict__.pop("_pending", []):
            if isinstance(whole, str):
                self._groups.pop(bkey, None)

    def _flat_scratch(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[device] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)

    def _fresh(self, src: torch.Tensor) -> torch.Tensor:
        if self.where == "device" or src.device.type == "cpu":
            return src.detach().clone().contiguous()
        out = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        out.copy_(src, non_blocking=True)
        return out


_KERNELS: Any = None


def _kernels(device: torch.device) -> Any:
    """``diff_triton`` for a CUDA bucket (or any bucket under Triton's CPU interpreter,
    ``TRITON_INTERPRET=1``, which is how the tests run the kernels without a GPU); None where Triton
    is missing or ``WEIGHTSYNC_DELTA_TRITON=0`` (the torch path then runs: same results)."""
    global _KERNELS
    if os.environ.get("WEIGHTSYNC_DELTA_TRITON") == "0":  # opt out: the torch path below
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if _KERNELS is None:
        try:
            from . import diff_triton
        except Exception:  # noqa: BLE001 - no Triton: the torch ops below do the same diff
            diff_triton = False
        _KERNELS = diff_triton
    return _KERNELS or None


def _fill(flat: torch.Tensor, pieces: list[Piece], starts: list[int]) -> None:
    """Each piece, cast to ``flat``'s dtype, into its slice of ``flat`` (one multi-tensor copy where
    torch has one)."""
    dst = [flat[a: b].view(p.tensor.shape) for p, a, b in zip(pieces, starts, starts[1:])]
    src = [p.tensor for p in pieces]
    try:
        torch._foreach_copy_(dst, src)
    except (RuntimeError, AttributeError, TypeError):
        for d, t in zip(dst, src):
            d.copy_(t)
