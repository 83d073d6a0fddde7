"""Llama (``LlamaForCausalLM``): grouped-query attention in one ``linear_qkv``, SwiGLU MLP; the
checkpoint has q/k/v/o biases iff ``attention_bias`` and MLP biases iff ``mlp_bias``."""

from .base import Family, flag

FAMILY = Family(
    "llama",
    ("LlamaForCausalLM",),
    qkv_bias=flag("attention_bias"),
    o_bias=flag("attention_bias"),
    mlp_bias=flag("mlp_bias"),
)
