"""Build this rank's megatron-core ``GPTModel`` chunk(s) for a transformers config, on CPU ranks.

Invariant: the chunks have exactly the parameters -- names, TP/PP/VPP/EP shards, shapes -- that a
megatron-core trainer of the same config holds (``config.megatron_config``, ``specs``), built under
the construction-only patches of ``cpu_patches``; values are megatron's seeded random init until
``hf_weights.load_hf_weights`` lays a checkpoint's tensors into them.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from weightsync.sources.toolkit import get_logger

from .config import VOCAB_DIVISIBLE_BY, MegatronParallel, expert_tp_size, family_of, megatron_config
from .cpu_patches import cpu_construction, gdn_construction, mla_without_te
from .specs import hybrid_mtp_spec, hybrid_spec, mla_spec

__all__ = ["build_megatron_gpt", "build_chunks"]

logger = get_logger(__name__)


def build_megatron_gpt(
    hf: Any,
    par: MegatronParallel,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    spec_hook: Callable[[Any], Any] | None = None,
) -> list[torch.nn.Module]:
    """Initialize megatron's parallel state for ``par`` over the default process group (gloo is
    fine) and build this rank's ``GPTModel`` chunk(s) for ``hf``: one per virtual-pipeline stage,
    in order. The caller owns ``parallel_state`` afterwards (``destroy_model_parallel``).

    ``overrides`` sets ``TransformerConfig`` fields; ``spec_hook(spec) -> spec`` edits the layer
    spec before the build (both for tests that need a variant megatron-core can build but a
    trainer config of ``hf`` would not)."""
    from megatron.core import parallel_state as ps

    mcfg = megatron_config(hf, par, dtype, overrides)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=expert_tp_size(hf, par) if mcfg.num_moe_experts else None,
    )
    torch.manual_seed(seed)
    return build_chunks(hf, mcfg, par, spec_hook=spec_hook)


def build_chunks(
    hf: Any,
    mcfg: Any,
    par: MegatronParallel,
    *,
    divisible_by: int = VOCAB_DIVISIBLE_BY,
    spec_hook: Callable[[Any], Any] | None = None,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) for ``hf`` and its config ``mcfg`` under the parallel state
    already initialized for ``par`` (``divisible_by``: megatron's ``make_vocab_size_divisible_by``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    multiple = divisible_by * par.tp
    vocab = int(math.ceil(hf.vocab_size / multiple) * multiple)
    chunks: list[torch.nn.Module] = []
    mla = bool(getattr(mcfg, "multi_latent_attention", False))
    hybrid = getattr(mcfg, "experimental_attention_variant", None) == "gated_delta_net"
    with cpu_construction(), (mla_without_te() if mla else contextlib.nullcontext()), (
        gdn_construction() if hybrid else contextlib.nullcontext()
    ):
        for v in range(par.vpp or 1):
            vp = v if par.vpp else None
            if hybrid:
                spec = hybrid_spec(mcfg, vp)
            elif mcfg.num_moe_experts:
                # megatron-core 0.19 asserts no experimental attention variant in the decoder-block
                # spec (0.16 ignores it): the MLP / MLA layer specs from a copy without it; DSA's
                # core attention is put in by mla_spec below, and GPTModel gets the real config
                spec_cfg = mcfg
                if getattr(mcfg, "experimental_attention_variant", None) == "dsa":
                    spec_cfg = copy.copy(mcfg)
                    spec_cfg.experimental_attention_variant = None
                spec = get_gpt_decoder_block_spec(
                    spec_cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp
                )
            else:
                spec = get_gpt_layer_local_spec(
                    qk_layernorm=mcfg.qk_layernorm, multi_latent_attention=mla, normalization="RMSNorm"
                )
            if mla:
                spec = mla_spec(spec, dsa=getattr(mcfg, "experimental_attention_variant", None) == "dsa")
            if spec_hook is not None:
                spec = spec_hook(spec)
            mtp: dict[str, Any] = {}
            if getattr(mcfg, "mtp_num_layers", None):  # multi-token prediction: megatron's own MTP block spec
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

                mtp_spec = (hybrid_mtp_spec(mcfg, vp) if hybrid else
                            get_gpt_mtp_block_spec(mcfg, spec, use_transformer_engine=False, vp_stage=vp))
                mtp = {"mtp_block_spec": mtp_spec} if mtp_spec is not None else {}
            chunks.append(
                GPTModel(
                    mcfg,
                    spec,
                    vocab_size=vocab,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                    **{k: f.value for k, f in family_of(hf).gpt_model_fields(hf).items()},
                    vp_stage=vp,
                    **mtp,
                )
            )
    logger.info("built megatron GPTModel (%s, %s): %d chunk(s)", hf.model_type, par, len(chunks))
    return chunks
