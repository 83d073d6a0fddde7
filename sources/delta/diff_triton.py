"""A group's bitwise diff as two Triton kernels (CUDA; Triton's interpreter runs them on CPU in tests).

What ``Snapshots.diff_group`` does with torch ops -- cast every piece into one flat scratch, compare
words, ``nonzero``, gather, split per piece -- costs a pass over the group per op and a host sync per
``nonzero``. Here the pieces are read where they live, once, in their own dtype:

``mark``: one program per ``BLOCK`` elements of one piece (a block never spans two pieces). It loads
the block, casts it to the wire dtype (round to nearest even, as torch's ``.to``), compares the wire
bits with the snapshot's as integers, and writes the block's changed count and a bitmask (1 bit per
element). Reads: the piece once and the snapshot once; writes 1/8 byte per element.

``extract``: one program per block with a non-zero count. It expands the bitmask, takes each changed
element's slot from the block's exclusive prefix count plus its rank in the block, loads only the
changed elements again (masked lanes issue no memory request) and writes the wire value, its flat
position in the group and its position in its piece.

Invariants: the output is in ascending flat order (block order, then lane order), so each piece's
changes are one contiguous run, as ``torch.nonzero`` gives; the bits compared are exactly the bits of
the wire values (``-0.0`` vs ``0.0`` differ; NaN is left to the caller, which refuses it); the
snapshot is read, never written (the caller commits after delivery). One host sync per group: the
per-piece counts, needed to size the outputs.
"""

from __future__ import annotations

from array import array

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "Layout", "eligible", "diff"]

#: elements per program; a multiple of 32 (one bitmask word per 32 elements)
BLOCK = 4096

_INT = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _block_of(b, blk_piece_ptr, blk_start_ptr, poff_ptr, plen_ptr, pflat_ptr, BLOCK: tl.constexpr):
    """Program ``b``'s piece: element offset of the piece from the base pointer, the block's indices
    within the piece, their mask, and the piece's start in the flat group."""
    p = tl.load(blk_piece_ptr + b)
    s = tl.load(blk_start_ptr + b)
    off = tl.load(poff_ptr + p)
    n = tl.load(plen_ptr + p)
    f = tl.load(pflat_ptr + p)
    idx = s + tl.arange(0, BLOCK).to(tl.int64)
    return off, idx, idx < n, f


@triton.jit
def _wire_bits(x, WIRE: tl.constexpr, INT: tl.constexpr, RNE16: tl.constexpr):
    """``x`` cast to the wire dtype, as the integers of its bits. ``RNE16`` (float32 to bfloat16):
    round to nearest even in integer arithmetic, torch's own formula (``c10::BFloat16``), so every
    backend -- the GPU and Triton's CPU interpreter alike -- gives torch's bits for every non-NaN."""
    if RNE16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)
    return x.to(WIRE).to(INT, bitcast=True)


