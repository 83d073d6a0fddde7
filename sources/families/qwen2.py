"""Qwen2 (``Qwen2ForCausalLM``): Llama's layout with q/k/v biases always (no o_proj bias)."""

from .base import ALWAYS, Family

FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=ALWAYS)
