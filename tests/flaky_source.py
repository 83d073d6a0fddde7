"""A source that fails mid-stream on purpose: vLLM's ``ModuleSource`` over a model, raising after
``fail_after`` tensors while that is set, or (``slow_after``) announcing on ``signal_queue`` that it is
mid-stream and then yielding one tensor a second (a sender to kill in the middle of a broadcast).
Used by ``tests/test_driver.py`` (gloo stand-in) and ``tests/gpu/part_nccl_faults.py`` (real NCCL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

__all__ = ["FlakySource"]


class FlakySource(WeightSource):
    def __init__(self, model: torch.nn.Module, *, fail_after: int | None = None, signal_queue: Any = None,
                 slow_after: int | None = None) -> None:
        self.inner = ModuleSource(model)
        self.fail_after = fail_after
        self.signal_queue = signal_queue
        self.slow_after = slow_after

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self.inner.iter_full()):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("injected: the source fails mid-stream")
            if self.slow_after is not None and i >= self.slow_after:
                if i == self.slow_after:
                    self.signal_queue.put(("mid-stream", i))
                time.sleep(1.0)
            yield pair
