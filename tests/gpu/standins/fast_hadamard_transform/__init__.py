"""A pure-torch STAND-IN for Dao-AILab's ``fast_hadamard_transform`` (a CUDA extension that the GPU
image does not have and cannot build), put on ``sys.path`` only by the DSA oracle part
(``tests/gpu/part_dsa.py``); never installed, never imported by the library.

Same API and semantics as the real package's ``hadamard_transform(x, scale=1.0)`` (whose own torch
reference, ``hadamard_transform_ref``, is this computation): over the last dimension ``dim``, ``x``
padded with zeros to the next power of two ``n``, multiplied by the Sylvester-ordered ``n x n``
Hadamard matrix (``scipy.linalg.hadamard(n)``, entries +-1), times ``scale``, truncated back to
``dim``; output in ``x``'s dtype and shape. The product is exact up to the dtype's rounding (the
matrix is built in float64 and cast once), so where ``dim`` is a power of two and ``scale = dim **
-0.5`` (megatron-core's ``rotate_activation``) the transform is orthogonal: ``H q . H k == q . k``.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["hadamard_transform", "sylvester_hadamard", "IS_STANDIN"]
__version__ = "0.0.0+weightsync.standin"

#: lets a caller (and the part's report) tell the stand-in from the real extension.
IS_STANDIN = True


@functools.lru_cache(maxsize=16)
def _matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix (``n`` a power of two), float64 on the CPU."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return _matrix(n).clone()


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``(pad(x) @ H_n.T * scale)[..., :dim]`` over the last dimension (see the module docstring)."""
    dim = x.shape[-1]
    n = 1 << max(0, math.ceil(math.log2(dim)))
    flat = x.reshape(-1, dim)
    if n != dim:
        flat = torch.nn.functional.pad(flat, (0, n - dim))
    h = _matrix(n).to(device=x.device, dtype=x.dtype)
    out = torch.nn.functional.linear(flat, h) * scale
    return out[..., :dim].reshape(x.shape)
