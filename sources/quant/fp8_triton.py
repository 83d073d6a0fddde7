"""Block FP8 quantization as Triton kernels (CUDA only).

``fused`` (float32 scales): one launch per tensor, one program per ``(bN, bK)`` block: it reads the
block once, computes its amax and float32 scale with the references' formulas evaluated the way they
run on CUDA (a division by a Python float is a multiplication by its fp32 reciprocal; vLLM's
``per_block_cast_to_fp8`` is ``torch.compile``d, so its ``1 / sf`` is Inductor's Triton division;
transformers' reciprocals are eager, IEEE-rounded) and writes the codes and the scale.
``batched``: the same for many 2-D tensors in one launch (a descriptor table of addresses and
shapes; per-tensor host work is one row of it), which is what makes a model's worth of small
projections cost about a copy instead of one Python launch each.
UE8M0 scales go through the two-pass form below, whose scale math is torch's own ``log2``/``pow``:
``amax``: one program per ``(bN, bK)`` block reads it once and writes its max |x| (float32, exact).
``cast``: one program per block reads it once, multiplies by the block's float32 multiplier and
writes FP8 codes (round to nearest even, saturating: the same codes as torch's ``.to(float8_e4m3fn)``
for every finite input, as the GPU run checks against the torch path).
The per-block scale math in between is torch's (``fp8._scales_from_amax``), so the scales are the
references' by construction. Importing this module fails where Triton is missing; ``fp8`` then uses
its torch path.
"""

from __future__ import annotations

from array import array

import torch
import triton
import triton.language as tl

__all__ = ["amax", "batchable", "batched", "cast", "fused"]


@triton.jit
def _block(x_ptr, n, k, sxb, sxn, sxk, BN: tl.constexpr, BK: tl.constexpr, PN: tl.constexpr, PK: tl.constexpr):
    """This program's block of a ``[B, n, k]`` tensor of any strides (grid ``(kb, nb, B)``): its values
    as float32 (0 outside the tensor), the mask of real elements, its batch index, row and columns."""
    j = tl.program_id(0)
    i = tl.program_id(1)
    b = tl.program_id(2)
    rows = i * BN + tl.arange(0, PN)
    cols = j * BK + tl.arange(0, PK)
    mask = (tl.arange(0, PN)[:, None] < BN) & (tl.arange(0, PK)[None, :] < BK)
    mask = mask & (rows[:, None] < n) & (cols[None, :] < k)
    ptrs = x_ptr + b.to(tl.int64) * sxb + rows[:, None].to(tl.int64) * sxn + cols[None, :].to(tl.int64) * sxk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x, mask, b, i, j, rows, cols


@triton.jit
def _codes_at(q_ptr, b, rows, cols, n, k):
    """Addresses of the block's codes in the contiguous ``[B, n, k]`` output."""
    return q_ptr + b.to(tl.int64) * n * k + rows[:, None].to(tl.int64) * k + cols[None, :]


@triton.jit
def _clamp(y, FMAX: tl.constexpr):
    """``torch.clamp(y, -FMAX, FMAX)``: NaN stays NaN."""
    return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))


