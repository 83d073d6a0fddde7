"""The layer specs the CPU builder builds from: megatron-core's local spec, with substitutes where
only Transformer Engine provides a module.

Invariant: a spec here names the same submodules, under the same names, as the spec a TE-built
trainer of the family uses, so the model built from it has that trainer's parameters.

* ``hybrid_spec`` -- a gated-delta-net hybrid (``qwen3_next``, ``qwen3_5_text``,
  ``qwen3_5_moe_text``), assembled layer by layer from local-spec pieces (megatron's own hybrid
  block spec asserts TE), every norm a ``ZeroCenteredRMSNorm``;
* ``hybrid_mtp_spec`` -- the same hybrid's multi-token-prediction block: megatron's own MTP block
  spec around a full-attention layer of that hybrid, its norms ``ZeroCenteredRMSNorm`` too;
* ``mla_spec`` -- multi-head latent attention (``deepseek_v3``) with ``MLACoreAttention`` as core
  attention, or DSA's ``DSAttention`` + ``DSAIndexer`` (DeepSeek-V3.2) with ``DuplicatedLinear``
  projections.
"""

from __future__ import annotations

import copy
from typing import Any

from .substitutes import DuplicatedLinear, MLACoreAttention, ZeroCenteredRMSNorm

__all__ = ["hybrid_mtp_spec", "hybrid_spec", "mla_spec"]


def hybrid_spec(mcfg: Any, vp: int | None) -> Any:
    """The local-spec block of a gated-delta-net hybrid (Qwen3-Next / Qwen3.5), assembled layer by
    layer as megatron-core's ``get_transformer_block_with_experimental_attention_variant_spec``
    does (which asserts Transformer Engine): ``linear_attention_freq`` 1 -> ``GatedDeltaNet``
    (``in_proj`` column-parallel, ``out_norm``, ``out_proj`` row-parallel: the spec
    ``get_gated_delta_net_module_spec`` builds with a backend whose norm is not fused), 0 -> the
    local spec's attention (gated by ``attention_output_gate``, q/k norms); dense or MoE MLP per
    ``moe_layer_freq``; every norm ``ZeroCenteredRMSNorm``; this pipeline stage's layers only."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers, _ = _hybrid_layers(mcfg)
    offset = get_transformer_layer_offset(mcfg, vp_stage=vp)
    n = get_num_layers_to_build(mcfg, vp_stage=vp)
    return TransformerBlockSubmodules(layer_specs=layers[offset : offset + n], layer_norm=ZeroCenteredRMSNorm)


def hybrid_mtp_spec(mcfg: Any, vp: int | None) -> Any:
    """The MTP block spec of a gated-delta-net hybrid (``mtp_num_layers``), or None where this
    pipeline stage holds no MTP layer: megatron-core's own ``get_gpt_mtp_block_spec_for_backend``
    (placement on the last stage, one ``MultiTokenPredictionLayer`` per MTP layer) around the spec
    of the hybrid's *last full-attention layer* -- gated attention with q/k norms and that layer's
    MLP (dense or MoE), as the released checkpoints' ``mtp.layers.{i}`` and vLLM's ``Qwen3NextMTP``
    / ``Qwen3_5MTP`` (``layer_type="full_attention"``) hold it, whatever kind the decoder's last
    layer is. ``enorm`` / ``hnorm`` / ``final_layernorm`` are ``ZeroCenteredRMSNorm`` (the local
    backend's norm refuses ``layernorm_zero_centered_gamma``; TE's computes ``x * (1 + w)``, as
    the checkpoint's ``pre_fc_norm_*`` / ``mtp.norm`` do), ``eh_proj`` column-parallel."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    layers, pattern = _hybrid_layers(mcfg)
    full = [i for i, linear in enumerate(pattern) if not linear]
    if not full:
        raise ValueError("linear_attention_freq has no full-attention layer for the MTP block to be built like")

    class _ZeroCenteredNorms(LocalSpecProvider):  # the local backend, its norm zero-centered
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return ZeroCenteredRMSNorm

    return get_gpt_mtp_block_spec_for_backend(
        config=mcfg, spec=copy.deepcopy(layers[full[-1]]), backend=_ZeroCenteredNorms(), vp_stage=vp
    )


def _hybrid_layers(mcfg: Any) -> tuple[list[Any], list[int]]:
    """Every decoder layer's local spec of a hybrid (``hybrid_spec``'s docstring), and the
    ``linear_attention_freq`` pattern (1: gated delta net, 0: full attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    L = mcfg.num_layers
    if mcfg.num_moe_experts:
        plain = copy.copy(mcfg)  # megatron-core 0.19 asserts no experimental variant here: the MLP specs only
        plain.experimental_attention_variant = None
        base = get_gpt_decoder_layer_specs(plain, use_transformer_engine=False, normalization="RMSNorm")
    else:
        base = [get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")] * L
    freq = mcfg.linear_attention_freq
    pattern = [0 if (i + 1) % freq == 0 else 1 for i in range(L)] if isinstance(freq, int) else list(freq)
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear
        ),
    )
    layers = []
    for i in range(L):
        spec = copy.deepcopy(base[i])
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if pattern[i]:
            sub.self_attention = copy.deepcopy(gdn)
        else:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        layers.append(spec)
    return layers, pattern


def mla_spec(spec: Any, dsa: bool = False) -> Any:
    """``spec`` (a block spec or one layer spec) with ``MLACoreAttention`` as core attention, or
    (``dsa``) megatron-core's ``DSAttention`` holding its ``DSAIndexer`` as
    ``get_dsa_module_spec_for_backend`` assembles it -- with ``DuplicatedLinear`` where that asks
    the backend for ``linear()``, which the local spec provider does not have."""
    core: Any = MLACoreAttention
    if dsa:
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexer, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules,
        )
        from megatron.core.transformer.spec_utils import ModuleSpec

        norm = LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True)
        core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=ModuleSpec(
            module=DSAIndexer, submodules=DSAIndexerSubmodules(
                linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=norm,
                linear_weights_proj=DuplicatedLinear,
            ),
        )))
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = core
    return spec
