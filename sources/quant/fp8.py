"""Block-wise FP8 quantization of one weight: ``W -> (float8_e4m3fn W_q, float32 weight_scale_inv)``.

The format is the one vLLM 0.33 and 0.34 load for a block-FP8 checkpoint (DeepSeek-V3, Qwen3-FP8, ...):
``W_q`` has ``W``'s shape; ``weight_scale_inv[..., i, j]`` is the dequantization multiplier of block
``(i, j)`` (``block = (bN, bK)`` rows x columns of the last two dims), shape
``(*lead, ceil(N / bN), ceil(K / bK))``; ``W ~= W_q * scale_inv`` blockwise. Edge blocks are partial
(the scale covers what is there); leading dims (fused experts ``[E, N, K]``) are independent.

Two reference quantizers define the numerics, and they are not the same function:

* ``rule="vllm"`` -- vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, the quantizer
  vLLM's own tests use): ``sf = max(amax, 1e-4) / 448``, optional UE8M0 rounding
  ``sf = 2 ** ceil(log2(sf))``, ``W_q = fp8(W * (1 / sf))``, stores ``sf``.
* ``rule="transformers"`` -- transformers' ``Fp8Quantize`` (the FineGrainedFP8 save-time quantizer):
  ``s = 448 / amax`` (an all-zero block gets ``s = 1``), stores ``1 / s``; UE8M0 rounds the *stored*
  inverse up to a power of two and multiplies by its exact reciprocal; ``W_q = fp8(clamp(W * s))``.

They differ: ``1/(448/a)`` and ``a/448`` can differ in the last bit, so ``W * (1/sf)`` and ``W * s``
can round to different FP8 codes; an all-zero block stores ``1e-4/448`` (vLLM) or ``1`` (transformers);
transformers quantizes only shapes that are multiples of the block (others pass through unquantized).
vLLM's loader assumes neither: it multiplies by the stored scale, so either is a valid checkpoint. The
default is vLLM's (the receiver's own library). Both rules are reproduced bit for bit (tests compare
against both references on edge shapes, zero blocks, subnormal and large values, both scale formats).

Cost: on CUDA one Triton launch per tensor reads ``W`` once and writes the codes and scales
(``fp8_triton.fused``: the scale formulas with IEEE-rounded divisions, as torch computes them); UE8M0
scales take two launches around torch's own ``log2``/``pow`` on the small ``[ceil(N/bN), ceil(K/bK)]``
tensor. Elsewhere (CPU) chunked torch ops with the references' own formulas (a bounded float32
temporary). The GPU run checks the kernels against the references and the torch path bit for bit.
Nothing here mutates its input.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "RULES",
    "SCALE_FORMATS",
    "dequantize_blocks",
    "quantize_blocks",
    "quantize_many",
    "scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
RULES = ("vllm", "transformers")
SCALE_FORMATS = (None, "ue8m0")

#: float32 temporaries of the torch path are bounded by this many elements (64 MiB).
_CHUNK_ELEMS = 16 << 20

Rule = Literal["vllm", "transformers"]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """``weight_scale_inv``'s shape for a weight of ``shape``: ``(*lead, ceil(N/bN), ceil(K/bK))``."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def _scales_from_amax(amax: torch.Tensor, rule: Rule, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored scale_inv, multiplier applied to W)`` from float32 block amaxes, with each
    reference's own ops in its own order (bitwise theirs)."""
    if rule == "vllm":
        sf = amax.clamp(1e-4) / FP8_MAX
        if scale_fmt == "ue8m0":
            sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
        # float32 scales: the kernels' reciprocal (``fused``); UE8M0's powers of two are exact either way
        # and its kernel path runs this very function
        return sf, (1.0 / sf) if scale_fmt == "ue8m0" else _reciprocal_as_compiled(sf)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scales = FP8_MAX / safe
    scales = torch.where(amax > 0, scales, torch.ones_like(scales))
    inv = (1.0 / scales).to(torch.float32)
    if scale_fmt == "ue8m0":
        inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
        scales = 1.0 / inv
    return inv, scales


