"""A group's bitwise diff in one Triton kernel launch (CUDA; Triton's interpreter runs it on CPU in tests).

What ``Snapshots.diff_group`` does with torch ops -- cast every piece into one flat scratch, compare
words, ``nonzero``, gather, split per piece, then ``index_copy_`` into the snapshot at commit -- is a
pass over the group per op and a host sync per ``nonzero``. Here one launch per bucket (the group's
pieces of one dtype, end to end) reads each master element and each snapshot element once:

one program per ``BLOCK`` elements of one piece (a block never spans two pieces). It loads the block,
casts it to the wire dtype (round to nearest even, as torch's ``.to``), compares the wire bits with
the snapshot's as integers, and counts the changed elements. The block's place in the output is the
number of changed elements in every block before it: a **decoupled look-back** scan (Merrill &
Garland). Each program takes a ticket (an atomic counter: a program only waits on programs that
started before it, so it cannot wait on one that is not resident), publishes its count, then reads
its predecessors' published words ``LOOK`` at a time back to the nearest one that has published its
inclusive prefix, and publishes its own inclusive prefix. Flag and value share one 64-bit word, so a
reader never sees a flag without its value. The changed elements' wire values and int32 positions
in their piece go to ``slot = exclusive prefix + rank within the block``, and the snapshot takes the
new wire bits at those positions in the same pass.

Invariants:

* **Order**: slots ascend with (block, lane), so each piece's changes are one contiguous run in
  ascending position, as ``torch.nonzero`` gives and vLLM's sparse patches carry.
* **Bits**: the bits compared and written are exactly torch's cast on the same device, NaN
  patterns included (``_wire_bits`` says how, per cast and device); ``-0.0`` vs ``0.0`` differ. A changed NaN is flagged per piece (vLLM's apply reads NaN as "unchanged"; the
  round refuses it).
* **Bounded output, never a lost change**: the output holds ``capacity`` slots. A block whose
  changes do not fit writes nothing and leaves its snapshot elements as they were, so the blocks that
  wrote form a prefix of the block order; ``diff`` then launches again over the bucket with room for
  the rest (blocks already written now compare equal) and appends. Capacity is the caller's guess
  (``Snapshots`` keeps the last round's count per bucket): one launch and one host sync per bucket in
  the usual round, two of each when the guess was short.
* The snapshot is written in place: the caller must treat a bucket whose changes were not delivered
  as having no snapshot (``Snapshots.drop_pending`` does).
"""

from __future__ import annotations

from array import array

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "Layout", "Result", "eligible", "diff"]

#: elements per program; the block scan and the anchor update are over this many lanes
BLOCK = 4096
#: predecessors read per look-back step
LOOK = 32
#: published word: flag in bits 60-61 (1 = the block's own count, 2 = its inclusive prefix), value below
AGG, INC, VALUE = 1 << 60, 2 << 60, (1 << 60) - 1
_AGG, _INC, _VALUE = tl.constexpr(AGG), tl.constexpr(INC), tl.constexpr(VALUE)

_INT = {1: tl.uint8, 2: tl.int16, 4: tl.int32}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
#: per wire dtype: (mask of the magnitude bits, bits of +inf): a NaN's magnitude is above inf's
_NAN_TEST = {torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00),
             torch.float32: (0x7FFFFFFF, 0x7F800000)}


