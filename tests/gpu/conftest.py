"""tests/gpu: the GPU evidence (issue 7). Every test here is marked ``gpu`` and skipped unless CUDA
and vLLM's weight-transfer engines (the device kit) are importable, so the default CPU run collects
them without import errors and never runs them. On the GPU machine, ``bash .ci/gpu`` runs the same
parts without pytest (the device image has none) and writes the log and summary."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _why_skip() -> str | None:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return "CUDA absent (tests/gpu runs on the GPU machine: bash .ci/gpu)"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM absent (install the device kit: bash .kit/install-kit.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    reason = _why_skip()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
