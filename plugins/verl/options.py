"""The weightsync options a verl user sets in ``checkpoint_engine.engine_kwargs.weightsync``.

Invariant: verl passes ``engine_kwargs[backend]`` as keyword arguments to the backend's constructor on
the actor ranks and on the rollout workers alike; every key is checked here, so a typo raises
``ValueError`` naming it on every process before the first sync instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["VerlOptions"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class VerlOptions:
    """``dtype``: the wire dtype (``None``: the trainer's own); ``fp8``: wrap the source in
    ``FP8Source`` (``True`` or an HF ``quantization_config`` mapping); ``check``: the sources' per-rank
    stream check against their metadata; ``check_finite``: refuse a tensor holding NaN/Inf, named on
    every actor rank; ``timeout_s``: the transfer group's bound."""

    dtype: torch.dtype | None = torch.bfloat16
    fp8: bool | dict[str, Any] = False
    check: bool = True
    check_finite: bool = True
    timeout_s: float = 300.0

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> VerlOptions:
        unknown = sorted(set(kwargs) - {"dtype", "fp8", "check", "check_finite", "timeout_s"})
        if unknown:
            raise ValueError(
                f"checkpoint_engine.engine_kwargs.weightsync: unknown option(s) {unknown}; "
                "known: dtype, fp8, check, check_finite, timeout_s"
            )
        dtype = kwargs.get("dtype", "bfloat16")
        if dtype is not None and str(dtype) not in _DTYPES:
            raise ValueError(f"engine_kwargs.weightsync.dtype={dtype!r}: one of {sorted(_DTYPES)} or null")
        fp8 = kwargs.get("fp8", False)
        if not isinstance(fp8, (bool, dict)) and not hasattr(fp8, "items"):
            raise ValueError(f"engine_kwargs.weightsync.fp8={fp8!r}: a bool or a quantization_config mapping")
        return cls(
            dtype=None if dtype is None else _DTYPES[str(dtype)],
            fp8=fp8 if isinstance(fp8, bool) else dict(fp8.items()),
            check=bool(kwargs.get("check", True)),
            check_finite=bool(kwargs.get("check_finite", True)),
            timeout_s=float(kwargs.get("timeout_s", 300.0)),
        )
