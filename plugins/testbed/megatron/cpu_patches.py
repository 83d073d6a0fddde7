"""What megatron-core needs patched to *construct* a model on a CPU host without Transformer Engine.

Invariant: every patch is scoped to a ``with`` block around construction and restored afterwards
(also on error), and none changes which parameters are built or their values -- only calls that
would fail on a CPU host, or without TE or flash-linear-attention, are answered. Why each is safe:

* ``cpu_construction``: ``torch.Tensor.cuda`` is the identity during construction (with tied
  embeddings under PP, ``GPTModel`` moves the shared weight with ``.cuda()`` before its
  first/last-stage all-reduce); ``torch.cuda.current_device`` / ``synchronize`` answer for the CPU
  (the router's expert bias is allocated on the current device). Nothing is patched on a host with
  CUDA.
* ``mla_without_te``: megatron-core 0.16 compares ``linear_proj`` against ``TELinear`` with
  ``isinstance``; without TE that name is a mock, so it is a placeholder class during construction.
* ``gdn_construction``: ``GatedDeltaNet`` is constructed without flash-linear-attention (which only
  its forward uses) and, on CPU ranks, without the CUDA RNG tracker.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cpu_construction", "mla_without_te", "gdn_construction"]


@contextlib.contextmanager
def cpu_construction() -> Iterator[None]:
    """The CUDA calls megatron-core makes while constructing, answered on a CPU host (module docstring)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize = saved


@contextlib.contextmanager
def mla_without_te() -> Iterator[None]:
    """megatron-core 0.16 without TE: its ``isinstance(linear_proj, TELinear)`` gets a class."""
    import megatron.core.transformer.multi_latent_attention as mla

    saved = getattr(mla, "TELinear", None)
    if isinstance(saved, type) or not hasattr(mla, "TELinear"):
        yield
        return
    mla.TELinear = type("TELinearUnavailable", (), {})
    try:
        yield
    finally:
        mla.TELinear = saved


class _NoForkTracker:
    """Stands in for megatron's CUDA RNG tracker when it holds no model-parallel state (CPU ranks):
    ``GatedDeltaNet.reset_parameters`` draws ``A_log`` inside ``tracker.fork()``; here it draws from
    torch's default generator (the builder seeds it)."""

    def fork(self, *a: Any, **k: Any) -> Any:
        return contextlib.nullcontext()


@contextlib.contextmanager
def gdn_construction() -> Iterator[None]:
    """Two construction-only concessions for ``GatedDeltaNet`` (its parameters do not depend on
    them): ``__init__`` raises unless flash-linear-attention imports, which only its forward uses
    (Triton kernels); ``reset_parameters`` forks megatron's CUDA RNG tracker, which on CPU ranks
    holds no state. Both are restored afterwards."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # the module whose globals __init__ / reset_parameters read: ssm/gated_delta_net.py (0.16),
    # ssm/gated_delta_net/common.py (0.19, where the layer became a package)
    g = sys.modules[GatedDeltaNet.reset_parameters.__module__]
    saved = getattr(g, "HAVE_FLA", True), g.get_cuda_rng_tracker
    g.HAVE_FLA = True
    if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
        g.get_cuda_rng_tracker = _NoForkTracker
    # 0.19 also binds the delta-rule kernel at construction (``_setup_variant_attrs``, asserted not
    # None): without fla, one that says so if called (``deterministic_mode`` binds megatron's torch one)
    v = sys.modules[GatedDeltaNet._setup_variant_attrs.__module__] if hasattr(GatedDeltaNet, "_setup_variant_attrs") else None
    kernel = getattr(v, "chunk_gated_delta_rule", False)
    if v is not None and kernel is None:
        v.chunk_gated_delta_rule = _no_fla_kernel
    try:
        yield
    finally:
        g.HAVE_FLA, g.get_cuda_rng_tracker = saved
        if v is not None and kernel is None:
            v.chunk_gated_delta_rule = kernel


def _no_fla_kernel(*a: Any, **k: Any) -> Any:
    raise RuntimeError(
        "this GatedDeltaNet was built without flash-linear-attention: its forward needs fla's "
        "chunk_gated_delta_rule (pip install flash-linear-attention), or deterministic_mode=True "
        "(megatron's torch implementation)"
    )
