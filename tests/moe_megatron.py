"""Test-side helpers for megatron-core MoE ``GPTModel``s on CPU gloo worlds (no tests).

Models come from the one builder (``weightsync.plugins.testbed.megatron``: the family table of the
test's transformers config), with scenario knobs as ``TransformerConfig`` overrides; this module
only adds what tests need around it: megatron's legacy ``GroupedMLP`` (it asserts that the
``grouped_gemm`` package is importable at construction only -- its forward needs it, its
parameters do not -- so ``build_gpt(..., expert_format="grouped")`` lifts that assertion for the
build: the parameters, their layout and ``sharded_state_dict`` are megatron-core's own), random
values per rank, and megatron's own ``dist_checkpointing`` as the oracle.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


@contextlib.contextmanager
def cpu_cuda_shim():
    """On a CPU-only host, megatron-core code that allocates on ``torch.cuda.current_device()``
    (TopKRouter's expert_bias, dist_checkpointing's finalize) or calls ``torch.cuda.synchronize``
    gets the CPU instead. A no-op where CUDA exists."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    try:
        model_parallel_cuda_manual_seed(123)
    except Exception:  # CPU-only: no CUDA RNG tracker state to seed
        pass


def moe_config(hf, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
               expert_format: str = "sequential", **overrides: Any):
    """The megatron-core ``TransformerConfig`` of transformers config ``hf`` from the one builder
    (``weightsync.plugins.testbed.megatron.megatron_config``: the family table the source checks
    against), at TP/PP/EP/ETP, with test-only knobs as ``TransformerConfig`` overrides
    (``moe_shared_expert_gate=False``, ``moe_router_enable_expert_bias=True``...).
    ``expert_format="grouped"``: megatron's legacy ``GroupedMLP``."""
    from weightsync.plugins.testbed.megatron import MegatronParallel, megatron_config

    build = dict(expert_tensor_parallel_size=etp if etp is not None else tp)
    if expert_format == "grouped":
        build.update(moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    return megatron_config(hf, MegatronParallel(tp=tp, pp=pp, ep=ep), overrides={**build, **overrides})


def build_gpt(hf, cfg, *, expert_format: str = "sequential", seed: int = 0):
    """This rank's ``GPTModel`` for ``hf`` and its ``moe_config`` ``cfg``, built by the one builder
    (``build_chunks``) under the parallel state ``init_parallel`` set; every float parameter (and the
    router's expert bias) then refilled with distinct random values per rank and tensor (megatron's
    init leaves zeros and ones), which megatron's own checkpoint (the oracle) records as they are."""
    from weightsync.plugins.testbed.megatron import MegatronParallel, build_chunks

    torch.manual_seed(seed + int(os.environ.get("RANK", "0")) * 1000)
    patch = None
    if expert_format == "grouped":
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        patch = gg.assert_grouped_gemm_is_available
        gg.assert_grouped_gemm_is_available = lambda: None
    par = MegatronParallel(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                           ep=cfg.expert_model_parallel_size)
    try:
        (model,) = build_chunks(hf, cfg, par)
    finally:
        if patch is not None:
            gg.assert_grouped_gemm_is_available = patch
    with torch.no_grad():  # distinct values per rank and tensor (init may leave zeros / ones)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "expert_bias" in name or (t.is_floating_point() and t.requires_grad):
                t.copy_(torch.randn_like(t))
    return model


def megatron_checkpoint(model, directory: str) -> None:
    """Save with megatron's own ``dist_checkpointing`` (every rank, collectively)."""
    from megatron.core import dist_checkpointing
    from megatron_worlds import forked_write_results_queue

    forked_write_results_queue()  # not a fresh interpreter per rank (see there)
    with cpu_cuda_shim():
        dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_full_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron ``torch_dist`` checkpoint as one full tensor (rank 0, no model):
    megatron's resharding metadata assembles the shards, not our code."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(directory, "full.pt")
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


def megatron_load(model, directory: str) -> None:
    """Load a ``megatron_checkpoint`` saved at any TP/PP/EP into ``model`` (this rank's layout) with
    megatron's own ``dist_checkpointing`` resharding; raises if any parameter was left out."""
    from megatron.core import dist_checkpointing

    with cpu_cuda_shim():
        loaded = dist_checkpointing.load(model.sharded_state_dict(), directory)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    bad = [k for k in missing + unexpected if not k.endswith("_extra_state")]
    if bad:
        raise AssertionError(f"dist_checkpointing load left {bad}")