@triton.jit
def _as_f32(x, BF16_IN: tl.constexpr):
    """``x`` in float32, exactly (bfloat16 by its bits shifted: Triton's interpreter flushes bfloat16
    subnormals in a float cast)."""
    if BF16_IN:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _wire_bits(x, nan_pos, nan_neg, WIRE: tl.constexpr, INT: tl.constexpr, MODE: tl.constexpr,
               BF16_IN: tl.constexpr):
    """``x`` cast to the wire dtype, as the integers of its bits, exactly as torch's cast on this
    device (``MODE``, chosen by ``_mode``):

    0. Triton's own cast: the same dtype, float16 to float32, or float16 wires on CUDA (one ``cvt``
       instruction, the one torch's CUDA cast uses).
    1. to bfloat16: round to nearest even in integer arithmetic from the float32 bits, torch's own
       formula (``c10::BFloat16``), so the GPU and the interpreter give torch's bits for every
       non-NaN; a NaN gets the pattern torch's cast gives it on this device (``nan_pos`` /
       ``nan_neg`` by sign: 0xFFFF on CPU, the canonical NaN on CUDA).
    2. to float16 on CPU (the interpreter): numpy's cast, but a NaN as CPU torch's vector cast (x86
       F16C) gives it: sign, quiet bit, the top 10 payload bits (numpy sets no quiet bit).
    3. bfloat16 to float32: the bits shifted (``_as_f32``)."""
    if MODE == 1:
        u = _as_f32(x, BF16_IN).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        w = r.to(tl.uint16).to(tl.int16, bitcast=True)
        neg = (u >> 31) != 0
        return tl.where(x != x, tl.where(neg, nan_neg, nan_pos).to(tl.int16), w)
    if MODE == 2:
        y = _as_f32(x, BF16_IN)
        u = y.to(tl.uint32, bitcast=True)
        w = y.to(tl.float16).to(tl.int16, bitcast=True)
        q = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
        return tl.where(x != x, q.to(tl.uint16).to(tl.int16, bitcast=True), w)
    if MODE == 3:
        return _as_f32(x, BF16_IN).to(tl.int32, bitcast=True)
    return x.to(WIRE).to(INT, bitcast=True)


def _mode(device: torch.device, src: torch.dtype, wire: torch.dtype) -> int:
    """``_wire_bits``'s ``MODE`` for a cast of ``src`` to ``wire`` on ``device``."""
    if src == wire:
        return 0
    if wire == torch.bfloat16:
        return 1
    if wire == torch.float16:
        return 0 if device.type == "cuda" else 2
    return 3 if src == torch.bfloat16 else 0


@triton.jit
def _fused_kernel(base_ptr, snap_ptr, val_ptr, pos_ptr, state_ptr, ticket_ptr, nan_ptr, blk_piece_ptr,
                  blk_start_ptr, poff_ptr, plen_ptr, pflat_ptr, capacity, nan_pos, nan_neg,
                  BLOCK: tl.constexpr, LOOK: tl.constexpr, WIRE: tl.constexpr, INT: tl.constexpr,
                  MODE: tl.constexpr, BF16_IN: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr,
                  ALIGN: tl.constexpr):
    # the ticket, not program_id: every program with a smaller ticket has started (forward progress)
    b = tl.atomic_add(ticket_ptr, 1).to(tl.int64)
    p = tl.load(blk_piece_ptr + b)
    s0 = tl.load(blk_start_ptr + b)
    off = tl.multiple_of(tl.load(poff_ptr + p), ALIGN)  # ALIGN divides every offset (host-checked):
    n = tl.load(plen_ptr + p)
    f = tl.multiple_of(tl.load(pflat_ptr + p), ALIGN)  # lets the loads be vectorized
    idx = tl.multiple_of(s0, BLOCK) + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < n
    x = tl.load(base_ptr + off + idx, mask=m, other=0.0)
    w = _wire_bits(x, nan_pos, nan_neg, WIRE, INT, MODE, BF16_IN)
    s = tl.load(snap_ptr + f + idx, mask=m, other=0)
    ch = (w != s) & m
    chi = ch.to(tl.int32)
    c = tl.sum(chi, axis=0).to(tl.int64)
    # state_ptr[0] stands for "before the first block" (inclusive 0); block b publishes at b + 1
    tl.atomic_xchg(state_ptr + b + 1, c | _AGG)
    lanes = tl.arange(0, LOOK)
    excl = b * 0
    j = b  # the nearest predecessor's word not yet added
    done = (b < 0).to(tl.int32)  # 0, typed
    while done == 0:
        at = j - lanes
        word = tl.load(state_ptr + at, mask=at > 0, other=_INC, volatile=True)
        flag = word >> 60
        val = word & _VALUE
        stop = tl.min(tl.where(flag != 1, lanes, LOOK), axis=0)  # first word that is not a bare count
        fstop = tl.sum(tl.where(lanes == stop, flag, 0), axis=0)  # its flag (0: not published yet)
        excl += tl.sum(tl.where((lanes < stop) | ((lanes == stop) & (fstop == 2)), val, 0), axis=0)
        j -= stop
        done = (fstop == 2).to(tl.int32)
    tl.atomic_xchg(state_ptr + b + 1, (excl + c) | _INC)
    if (c > 0) & (excl + c <= capacity):
        slot = excl + (tl.cumsum(chi, axis=0) - chi).to(tl.int64)
        tl.store(val_ptr + slot, w, mask=ch)
        tl.store(pos_ptr + slot, idx.to(tl.int32), mask=ch)
        tl.store(snap_ptr + f + idx, w, mask=ch)
        isnan = ch & ((w.to(tl.int32) & ABS) > INF)
        if tl.sum(isnan.to(tl.int32), axis=0) > 0:
            tl.atomic_max(nan_ptr + p, 1)