@triton.jit
def _mark_kernel(base_ptr, snap_ptr, mask_ptr, count_ptr, blk_piece_ptr, blk_start_ptr, poff_ptr, plen_ptr,
                 pflat_ptr, BLOCK: tl.constexpr, WIRE: tl.constexpr, INT: tl.constexpr, RNE16: tl.constexpr):
    b = tl.program_id(0)
    off, idx, m, f = _block_of(b, blk_piece_ptr, blk_start_ptr, poff_ptr, plen_ptr, pflat_ptr, BLOCK)
    x = tl.load(base_ptr + off + idx, mask=m, other=0.0)
    w = _wire_bits(x, WIRE, INT, RNE16)
    s = tl.load(snap_ptr + f + idx, mask=m, other=0)
    ch = ((w != s) & m).to(tl.uint32)
    tl.store(count_ptr + b, tl.sum(ch.to(tl.int32), axis=0))
    words = tl.sum(tl.reshape(ch, (BLOCK // 32, 32)) << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)
    tl.store(mask_ptr + b.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32), words.to(tl.int32, bitcast=True))


@triton.jit
def _extract_kernel(base_ptr, mask_ptr, count_ptr, excl_ptr, blk_piece_ptr, blk_start_ptr, poff_ptr, plen_ptr,
                    pflat_ptr, val_ptr, flat_ptr, local_ptr, BLOCK: tl.constexpr, WIRE: tl.constexpr,
                    INT: tl.constexpr, RNE16: tl.constexpr):
    b = tl.program_id(0)
    c = tl.load(count_ptr + b)
    if c > 0:
        off, idx, m, f = _block_of(b, blk_piece_ptr, blk_start_ptr, poff_ptr, plen_ptr, pflat_ptr, BLOCK)
        words = tl.load(mask_ptr + b.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)).to(tl.uint32,
                                                                                                   bitcast=True)
        bits = tl.reshape((words[:, None] >> tl.arange(0, 32).to(tl.uint32)[None, :]) & 1, (BLOCK,)).to(tl.int32)
        ch = bits != 0
        slot = tl.load(excl_ptr + b) + (tl.cumsum(bits, axis=0) - bits).to(tl.int64)
        x = tl.load(base_ptr + off + idx, mask=ch, other=0.0)
        tl.store(val_ptr + slot, _wire_bits(x, WIRE, INT, RNE16), mask=ch)
        tl.store(flat_ptr + slot, f + idx, mask=ch)
        tl.store(local_ptr + slot, idx.to(tl.int32), mask=ch)


def eligible(pieces: list[torch.Tensor], snap: torch.Tensor, wire: torch.dtype) -> bool:
    """Whether the kernels take this bucket: contiguous pieces of one floating dtype they can cast
    (fp32 / bf16 / fp16) into a 2- or 4-byte floating wire dtype, a contiguous snapshot, one device."""
    if not pieces or wire not in _TL or wire.itemsize not in (2, 4) or snap.dtype != wire or not snap.is_contiguous():
        return False
    d0, dev = pieces[0].dtype, pieces[0].device
    return d0 in _TL and all(t.dtype == d0 and t.device == dev and t.is_contiguous() for t in pieces)


class Layout:
    """The block table of a bucket's pieces (depends on their sizes only, so it is kept with the
    snapshot and reused every round): per block its piece and start; per piece its length and flat
    start."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        nblk = [(n + BLOCK - 1) // BLOCK for n in sizes]
        piece = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(nblk))
        first = torch.tensor([0] + nblk[:-1], dtype=torch.int64).cumsum(0)
        start = (torch.arange(int(sum(nblk)), dtype=torch.int64) - first[piece.long()]) * BLOCK
        flat = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0)
        self.blocks = int(sum(nblk))
        self.piece = piece.to(device)
        self.start = start.to(device)
        self.plen = torch.tensor(sizes, dtype=torch.int64).to(device)
        self.pflat = flat.to(device)
        self.npieces = len(sizes)


def diff(pieces: list[torch.Tensor], snap: torch.Tensor, wire: torch.dtype, layout: Layout,
         scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Changes of ``pieces`` (in order, laid end to end as the flat group) against ``snap`` (the flat
    group in ``wire``): ``(flat positions (int64), positions within each piece (int32: a piece has
    fewer than 2**31 elements, which ``DeltaSource`` guarantees), wire values, per-piece counts)``,
    ascending. ``scratch``: reusable memory for the bitmask and counts (>= ``need(layout)``)."""
    dev = snap.device
    esz = pieces[0].element_size()
    base = pieces[0]
    b0 = base.data_ptr()
    offs = array("q", ((t.data_ptr() - b0) // esz for t in pieces))
    poff = torch.frombuffer(offs, dtype=torch.int64).to(dev, non_blocking=dev.type == "cuda")
    words = layout.blocks * (BLOCK // 32)
    if scratch is not None and scratch.numel() * scratch.element_size() >= (words + 2 * layout.blocks) * 4:
        area = scratch.view(torch.int32)
        mask, counts = area[:words], area[words: words + layout.blocks]
    else:
        mask = torch.empty(words, dtype=torch.int32, device=dev)
        counts = torch.empty(layout.blocks, dtype=torch.int32, device=dev)
    grid = (layout.blocks,)
    wtl = _TL[wire]
    idt = _int_dtype(wire.itemsize)
    rne16 = base.dtype == torch.float32 and wire == torch.bfloat16
    _mark_kernel[grid](base, snap.view(idt), mask, counts, layout.piece, layout.start, poff, layout.plen, layout.pflat,
                       BLOCK=BLOCK, WIRE=wtl, INT=_INT[wire.itemsize], RNE16=rne16)
    c64 = counts.to(torch.int64)
    excl = c64.cumsum(0) - c64
    per_piece = torch.zeros(layout.npieces, dtype=torch.int64, device=dev).index_add_(0, layout.piece.long(), c64)
    sizes = per_piece.tolist()  # the one host sync: sizes of the outputs
    total = sum(sizes)
    vals = torch.empty(total, dtype=wire, device=dev)
    flat = torch.empty(total, dtype=torch.int64, device=dev)
    local = torch.empty(total, dtype=torch.int32, device=dev)
    if total:
        _extract_kernel[grid](base, mask, counts, excl, layout.piece, layout.start, poff, layout.plen,
                              layout.pflat, vals.view(idt), flat, local, BLOCK=BLOCK, WIRE=wtl,
                              INT=_INT[wire.itemsize], RNE16=rne16)
    return flat, local, vals, sizes


def need(layout: Layout) -> int:
    """Bytes of scratch ``diff`` uses for ``layout`` (bitmask and counts)."""
    return (layout.blocks * (BLOCK // 32) + 2 * layout.blocks) * 4


def _int_dtype(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]
