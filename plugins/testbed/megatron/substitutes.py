"""Modules that stand in where megatron-core's local spec has none and only Transformer Engine does.

Invariant: each substitute holds exactly the parameters -- names, shapes, TP attributes -- of the
module a TE-built trainer holds in its place (none at all for core attention), so ``MegatronSource``
over a model built with them declares and streams what it would over the real trainer; and each
computes what the module it replaces computes, so the model also runs forward (CPU or GPU).

* ``MLACoreAttention`` -- multi-head latent attention's core attention: megatron-core's local
  ``DotProductAttention`` (0.16 and 0.19) does not accept MLA's different q/k and v head dims
  (``k_channels`` / ``v_channels``), only TE's does.
* ``ZeroCenteredRMSNorm`` -- the norms of a gated-delta-net hybrid (Qwen3-Next / Qwen3.5): what TE
  computes under ``layernorm_zero_centered_gamma``, which the local spec refuses.
* ``DuplicatedLinear`` -- TE's ``TELinear(parallel_mode="duplicated")``, the DSA indexer's
  projections (DeepSeek-V3.2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MLACoreAttention", "ZeroCenteredRMSNorm", "DuplicatedLinear"]


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention for megatron's ``MLASelfAttention`` where only TE provides one.

    Takes megatron's ``[s, b, heads, d]`` query/key (q/k head dim ``qk_head_dim +
    qk_pos_emb_head_dim``) and value (``v_head_dim``) and returns ``[s, b, heads * v_head_dim]``,
    scaled by MLA's ``softmax_scale``. No parameters: it never changes what ``MegatronSource``
    exports. ``attention_mask`` follows megatron (True = masked); None means causal.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None, **_: Any) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("MLACoreAttention does not take packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm computing ``x * (1 + weight)`` (weight initialised to zero): what Transformer Engine's
    norms compute under ``layernorm_zero_centered_gamma=True``, which megatron-core's local spec
    (``WrappedTorchNorm``) refuses. A hybrid gated-delta-net model's norms are built from it -- one
    ``weight`` each, under the local spec's names -- so it holds the parameters a TE-trained
    Qwen3-Next / Qwen3.5 has and computes what they compute."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class DuplicatedLinear(torch.nn.Module):
    """A linear layer every TP rank holds whole (Transformer Engine's ``TELinear(parallel_mode=
    "duplicated")``, what megatron-core's DSA spec builds the indexer's projections from): one
    ``weight`` ``[out, in]``, no TP attributes, so ``dist_checkpointing`` saves it replicated."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable[..., Any],
                 bias: bool = False, skip_bias_add: bool = False, **_: Any) -> None:
        super().__init__()
        if bias:
            raise NotImplementedError("DuplicatedLinear holds no bias (the DSA indexer asks for none)")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None
