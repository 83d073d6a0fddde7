"""Mistral (``MistralForCausalLM``): Llama's layout without biases (sliding windows change
attention, not tensors)."""

from .base import Family

FAMILY = Family("mistral", ("MistralForCausalLM",))
