"""Tiny transformers configs for the demo, ``weightsync check`` and tests: built from a config,
random init, no downloads.

Each preset keeps its family's structure (GQA, tied or untied embeddings, Qwen3's q/k norms,
Qwen2's qkv biases, DeepSeek-V3's multi-head latent attention, GLM-4.5's partial rotary and
sigmoid-routed MoE, GPT-OSS's sinks, sliding windows and biased fused experts) at a size that trains in
milliseconds on one CPU core.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from weightsync.sources.toolkit import model_types

__all__ = [
    "PRESETS", "MEGATRON_MODEL_TYPES", "preset_names", "raw_config", "config_facts", "ConfigFacts", "load_config",
    "build_model", "UserError",
]

#: model_types ``testbed.megatron`` can build on CPU (dense, MoE, MLA): the family registry's, which
#: lists its modules without importing torch or megatron-core (the CLI checks ``--layout megatron`` first).
MEGATRON_MODEL_TYPES: tuple[str, ...] = model_types()


class UserError(ValueError):
    """A mistake in what the user asked for (unknown preset, bad path, bad sizes): the CLI prints
    the message in one line and exits 2."""


_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

_DEEPSEEK_V3: dict[str, Any] = dict(
    model_type="deepseek_v3",
    tie_word_embeddings=False,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
)

#: Qwen3-Next / Qwen3.5 hybrid structure: layers alternate gated delta net (linear attention) and
#: gated full attention (q/k norms, q_proj twice the heads' width), partial rotary 0.25. Every
#: gated-delta-net size differs (2 key heads x 8, 4 value heads x 12, conv kernel 4) and heads, kv
#: heads, key and value heads divide --tp 2; each pipeline stage of --pp 2 holds both layer kinds.
_HYBRID: dict[str, Any] = dict(
    _COMMON, tie_word_embeddings=False, intermediate_size=96, num_hidden_layers=4, head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", tie_word_embeddings=False, **_COMMON),
    "tiny-qwen2": dict(model_type="qwen2", tie_word_embeddings=True, **_COMMON),
    "tiny-qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=16, **_COMMON),
    "tiny-mistral": dict(model_type="mistral", tie_word_embeddings=False, **_COMMON),
    # MoE: transformers 5 fuses experts in memory (experts.gate_up_proj / down_proj); the
    # checkpoint has per-expert tensors.
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", tie_word_embeddings=False, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        **_COMMON,
    ),
    "tiny-mixtral": dict(
        model_type="mixtral", tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
        **_COMMON,
    ),
    # DeepSeek-V3 / Kimi-K2 structure: MLA with a q low-rank projection, layer 0 dense (first-k),
    # layer 1 MoE with a shared expert, sigmoid group-limited routing (2 groups, 1 picked) and
    # e_score_correction_bias. Every MLA size differs, and each divides tp=2 (heads, q_lora_rank,
    # kv_lora_rank + qk_rope_head_dim) so --tp 2 shards every projection.
    "tiny-deepseek-v3": dict(_DEEPSEEK_V3),
    # DeepSeek-V3.2: the same plus the DSA lightning indexer on every layer (4 heads x 16, rope on 8
    # of them, top 4 tokens).
    "tiny-deepseek-v32": dict(_DEEPSEEK_V3, model_type="deepseek_v32", index_n_heads=4, index_head_dim=16, index_topk=4),
    # GLM-5: the same structure, its indexer roping interleaved pairs; layer 0 dense (first-k 1).
    "tiny-glm5": dict(_DEEPSEEK_V3, model_type="glm_moe_dsa", index_n_heads=4, index_head_dim=16, index_topk=4),
    # The same without q_lora_rank (DeepSeek-V2-Lite style): one q_proj instead of q_a/q_b.
    "tiny-deepseek-v3-no-q-lora": dict(_DEEPSEEK_V3, q_lora_rank=None),
    # GLM-4.5 structure: partial rotary (half of each 24-wide head), q/k/v biases, q/k norms, layer 0
    # dense (first-k), layer 1 MoE with a shared expert and sigmoid group-limited routing (2 groups,
    # 1 kept, top 2) with e_score_correction_bias and a routed scaling factor. head_dim is not
    # hidden / heads, and heads, kv heads and experts divide --tp 2 / --ep 2.
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", tie_word_embeddings=False, head_dim=24, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, **_COMMON,
    ),
    # GPT-OSS structure: attention sinks, q/k/v/o biases, layer 0 sliding-window (8 tokens) and layer
    # 1 full attention, YaRN rope (transformers' defaults), every layer MoE with a biased router and
    # biased experts (clamped SwiGLU), held fused, transposed and gate/up-interleaved as transformers
    # saves them. Every expert dim differs (E 4, I 48, H 64).
    "tiny-gpt-oss": dict(
        _COMMON, model_type="gpt_oss", tie_word_embeddings=False, intermediate_size=48, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
        max_position_embeddings=131072,  # YaRN's factor 32 x original 4096, as released
    ),
    # Qwen3-Next: the hybrid above, layer 0 dense (mlp_only_layers), the others MoE with a shared
    # expert and its sigmoid gate (E 4, I 32, shared 48).
    "tiny-qwen3-next": dict(
        _HYBRID, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
    ),
    # Qwen3.5 dense text model: the hybrid with its four flat in-projections, dense MLPs.
    "tiny-qwen3.5": dict(_HYBRID, model_type="qwen3_5_text"),
    # Qwen3.5 MoE text model: every layer MoE with a shared expert and gate.
    "tiny-qwen3.5-moe": dict(
        _HYBRID, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def raw_config(preset: str | None = None, path: str | None = None) -> dict[str, Any]:
    """The plain dict of a preset (``tiny-qwen3`` or ``qwen3``) or of a ``config.json`` (file or
    directory), ``model_type`` included; a new dict every call. No transformers import: the CLI
    checks its arguments against it before any heavy import. Raises ``UserError``."""
    if path is not None:
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            where = "no config.json in that folder" if os.path.isdir(path) else "no such file or folder"
            raise UserError(f"--config {path}: {where} (weightsync downloads nothing: pass a local config.json, "
                            "or the folder of a downloaded Hugging Face snapshot)")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--config: {file} is not a readable JSON config: {e}") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise UserError(f"--config: {file} has no 'model_type'")
        return raw
    name = preset or "tiny-qwen3"
    key = name if name in PRESETS else f"tiny-{name}"
    if key not in PRESETS:
        raise UserError(
            f"unknown model preset {name!r}; choose one of {', '.join(preset_names())}, or pass a model's "
            "config.json with --config PATH (the file, or a folder holding it: e.g. a downloaded Hugging "
            "Face snapshot; weightsync downloads nothing)"
        )
    return dict(PRESETS[key])


@dataclass(frozen=True)
class ConfigFacts:
    """What the CLI's argument checks need from a config, read from its plain dict (``None``: the
    dict does not say; transformers' default applies and only the full config can tell)."""

    model_type: str
    heads: int | None
    kv_heads: int | None
    layers: int | None
    experts: int | None


