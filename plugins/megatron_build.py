"""A megatron-core ``GPTModel`` for a transformers config, built on CPU ranks (``weightsync check``).

Invariant: the model has exactly the parameters -- names, TP/PP/VPP/EP shards, shapes -- that a
megatron-core trainer of the same config would hold (local spec, ``use_cpu_initialization=True``),
so ``MegatronSource`` over it declares and streams what it would over a real trainer. Values are
megatron's random init: a dry run checks names, shapes, dtypes and the stream, not weights.

Why each CPU concession is safe:

* MoE layers use the ``allgather`` token dispatcher: the others allocate CUDA buffers at
  construction. The dispatcher decides how tokens move in forward, not which parameters exist.
* ``torch.Tensor.cuda`` is the identity during construction: with tied embeddings under PP,
  ``GPTModel`` moves the shared weight with ``.cuda()`` before its first/last-stage all-reduce.
* ``torch.cuda.current_device`` / ``synchronize`` answer for the CPU during construction (the
  router's expert bias is allocated on the current device). Both are restored afterwards, and
  nothing is patched on a host with CUDA.

Supported: dense llama / mistral / qwen2 / qwen3 and MoE qwen3_moe / qwen2_moe (shared expert +
gate) / mixtral. Other families raise ``ValueError`` naming ``model_type``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.sources.logs import get_logger

__all__ = ["MegatronParallel", "SUPPORTED_MODEL_TYPES", "build_megatron_gpt", "megatron_config"]

logger = get_logger(__name__)

_DENSE = ("llama", "mistral", "qwen2", "qwen3")
_MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = _DENSE + _MOE

#: megatron's default ``make_vocab_size_divisible_by``: vocabulary rows are padded to a multiple
#: of this times TP (``MegatronSource`` trims them back to ``vocab_size``).
VOCAB_DIVISIBLE_BY = 128


class MegatronParallel:
    """Sizes of the parallel layout (``vpp=None``: no virtual pipeline)."""

    def __init__(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1) -> None:
        self.tp, self.pp, self.vpp, self.ep = tp, pp, vpp, ep

    def __repr__(self) -> str:
        return f"tp{self.tp} pp{self.pp} vpp{self.vpp or 1} ep{self.ep}"


def _moe_fields(hf: Any) -> dict[str, Any]:
    """TransformerConfig MoE fields of ``hf`` (empty for dense families)."""
    mt = hf.model_type
    if mt == "mixtral":
        return dict(
            num_moe_experts=hf.num_local_experts,
            moe_ffn_hidden_size=hf.intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            moe_layer_freq=1,
        )
    if mt in ("qwen3_moe", "qwen2_moe"):
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf, "mlp_only_layers", None) or ())
        freq = [
            int(i not in dense and hf.num_experts > 0 and (i + 1) % step == 0)
            for i in range(hf.num_hidden_layers)
        ]
        out = dict(
            num_moe_experts=hf.num_experts,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            moe_layer_freq=freq,
        )
        if mt == "qwen2_moe" and getattr(hf, "shared_expert_intermediate_size", 0):
            out.update(
                moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
            )
        return out
    return {}


def megatron_config(hf: Any, par: MegatronParallel, dtype: torch.dtype = torch.float32) -> Any:
    """The megatron-core ``TransformerConfig`` a trainer would use for transformers config ``hf``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={mt!r}: no CPU Megatron builder for it (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    moe = _moe_fields(hf)
    extra: dict[str, Any] = {}
    if moe:
        extra = dict(
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.tp,
            **moe,
        )
    heads = hf.num_attention_heads
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        ffn_hidden_size=hf.intermediate_size,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=mt.startswith("qwen2") or bool(getattr(hf, "attention_bias", False)),
        qk_layernorm=mt.startswith("qwen3"),
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        sequence_parallel=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **extra,
    )


@contextlib.contextmanager
def _cpu_construction() -> Iterator[None]:
    """See the module docstring: CUDA calls megatron-core makes while constructing, on a CPU host."""
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


def _rope_base(hf: Any) -> int:
    theta = getattr(hf, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return int(theta)


def build_megatron_gpt(
    hf: Any, par: MegatronParallel, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.nn.Module]:
    """Initialize megatron's parallel state for ``par`` over the default process group (gloo is
    fine) and build this rank's ``GPTModel`` chunk(s) for ``hf``: one per virtual-pipeline stage,
    in order. The caller owns ``parallel_state`` afterwards (``destroy_model_parallel``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    mcfg = megatron_config(hf, par, dtype)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        expert_model_parallel_size=par.ep,
    )
    torch.manual_seed(seed)
    multiple = VOCAB_DIVISIBLE_BY * par.tp
    vocab = int(math.ceil(hf.vocab_size / multiple) * multiple)
    chunks: list[torch.nn.Module] = []
    with _cpu_construction():
        for v in range(par.vpp or 1):
            vp = v if par.vpp else None
            if mcfg.num_moe_experts:
                spec = get_gpt_decoder_block_spec(
                    mcfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp
                )
            else:
                spec = get_gpt_layer_local_spec(qk_layernorm=mcfg.qk_layernorm, normalization="RMSNorm")
            chunks.append(
                GPTModel(
                    mcfg,
                    spec,
                    vocab_size=vocab,
                    max_sequence_length=getattr(hf, "max_position_embeddings", 128),
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                    share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
                    position_embedding_type="rope",
                    rotary_base=_rope_base(hf),
                    vp_stage=vp,
                )
            )
    logger.info("built megatron GPTModel (%s, %s): %d chunk(s)", hf.model_type, par, len(chunks))
    return chunks