def eligible(pieces: list[torch.Tensor], snap: torch.Tensor, wire: torch.dtype) -> bool:
    """Whether the kernel takes this bucket: contiguous pieces of one floating dtype it can cast
    (fp32 / bf16 / fp16) into a 2- or 4-byte floating wire dtype, a contiguous snapshot, one device."""
    if not pieces or wire not in _TL or wire.itemsize not in (2, 4) or snap.dtype != wire or not snap.is_contiguous():
        return False
    d0, dev, p0, esz = pieces[0].dtype, pieces[0].device, pieces[0].data_ptr(), pieces[0].element_size()
    return (d0 in _TL and snap.device == dev and all(
        t.dtype == d0 and t.device == dev and t.is_contiguous() and (t.data_ptr() - p0) % esz == 0 for t in pieces))


class Layout:
    """The block table of a bucket's pieces (depends on their sizes only, so it is kept with the
    snapshot and reused every round): per block its piece and start; per piece its length, flat
    start and the index of its last block's published word (for the per-piece counts)."""

    def __init__(self, sizes: list[int], device: torch.device) -> None:
        nblk = [(n + BLOCK - 1) // BLOCK for n in sizes]
        piece = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(nblk, dtype=torch.int64))
        first = torch.tensor([0] + nblk[:-1], dtype=torch.int64).cumsum(0)
        start = (torch.arange(int(sum(nblk)), dtype=torch.int64) - first[piece.long()]) * BLOCK
        flat = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0)
        self.blocks = int(sum(nblk))
        self.piece = piece.to(device)
        self.start = start.to(device)
        self.plen = torch.tensor(sizes, dtype=torch.int64).to(device)
        self.pflat = flat.to(device)
        #: word index (state_ptr + b + 1) of each piece's last block; a piece with no block points at
        #: its predecessor's (or at word 0, "before the first block")
        self.ends = torch.tensor(nblk, dtype=torch.int64).cumsum(0).to(device)
        self.npieces = len(sizes)
        self.elements = int(sum(sizes))
        self._flat_align = _align(flat.tolist())
        self._offsets: tuple[tuple[int, ...], torch.Tensor, int] | None = None

    def offsets(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Each piece's element offset from the first piece's pointer, and the largest power of two
        (<= 8) dividing every such offset and every flat start (kept while the pointers are)."""
        ptrs = tuple(t.data_ptr() for t in pieces)
        if self._offsets is None or self._offsets[0] != ptrs:
            esz = pieces[0].element_size()
            offs = array("q", ((q - ptrs[0]) // esz for q in ptrs))
            dev = self.plen.device
            self._offsets = (ptrs, torch.frombuffer(offs, dtype=torch.int64).to(dev),
                             min(self._flat_align, _align(list(offs))))
        return self._offsets[1], self._offsets[2]


def _align(values: list[int]) -> int:
    """The largest power of two up to 8 dividing every value."""
    a = 8
    for v in values:
        while v % a:
            a //= 2
    return a


class Result:
    """A bucket's changes: ``pos`` (int32 positions within each piece) and ``values`` (wire dtype), the
    pieces' runs end to end in ascending order; ``counts`` and ``nan`` (a changed NaN) per piece."""

    __slots__ = ("pos", "values", "counts", "nan", "launches")

    def __init__(self, pos: torch.Tensor, values: torch.Tensor, counts: list[int], nan: list[bool],
                 launches: int) -> None:
        self.pos, self.values, self.counts, self.nan, self.launches = pos, values, counts, nan, launches


_NAN_BITS: dict[tuple[str, torch.dtype, torch.dtype], tuple[int, int]] = {}


def _nan_bits(device: torch.device, src: torch.dtype, wire: torch.dtype) -> tuple[int, int]:
    """The bfloat16 bits torch's cast gives +NaN and -NaN of ``src`` on ``device`` (CPU torch: 0xFFFF
    for any NaN; CUDA's ``cvt``: its canonical NaN): the kernel's emulated cast gives the same."""
    key = (device.type, src, wire)
    got = _NAN_BITS.get(key)
    if got is None:
        t = torch.tensor([float("nan"), -float("nan")], dtype=src, device=device).to(wire)
        a, b = t.view({2: torch.int16, 4: torch.int32}[wire.itemsize]).tolist()
        got = _NAN_BITS[key] = (a, b)
    return got


def diff(pieces: list[torch.Tensor], snap: torch.Tensor, wire: torch.dtype, layout: Layout, *,
         capacity: int) -> Result:
    """Changes of ``pieces`` (in order, laid end to end as the flat group) against ``snap`` (the flat
    group in ``wire``), which takes the new bits of every changed element. ``capacity``: output slots
    of the first launch (a guess: a short one costs a second launch, never a change). One host sync
    per launch: the per-piece counts and NaN flags, read together."""
    dev = snap.device
    base = pieces[0]
    poff, align = layout.offsets(pieces)
    idt = {2: torch.int16, 4: torch.int32}[wire.itemsize]
    mode = _mode(dev, base.dtype, wire)
    nan_pos, nan_neg = _nan_bits(dev, base.dtype, wire) if mode == 1 else (0, 0)
    ab, inf = _NAN_TEST[wire]
    snap_bits = snap.view(idt)
    # per launch: words (blocks + 1), the ticket, NaN flags per piece -- zeroed together
    nblk, npc = layout.blocks, layout.npieces
    nan_flags = torch.zeros(npc, dtype=torch.int32, device=dev)
    outs: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    counts: list[int] | None = None
    written = 0
    launches = 0
    total = -1
    cap = max(int(capacity), 1)
    while total < 0 or written < total:
        state = torch.zeros(nblk + 2, dtype=torch.int64, device=dev)
        vals = torch.empty(cap, dtype=wire, device=dev)
        pos = torch.empty(cap, dtype=torch.int32, device=dev)
        if nblk:
            _fused_kernel[(nblk,)](base, snap_bits, vals.view(idt), pos, state, state[nblk + 1:], nan_flags,
                                   layout.piece, layout.start, poff, layout.plen, layout.pflat, cap, nan_pos, nan_neg,
                                   BLOCK=BLOCK, LOOK=LOOK, WIRE=_TL[wire], INT=_INT[wire.itemsize], MODE=mode,
                                   BF16_IN=base.dtype == torch.bfloat16, ABS=ab, INF=inf, ALIGN=align,
                                   num_warps=8)
        launches += 1
        ends = state[:nblk + 1].index_select(0, layout.ends) & VALUE
        info = torch.cat([ends, nan_flags.to(torch.int64)]).tolist()  # the launch's one host sync
        cum = info[:npc]
        got = (cum[-1] if npc else 0)
        if counts is None:  # the first launch sees every change: the per-piece counts of the round
            total = got
            counts = [c - a for a, c in zip([0] + cum[:-1], cum)]
        fit = got if got <= cap else _written(state, nblk, cap)
        outs.append((pos, vals, fit))
        written += fit
        cap = total - written  # the rest fits: changes already written now compare equal
    nan = [bool(v) for v in info[npc:]]
    if len(outs) == 1:
        pos, vals, k = outs[0]
        return Result(pos[:k], vals[:k], counts or [], nan, launches)
    return Result(torch.cat([o[0][:o[2]] for o in outs]), torch.cat([o[1][:o[2]] for o in outs]),
                  counts or [], nan, launches)


def _written(state: torch.Tensor, nblk: int, cap: int) -> int:
    """Changes the launch wrote when some did not fit ``cap``: the largest inclusive prefix that did
    (blocks that wrote are a prefix of the block order)."""
    incl = state[1: nblk + 1] & VALUE
    return int(torch.where(incl <= cap, incl, torch.zeros_like(incl)).max().item()) if nblk else 0
