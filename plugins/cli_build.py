"""The model and source the CLI runs on CPU ranks, shared by ``weightsync check`` and ``export``.

``--layout fsdp``: the transformers model of the config (``presets.build_model``, seed 0), FSDP2 over
every rank (each decoder layer, then the root) and ``FSDPSource``. ``--layout megatron``: a
megatron-core ``GPTModel`` built from the same config at ``--tp/--pp/--vpp/--ep``
(``megatron_build``) and ``MegatronSource(mode="full")``: rank 0 owns every tensor.
Both honour ``--dtype`` (wire dtype) and ``--expert-layout``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from .demo import _shard
from .presets import build_model

__all__ = ["build_source"]


def build_source(
    args: argparse.Namespace, config: Any, dtype: torch.dtype | None, *, hf_model: torch.nn.Module | None = None
) -> WeightSource:
    """The CLI's source for ``args.layout`` (collective: every rank calls it). For ``fsdp``,
    ``hf_model`` is the already-built unsharded transformers model (default: ``build_model(config,
    seed=0)``); it is sharded in place."""
    expert_layout = getattr(args, "expert_layout", None)
    if getattr(args, "layout", "fsdp") == "megatron":
        from weightsync.sources import MegatronSource

        from .megatron_build import MegatronParallel, build_megatron_gpt

        par = MegatronParallel(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
        chunks = build_megatron_gpt(config, par, seed=0)
        model = chunks if args.vpp else chunks[0]
        return MegatronSource(model, hf_config=config, dtype=dtype, mode="full", expert_layout=expert_layout)
    from weightsync.sources import FSDPSource

    model = _shard(hf_model if hf_model is not None else build_model(config, seed=0))
    return FSDPSource(model, dtype=dtype, expert_layout=expert_layout)
