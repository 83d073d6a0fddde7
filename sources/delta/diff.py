"""Bitwise diff of a piece against the snapshot of what the receiver holds for it.

Invariants:

* **Exact**: elements are compared as the integers of their wire bytes (bf16 as int16, fp32 as int32,
  FP8 as uint8), so every changed byte pattern counts -- ``-0.0`` vs ``0.0``, one NaN payload vs
  another -- and nothing else does. No tolerance, no hash, no sampled detector.
* **Bounded memory**: one snapshot per piece, in the wire dtype (bytes per element of the rank's
  shard: 2 for bf16), where the piece lives (``"device"``) or in host memory (``"cpu"``, pinned when
  the piece is on an accelerator). Nothing else is kept between rounds.
* The snapshot changes only through ``commit``, with exactly the values the round delivers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.pieces import Piece

__all__ = ["Snapshots", "Changed", "bits", "has_nan"]

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


Key = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass
class Changed:
    """What a piece changed since the snapshot: ``pos`` (int64 row-major positions in the box) and
    ``values`` (the new values there), or ``pos=None`` for every element (``values`` is then the
    whole box, flattened)."""

    piece: Piece
    pos: torch.Tensor | None
    values: torch.Tensor

    @property
    def count(self) -> int:
        return self.values.numel()


class Snapshots:
    """The receiver's bytes for each of this rank's pieces, as of the last delivered round."""

    def __init__(self, where: str = "device") -> None:
        if where not in ("device", "cpu"):
            raise ValueError(f"snapshot= must be 'device' or 'cpu', got {where!r}")
        self.where = where
        self._store: dict[Key, torch.Tensor] = {}

    @staticmethod
    def key(piece: Piece) -> Key:
        return piece.name, tuple(piece.offsets), tuple(piece.tensor.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._store.values())

    def clear(self) -> None:
        self._store.clear()

    def diff(self, piece: Piece, *, everything: bool) -> Changed:
        """``piece``'s changes: every element when ``everything`` or when there is no snapshot yet."""
        cur = piece.tensor.reshape(-1)
        snap = None if everything else self._store.get(self.key(piece))
        if snap is None:
            return Changed(piece, None, cur)
        if snap.device != cur.device:
            snap = snap.to(cur.device, non_blocking=True)
        pos = (bits(cur) != bits(snap)).nonzero().view(-1)
        return Changed(piece, pos, cur[pos])

    def commit(self, ch: Changed) -> None:
        """Make the snapshot what the receiver holds once ``ch`` is delivered."""
        key = self.key(ch.piece)
        snap = self._store.get(key)
        if ch.pos is None:
            src = ch.values.view(ch.piece.tensor.shape) if ch.values.numel() else ch.piece.tensor
            if snap is None:
                self._store[key] = self._fresh(src)
            else:
                snap.copy_(src.reshape(snap.shape), non_blocking=True)
            return
        if not ch.pos.numel():
            return
        assert snap is not None
        flat = snap.view(-1)
        if flat.device == ch.pos.device:
            flat[ch.pos] = ch.values
        else:
            flat[ch.pos.to(flat.device)] = ch.values.to(flat.device)

    def _fresh(self, src: torch.Tensor) -> torch.Tensor:
        if self.where == "device" or src.device.type == "cpu":
            return src.detach().clone().contiguous()
        out = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        out.copy_(src, non_blocking=True)
        return out