_RCP_FULL: object | None = None
_RCP_FULL_CODE = """
template <typename T> T rcp_full(T x) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(1.0f), "f"(static_cast<float>(x)));
  return static_cast<T>(r);
}
"""


def _reciprocal_as_compiled(sf: torch.Tensor) -> torch.Tensor:
    """``1.0 / sf`` as vLLM's compiled quantizer and ``fp8_triton`` compute it on CUDA: Triton's ``/``,
    the PTX instruction ``div.full.f32`` (an approximation within 2 ulp, not IEEE-rounded: at FP8
    ties the codes can differ from an IEEE reciprocal's). On CUDA the same instruction, through
    torch's jiterator (NVRTC), so the torch path gives the kernels' bits by construction -- same
    instruction, same operands. On CPU there is no such instruction to match (its rounding is not
    documented, so no CPU formula can be proven equal to it): the IEEE reciprocal, which is what
    eager vLLM computes there. Where the jiterator is unavailable, the IEEE reciprocal with a warning."""
    global _RCP_FULL
    if not sf.is_cuda:
        return 1.0 / sf
    if _RCP_FULL is None:
        try:
            from torch.cuda.jiterator import _create_jit_fn

            _RCP_FULL = _create_jit_fn(_RCP_FULL_CODE)
        except Exception as e:  # noqa: BLE001 - a build without NVRTC: IEEE, said once
            import logging

            logging.getLogger(__name__).warning("fp8: no jiterator (%s): the torch path's 1/sf is IEEE-rounded "
                                                "and may part from the Triton kernels at FP8 ties", e)
            _RCP_FULL = False
    if _RCP_FULL is False:
        return 1.0 / sf
    try:
        return _RCP_FULL(sf.contiguous())  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - NVRTC refused the code: IEEE, said once
        import logging

        logging.getLogger(__name__).warning("fp8: jiterator div.full.f32 failed (%s): IEEE 1/sf", e)
        _RCP_FULL = False
        return 1.0 / sf


