"""The wire-dtype policy: which dtype each tensor travels (and is declared) in.

Invariant: ``WirePolicy.dtype_for(name, dtype)`` is a pure function of the checkpoint name and the
tensor's in-memory dtype, so metadata (declared from it) and the stream (cast by it) agree on every
rank without communicating.

Why cast *before* the gather: accelerate's FSDP2 mixed precision keeps trainable parameters in
fp32; casting the local shard to bf16 first halves the bytes of every gather and of the peak
gathered memory, and the result is bit-identical to gathering in fp32 and casting afterwards
(rounding is elementwise).

Why an allow-list: vLLM keeps some tensors in fp32 whatever the model dtype -- MoE router / gate
weights and expert score-correction biases -- and rounding them to bf16 changes routing. Names
matching ``DEFAULT_KEEP_FP32`` or the user's ``keep_fp32`` patterns travel in their own dtype.
Non-floating tensors (integer buffers) always travel in their own dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_KEEP_FP32", "WirePolicy"]

#: Regular expressions (``re.search`` on the checkpoint name) of tensors never down-cast:
#: MoE routers (``mlp.gate`` in Qwen/DeepSeek-MoE, ``block_sparse_moe.gate`` in Mixtral,
#: ``router`` in others), Qwen2-MoE's ``shared_expert_gate`` and DeepSeek's
#: ``e_score_correction_bias``. ``mlp.gate_proj`` (a dense MLP) does not match.
DEFAULT_KEEP_FP32: tuple[str, ...] = (
    r"(^|\.)mlp\.gate\.(weight|bias)$",
    r"(^|\.)block_sparse_moe\.gate\.(weight|bias)$",
    r"(^|\.)router\.(weight|bias)$",
    r"(^|\.)shared_expert_gate\.(weight|bias)$",
    r"(^|\.)e_score_correction_bias$",
)


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


@dataclass(frozen=True)
class WirePolicy:
    """``dtype``: the wire dtype for floating tensors (None: each tensor's own dtype).
    ``keep``: patterns of names that keep their own dtype (defaults plus user additions)."""

    dtype: torch.dtype | None = None
    keep: tuple[str, ...] = DEFAULT_KEEP_FP32
    _compiled: tuple[re.Pattern, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def build(cls, dtype: torch.dtype | None, keep_fp32: str | Iterable[str] = ()) -> "WirePolicy":
        """Validate user input (errors name the argument) and build the policy."""
        if dtype is not None:
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"dtype= must be a torch.dtype or None, got {dtype!r}")
            if not _floating(dtype):
                raise ValueError(
                    f"dtype= must be a floating-point dtype (the wire dtype of floating tensors), "
                    f"got {dtype}"
                )
        if isinstance(keep_fp32, str):
            keep_fp32 = (keep_fp32,)
        extra = tuple(keep_fp32)
        for p in extra:
            if not isinstance(p, str):
                raise TypeError(f"keep_fp32= entries must be regular-expression strings, got {p!r}")
        keep = DEFAULT_KEEP_FP32 + extra
        compiled = []
        for p in keep:
            try:
                compiled.append(re.compile(p))
            except re.error as e:
                raise ValueError(f"keep_fp32= pattern {p!r} is not a valid regular expression: {e}")
        return cls(dtype, keep, tuple(compiled))

    def keeps(self, name: str) -> bool:
        pats = self._compiled or tuple(re.compile(p) for p in self.keep)
        return any(p.search(name) for p in pats)

    def dtype_for(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The wire dtype of tensor ``name`` whose in-memory dtype is ``dtype``."""
        if self.dtype is None or not _floating(dtype) or self.keeps(name):
            return dtype
        return self.dtype
