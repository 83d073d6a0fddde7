"""Tiny transformers-5 MoE models of each family the expert transforms support (test helpers).

Sizes are chosen so every dimension differs (E != I != H), which makes a transposed or swapped
slice fail its shape check instead of passing by accident.
"""

from __future__ import annotations

import os
import tempfile

import torch

FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(
        hidden_size=16, intermediate_size=40, moe_intermediate_size=12, num_experts=6,
        num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=64, decoder_sparse_step=1, mlp_only_layers=[1],
    ),
    "qwen2_moe": dict(
        hidden_size=16, intermediate_size=40, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
    ),
    "mixtral": dict(
        hidden_size=16, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64,
    ),
    "deepseek_v3": dict(
        hidden_size=16, intermediate_size=40, moe_intermediate_size=12, n_routed_experts=6,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
        q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
    ),
    # GLM-4.5: partial rotary, q/k/v biases, q/k norms, first-k dense, shared experts, sigmoid
    # group-limited routing with e_score_correction_bias.
    "glm4_moe": dict(
        hidden_size=16, intermediate_size=40, moe_intermediate_size=12, n_routed_experts=6,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, routed_scaling_factor=2.5,
    ),
}

#: Families whose checkpoint keeps the fused in-memory expert tensors (``save_pretrained`` does not
#: split them): GPT-OSS -- ``[E, H, 2I]`` gate/up interleaved, ``[E, I, H]``, biases, a biased
#: router, attention sinks, sliding-window layers.
FUSED_CHECKPOINT_FAMILIES: dict[str, dict] = {
    "gpt_oss": dict(
        hidden_size=16, intermediate_size=12, num_local_experts=6, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64,
        sliding_window=4, attention_bias=True,
    ),
}


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    base = FAMILIES[family] if family in FAMILIES else FUSED_CHECKPOINT_FAMILIES[family]
    cfg = AutoConfig.for_model(family, **{**base, **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # distinct, non-trivial values everywhere (router bias included)
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "rotary" not in _:
                t.copy_(torch.randn_like(t))
    return model.eval()


def saved_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes, read back from the safetensors files."""
    import safetensors.torch as st

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, torch.Tensor] = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                out.update(st.load_file(os.path.join(d, f)))
    return out


def fused_params(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    from weightsync.sources.core.hf.experts import is_fused_expert_param

    return {n: tuple(p.shape) for n, p in model.named_parameters() if is_fused_expert_param(n, p.shape)}
