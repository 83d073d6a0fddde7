"""Qwen3 (``Qwen3ForCausalLM``): per-head q/k RMSNorm (``q_norm`` / ``k_norm``, Megatron's
``q_layernorm`` / ``k_layernorm``) always; q/k/v/o biases iff ``attention_bias``; ``head_dim`` may
differ from ``hidden_size / heads`` (Megatron's ``kv_channels``)."""

from .base import ALWAYS, Family, flag

FAMILY = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    qkv_bias=flag("attention_bias"),
    o_bias=flag("attention_bias"),
    qk_norm=ALWAYS,
)