def config_facts(
    preset: str | None = None, path: str | None = None, *, hidden: int | None = None, layers: int | None = None
) -> ConfigFacts:
    """``raw_config`` + the ``--hidden`` / ``--layers`` checks ``load_config`` makes, without
    transformers. Raises ``UserError`` with ``load_config``'s words."""
    raw = raw_config(preset, path)
    heads = raw.get("num_attention_heads")
    _check_resize(heads, hidden, layers)
    experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts")
    return ConfigFacts(
        model_type=str(raw["model_type"]),
        heads=heads,
        kv_heads=raw.get("num_key_value_heads") or heads,
        layers=layers if layers is not None else raw.get("num_hidden_layers"),
        experts=experts,
    )


def _check_resize(heads: int | None, hidden: int | None, layers: int | None) -> None:
    if hidden is not None and (hidden <= 0 or (heads is not None and hidden % heads)):
        raise UserError(f"--hidden {hidden} must be a positive multiple of the {heads} attention heads")
    if layers is not None and layers <= 0:
        raise UserError(f"--layers {layers} must be positive")


def load_config(
    preset: str | None = None,
    path: str | None = None,
    *,
    hidden: int | None = None,
    layers: int | None = None,
) -> Any:
    """A transformers config from a preset name (``tiny-qwen3`` or ``qwen3``) or a ``config.json``
    path (file or directory), optionally resized. Raises ``UserError`` for user mistakes."""
    from transformers import AutoConfig

    raw = raw_config(preset, path)
    model_type = raw.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as e:
        raise UserError(f"--config: transformers cannot build model_type {model_type!r}: {e}") from None
    if hidden is not None:
        heads = config.num_attention_heads
        _check_resize(heads, hidden, None)
        config.hidden_size = hidden
        config.intermediate_size = 2 * hidden
        # qwen3 keeps its own head_dim; DeepSeek-V3's head_dim is the rope dim (qk_rope_head_dim).
        if getattr(config, "head_dim", None) is not None and config.model_type not in ("qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
            config.head_dim = hidden // heads
    if layers is not None:
        _check_resize(None, None, layers)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[0]] * layers
    return config


def build_model(config: Any, seed: int = 0, dtype: Any = None) -> Any:
    """``AutoModelForCausalLM.from_config`` with a fixed seed, eager attention, on CPU (fp32 unless
    ``dtype`` says otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    return model
