"""Tensors a vLLM loader writes into: the sources hand them out as copies.

Invariant: a tensor whose checkpoint name matches ``RECEIVER_WRITES`` is never yielded as the
trainer's memory or a view of it. ``FSDPSource`` copies it (``copy_written``); ``MegatronSource``
needs no copy: these are MoE expert tensors, which it only exports in ``mode="full"`` through
``megatron/moe.py``, and that export always builds new tensors (``test_gpt_oss`` checks both).

Why: vLLM's GPT-OSS ``load_weights`` (0.33; 0.34's ``gpt_oss.py`` is the same file) zeroes the expert down-projection bias it is handed
(``weight.zero_()``, for the fused ``...mlp.experts.down_proj_bias`` and the per-expert
``...mlp.experts.{e}.down_proj_bias`` alike) on every tensor-parallel rank but the first, so that
the TP ranks add the bias once. Through vLLM's IPC engine that tensor IS the trainer's memory
(``rebuild_cuda_tensor`` of the handle the colocated trainer rank sent). A source yields module
storage itself wherever nothing has to be gathered -- a replicated or one-rank-sharded parameter,
a per-expert slice of a fused parameter -- so without this copy
vLLM would zero the trainer's own parameter on those ranks, silently, in the middle of training
(nothing a user passed may be mutated). The copy costs one ``[E, H]`` bias per MoE layer; gathered
tensors are fresh already and pay it too, which is cheaper than proving freshness per path.
vLLM's own ``ModuleSource`` has the same exposure.

The patterns are names, like ``dtype_policy.DEFAULT_KEEP_FP32``: a receiver's behaviour, not a model
family's layout fact, so they apply to any model whose checkpoint uses these names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["RECEIVER_WRITES", "written_by_receiver", "copy_written"]

#: ``re.search`` patterns of checkpoint names a vLLM loader writes into in place.
RECEIVER_WRITES: tuple[str, ...] = (
    # vLLM gpt_oss (``.down_proj_bias`` and ``.down_proj.bias`` both map to its ``w2_bias``), fused
    # ``experts.down_proj_bias`` and per-expert ``experts.{e}.down_proj_bias``: zeroed on TP ranks != 0
    r"(^|\.)experts\.(\d+\.)?down_proj(_bias|\.bias)$",
)

_PATTERNS = [re.compile(p) for p in RECEIVER_WRITES]


def written_by_receiver(names: Iterable[str]) -> frozenset[str]:
    """The names among ``names`` that a receiver writes into (to be yielded as copies)."""
    return frozenset(n for n in names if any(p.search(n) for p in _PATTERNS))


def copy_written(
    pairs: Iterable[tuple[str, torch.Tensor]], names: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` with every tensor named in ``names`` replaced by a fresh copy."""
    if not names:
        yield from pairs
        return
    for name, tensor in pairs:
        yield name, (tensor.clone() if name in names else tensor)
