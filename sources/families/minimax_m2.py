"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): refused, with the reason, on every rank.

Its attention normalizes q and k over the *whole projection width* -- ``self_attn.q_norm.weight``
``[num_attention_heads * head_dim]``, ``k_norm`` ``[num_key_value_heads * head_dim]``, one RMS over
every head at once (transformers ``MiniMaxM2Attention``: ``q_norm(q_proj(x))`` before the per-head
view). megatron-core builds q/k norms per head only: ``Attention.__init__`` builds
``q_layernorm`` / ``k_layernorm`` with ``hidden_size=hidden_size_per_attention_head`` and applies them
to ``[s, b, heads, head_dim]`` (0.16.1 ``transformer/attention.py``; 0.19.2 the same, via
``q_norm_cls(hidden_size=self.hidden_size_per_attention_head, ...)``). A per-head norm computes
another function (and has ``head_dim`` weights, not ``heads * head_dim``); a whole-width norm under
TP would need the sum of squares of every rank's heads (a TP all-reduce megatron-core does not do).
So no megatron-core model computes MiniMax-M2's attention, and ``MegatronSource`` /
the builder refuse it rather than export tensors of another model.
"""

from __future__ import annotations

from typing import Any

from .base import Family

__all__ = ["FAMILY"]


def unsupported(hf: Any) -> str:
    return (
        "MiniMax-M2's q/k RMSNorm spans the whole projection width (q_norm "
        f"[{getattr(hf, 'num_attention_heads', '?')} heads x {getattr(hf, 'head_dim', '?')}]), but megatron-core "
        "builds q_layernorm / k_layernorm per attention head (hidden_size_per_attention_head) and has no "
        "cross-head (cross-TP) q/k norm; export MiniMax-M2 from an FSDP2 trainer with FSDPSource instead"
    )


FAMILY = Family("minimax_m2", ("MiniMaxM2ForCausalLM",), unsupported=unsupported, unbuildable=unsupported)