def quantize_blocks(
    x: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    scale_fmt: str | None = None,
    rule: Rule = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_q float8_e4m3fn, weight_scale_inv float32)`` of ``x`` (>= 2-D, floating), on ``x``'s device.

    ``block``: ``(bN, bK)`` over the last two dims; ``scale_fmt``: None (float32 scales) or
    ``"ue8m0"`` (power-of-two scales, still float32 on the wire); ``rule``: whose numerics
    (module docstring). Edge blocks are partial; ``x`` is not modified.
    """
    if x.dim() < 2 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_blocks: needs a floating tensor of >= 2 dims, got {x.dtype} {tuple(x.shape)}")
    if rule not in RULES:
        raise ValueError(f"quantize_blocks: rule must be one of {RULES}, got {rule!r}")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"quantize_blocks: scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    bn, bk = int(block[0]), int(block[1])
    if bn <= 0 or bk <= 0:
        raise ValueError(f"quantize_blocks: block sizes must be positive, got {block}")
    *lead, n, k = x.shape
    x3 = x.reshape(-1, n, k)  # a view for contiguous input
    sshape = (x3.shape[0], -(-n // bn), -(-k // bk))
    q = torch.empty(x3.shape, dtype=FP8_DTYPE, device=x.device)
    if x3.numel() == 0:
        return q.view(x.shape), torch.empty(scale_shape(tuple(x.shape), (bn, bk)), dtype=torch.float32, device=x.device)
    kernels = _triton_kernels() if x.is_cuda else None
    if kernels is not None and scale_fmt is None:
        scale_inv = kernels.fused(x3, q, bn, bk, transformers=rule == "transformers")
    elif kernels is not None:
        amax = kernels.amax(x3, bn, bk)
        scale_inv, mult = _scales_from_amax(amax, rule, scale_fmt)
        kernels.cast(x3, mult, q, bn, bk, clamp=rule == "transformers")
    else:
        amax = _amax_torch(x3, bn, bk)
        scale_inv, mult = _scales_from_amax(amax, rule, scale_fmt)
        _cast_torch(x3, mult, q, bn, bk, clamp=rule == "transformers")
    assert tuple(scale_inv.shape) == sshape
    return q.view(x.shape), scale_inv.reshape(scale_shape(tuple(x.shape), (bn, bk))).contiguous()


def quantize_many(
    xs: list[torch.Tensor],
    block: tuple[int, int] = (128, 128),
    *,
    scale_fmt: str | None = None,
    rule: Rule = "vllm",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[quantize_blocks(x, ...) for x in xs]``, the same bytes; on CUDA, float32 scales, the
    ``fp8_triton.batchable`` tensors of each dtype go through one Triton launch (``fp8_triton.batched``;
    their results are then views of two shared buffers). Everything else -- CPU, UE8M0 scales, 3-D
    stacks, strided or odd-width tensors -- one by one."""
    kernels = _triton_kernels() if xs and xs[0].is_cuda else None
    if kernels is None or scale_fmt is not None or rule not in RULES:
        return [quantize_blocks(x, block, scale_fmt=scale_fmt, rule=rule) for x in xs]
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        if kernels.batchable(x):
            groups.setdefault((x.dtype, x.device), []).append(i)
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(xs)
    for idx in groups.values():
        if len(idx) > 1:
            done = kernels.batched([xs[i] for i in idx], int(block[0]), int(block[1]),
                                   transformers=rule == "transformers")
            for i, pair in zip(idx, done):
                out[i] = pair
    return [pair if pair is not None else quantize_blocks(x, block, scale_fmt=scale_fmt, rule=rule)
            for x, pair in zip(xs, out)]


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` blockwise (what vLLM's loader and transformers' ``Fp8Dequantize`` compute)."""
    bn, bk = block
    n, k = q.shape[-2:]
    s = scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (q.to(torch.float32) * s).to(dtype)


# ---- torch path (CPU, or CUDA without Triton) -------------------------------------------------


def _row_chunks(bn: int, k: int) -> int:
    """Block rows per chunk so a float32 temporary stays under ``_CHUNK_ELEMS``."""
    return max(1, _CHUNK_ELEMS // max(1, bn * k))


def _padded(x3: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``x3`` as ``[B, nb, bn, kb, bk]``; a zero-padded copy only when a dim is not a block multiple
    (zeros change neither the block amax nor the block's other codes)."""
    b, n, k = x3.shape
    nb, kb = -(-n // bn), -(-k // bk)
    if n % bn or k % bk:
        x3 = torch.nn.functional.pad(x3, (0, kb * bk - k, 0, nb * bn - n))
    return x3.reshape(b, nb, bn, kb, bk)


def _amax_torch(x3: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    b, n, k = x3.shape
    nb = -(-n // bn)
    step = _row_chunks(bn, k)
    out = []
    for i in range(0, nb, step):
        part = _padded(x3[:, i * bn:(i + step) * bn], bn, bk)
        out.append(part.abs().float().amax(dim=(2, 4)))
    return torch.cat(out, dim=1)


def _cast_torch(x3: torch.Tensor, mult: torch.Tensor, q: torch.Tensor, bn: int, bk: int, *, clamp: bool) -> None:
    b, n, k = x3.shape
    nb = -(-n // bn)
    step = _row_chunks(bn, k)
    for i in range(0, nb, step):
        rows = slice(i * bn, min(n, (i + step) * bn))
        part = _padded(x3[:, rows], bn, bk)
        scaled = part * mult[:, i:i + step, None, :, None]  # float32 (type promotion), as both references
        if clamp:
            scaled = scaled.clamp(min=-FP8_MAX, max=FP8_MAX)
        got = scaled.to(FP8_DTYPE).reshape(b, part.shape[1] * bn, -1)
        q[:, rows] = got[:, : rows.stop - rows.start, :k]


# ---- Triton path (CUDA) -----------------------------------------------------------------------

_KERNELS: object | None = None
_KERNELS_TRIED = False


def _triton_kernels():
    """The two Triton kernels, compiled on first use; None where Triton is unavailable."""
    global _KERNELS, _KERNELS_TRIED
    if not _KERNELS_TRIED:
        _KERNELS_TRIED = True
        try:
            from . import fp8_triton

            _KERNELS = fp8_triton
        except Exception:  # noqa: BLE001 - no Triton (CPU builds): the torch path is exact too
            _KERNELS = None
    return _KERNELS