@triton.jit
def _quantize_block(x, TRANSFORMERS: tl.constexpr, FMAX: tl.constexpr, RCP_FMAX: tl.constexpr):
    """A block's scaled values (to be cast to FP8) and its float32 ``scale_inv``, with the references'
    formulas as torch evaluates them on CUDA: ``t / c`` (c a Python float) is ``t * fp32(1 / c)``
    (PyTorch's div-by-CPU-scalar kernel, and Inductor's code for vLLM's compiled quantizer), ``c / t`` is
    ``reciprocal(t) * c`` (``Tensor.__rtruediv__``). The transformers rule's reciprocals are IEEE-rounded
    (div_rn: eager torch); the vLLM rule's ``1 / sf`` is Triton's own division, as Inductor emits it."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if TRANSFORMERS:  # s = 448 / amax (1 for an all-zero block), stores 1 / s, codes of clamp(x * s)
        pos = amax > 0
        mult = tl.where(pos, tl.math.div_rn(1.0, tl.where(pos, amax, 1.0)) * FMAX, 1.0)
        stored = tl.math.div_rn(1.0, mult)
        y = _clamp(x * mult, FMAX)
    else:  # vLLM: sf = max(amax, 1e-4) / 448, stores sf, codes of x * (1 / sf)
        stored = tl.maximum(amax, 1e-4) * RCP_FMAX
        # ``1.0 / sf`` as vLLM computes it on CUDA: ``per_block_cast_to_fp8`` is ``torch.compile``d
        # there, and Inductor's Triton code takes the reciprocal with Triton's ``/`` (div.full.f32, not
        # IEEE). With the IEEE reciprocal (div_rn) 1-3 codes per tensor differed, at FP8-subnormal ties.
        y = x * (1.0 / stored)
    return y, stored


@triton.jit
def _amax_kernel(x_ptr, out_ptr, n, k, sxb, sxn, sxk, nb, kb, BN: tl.constexpr, BK: tl.constexpr,
                 PN: tl.constexpr, PK: tl.constexpr):
    x, mask, b, i, j, rows, cols = _block(x_ptr, n, k, sxb, sxn, sxk, BN, BK, PN, PK)
    m = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    tl.store(out_ptr + (b * nb + i) * kb + j, m)


@triton.jit
def _cast_kernel(x_ptr, mult_ptr, q_ptr, n, k, sxb, sxn, sxk, nb, kb, BN: tl.constexpr, BK: tl.constexpr,
                 PN: tl.constexpr, PK: tl.constexpr, CLAMP: tl.constexpr, FMAX: tl.constexpr):
    x, mask, b, i, j, rows, cols = _block(x_ptr, n, k, sxb, sxn, sxk, BN, BK, PN, PK)
    y = x * tl.load(mult_ptr + (b * nb + i) * kb + j)
    if CLAMP:
        y = _clamp(y, FMAX)
    tl.store(_codes_at(q_ptr, b, rows, cols, n, k), y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _fused_kernel(x_ptr, q_ptr, s_ptr, n, k, sxb, sxn, sxk, nb, kb, BN: tl.constexpr, BK: tl.constexpr,
                  PN: tl.constexpr, PK: tl.constexpr, TRANSFORMERS: tl.constexpr, FMAX: tl.constexpr,
                  RCP_FMAX: tl.constexpr):
    """One block: amax, its float32 scale (``_quantize_block``), codes."""
    x, mask, b, i, j, rows, cols = _block(x_ptr, n, k, sxb, sxn, sxk, BN, BK, PN, PK)
    y, stored = _quantize_block(x, TRANSFORMERS, FMAX, RCP_FMAX)
    tl.store(_codes_at(q_ptr, b, rows, cols, n, k), y.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + (b * nb + i) * kb + j, stored)


#: fp32(1 / 448): what torch multiplies by when it divides a CUDA tensor by the Python float 448.
_RCP_FMAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))


def fused(x3: torch.Tensor, q: torch.Tensor, bn: int, bk: int, *, transformers: bool) -> torch.Tensor:
    """Float32 scales (float32 ``scale_fmt``) and codes into ``q`` in one launch; returns the scales."""
    b, n, k = x3.shape
    kb, nb, _ = _grid(x3, bn, bk)
    scales = torch.empty((b, nb, kb), dtype=torch.float32, device=x3.device)
    _fused_kernel[(kb, nb, b)](
        x3, q, scales, n, k, *x3.stride(), nb, kb, BN=bn, BK=bk,
        PN=triton.next_power_of_2(bn), PK=triton.next_power_of_2(bk),
        TRANSFORMERS=transformers, FMAX=448.0, RCP_FMAX=_RCP_FMAX, num_warps=8,
    )
    return scales


@triton.jit
def _batched_kernel(x_base, q_base, s_base, desc_ptr, m, BN: tl.constexpr, BK: tl.constexpr, PN: tl.constexpr,
                    PK: tl.constexpr, MAXM: tl.constexpr, TRANSFORMERS: tl.constexpr, FMAX: tl.constexpr,
                    RCP_FMAX: tl.constexpr, EVEN: tl.constexpr, VX: tl.constexpr, VQ: tl.constexpr):
    """Many contiguous 2-D tensors in one launch: program ``pid`` is global block ``pid``; the descriptor
    row of its tensor -- ``(x offset from x_base, q offset from q_base, first block, n, k)``, offsets in
    elements -- is the last one whose first block is <= pid. The block's math is ``_fused_kernel``'s.

    Speed: every offset is a multiple of ``VX`` (input) / ``VQ`` (codes) elements and ``k`` a multiple
    of 16 (the host checks it), and the kernel re-derives them as ``(v // V) * V`` -- the same values --
    so Triton's alignment analysis can prove 16-byte alignment and emit vector loads and stores. Without
    that proof (offsets read from memory carry none) every element is its own 1- or 2-byte access and
    the launch runs at a tenth of the memory bandwidth. ``EVEN`` (all n, k block multiples) drops the
    masks."""
    pid = tl.program_id(0)
    idx = tl.arange(0, MAXM)
    starts = tl.load(desc_ptr + idx * 5 + 2, mask=idx < m, other=2**62)
    t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    row = desc_ptr + t * 5
    xo = tl.load(row) // VX * VX
    qo = tl.load(row + 1) // VQ * VQ
    first = tl.load(row + 2)
    n = tl.load(row + 3)
    k = tl.load(row + 4) // 16 * 16
    local = pid - first
    kb = (k + BK - 1) // BK
    i = local // kb
    j = local % kb
    rows = i * BN + tl.arange(0, PN)
    cols = j * BK + tl.arange(0, PK)
    offs = rows[:, None].to(tl.int64) * k + cols[None, :]
    if EVEN:
        x = tl.load(x_base + xo + offs).to(tl.float32)
    else:
        mask = (tl.arange(0, PN)[:, None] < BN) & (tl.arange(0, PK)[None, :] < BK)
        mask = mask & (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(x_base + xo + offs, mask=mask, other=0.0).to(tl.float32)
    y, stored = _quantize_block(x, TRANSFORMERS, FMAX, RCP_FMAX)
    if EVEN:
        tl.store(q_base + qo + offs, y.to(tl.float8e4nv))
    else:
        tl.store(q_base + qo + offs, y.to(tl.float8e4nv), mask=mask)
    tl.store(s_base + pid, stored)


#: warps per 128x128 block program of ``_batched_kernel`` (chosen with ``bench_gpu_fp8 --profile``; docs/evidence.md).
_BATCHED_WARPS = 8


def batchable(x: torch.Tensor) -> bool:
    """Whether ``batched`` takes ``x``: a contiguous, non-empty 2-D float tensor on a CUDA device,
    16-byte aligned, with a row length that is a multiple of 16 (what its vector accesses assume)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.numel() > 0 and x.is_contiguous() and x.shape[1] % 16 == 0 and x.data_ptr() % 16 == 0)


def batched(xs: list[torch.Tensor], bn: int, bk: int, *, transformers: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(codes, float32 scales)]`` of ``batchable`` tensors of one dtype on one device, in one launch. The outputs are
    views of two buffers (one of codes, one of scales) that live as long as any view.

    Host work is what bounds a pass of small projections (a launch costs more host time than the
    device needs for a large window), so the per-tensor part is one descriptor row in an ``array``
    and two views, nothing else."""
    x0 = xs[0]
    dev, esz = x0.device, x0.element_size()
    base = x0.data_ptr()
    desc = array("q")
    put = desc.extend
    shapes = []
    qoff = soff = 0
    even = True
    for x in xs:
        n, k = x.shape
        nb, kb = -(-n // bn), -(-k // bk)
        if even and (n % bn or k % bk):
            even = False
        put(((x.data_ptr() - base) // esz, qoff, soff, n, k))
        shapes.append(((n, k), (k, 1), qoff, (nb, kb), (kb, 1), soff))
        qoff += -(-(n * k) // 16) * 16  # every code segment starts 16-byte aligned
        soff += nb * kb
    q_all = torch.empty(qoff, dtype=torch.float8_e4m3fn, device=dev)
    s_all = torch.empty(soff, dtype=torch.float32, device=dev)
    # Pinned, so the copy is truly asynchronous: from pageable memory the driver stages it and may wait
    # for the stream, which serialized each window's host work behind the previous window's kernel
    # (seen in the H200 profile). The caching host allocator keeps the block until the copy is done.
    table = torch.frombuffer(desc, dtype=torch.int64)
    if dev.type == "cuda":
        table = table.pin_memory()
    table = table.to(dev, non_blocking=True)
    _batched_kernel[(soff,)](
        x0, q_all, s_all, table, len(xs), BN=bn, BK=bk, PN=triton.next_power_of_2(bn),
        PK=triton.next_power_of_2(bk), MAXM=triton.next_power_of_2(len(xs)), TRANSFORMERS=transformers,
        FMAX=448.0, RCP_FMAX=_RCP_FMAX, EVEN=even, VX=16 // esz, VQ=16, num_warps=_BATCHED_WARPS,
    )
    qv, sv = q_all.as_strided, s_all.as_strided
    return [(qv(qs, qst, qo), sv(ss, sst, so)) for qs, qst, qo, ss, sst, so in shapes]


def _grid(x3: torch.Tensor, bn: int, bk: int) -> tuple[int, int, int]:
    b, n, k = x3.shape
    return (-(-k // bk), -(-n // bn), b)


def amax(x3: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """float32 ``[B, ceil(n/bn), ceil(k/bk)]`` block max |x| of ``x3`` ``[B, n, k]`` (any strides)."""
    b, n, k = x3.shape
    kb, nb, _ = _grid(x3, bn, bk)
    out = torch.empty((b, nb, kb), dtype=torch.float32, device=x3.device)
    _amax_kernel[(kb, nb, b)](
        x3, out, n, k, *x3.stride(), nb, kb, BN=bn, BK=bk,
        PN=triton.next_power_of_2(bn), PK=triton.next_power_of_2(bk), num_warps=8,
    )
    return out


def cast(x3: torch.Tensor, mult: torch.Tensor, q: torch.Tensor, bn: int, bk: int, *, clamp: bool) -> None:
    """``q[b, r, c] = fp8(x3[b, r, c] * mult[b, r // bn, c // bk])`` (clamped to +-448 if ``clamp``)."""
    b, n, k = x3.shape
    kb, nb, _ = _grid(x3, bn, bk)
    mult = mult.to(torch.float32).contiguous()
    _cast_kernel[(kb, nb, b)](
        x3, mult, q, n, k, *x3.stride(), nb, kb, BN=bn, BK=bk,
        PN=triton.next_power_of_2(bn), PK=triton.next_power_of_2(bk),
        CLAMP=clamp, FMAX=448.0, num_warps=8,
    )
