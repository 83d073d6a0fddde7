"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's structure (``deepseek_v32.py``: MLA with
interleaved rope, the DSA lightning indexer, DeepSeek-V3's sigmoid group-limited MoE with shared
experts and ``e_score_correction_bias``) whose indexer ropes its first ``qk_rope_head_dim`` channels
in *interleaved* pairs (``apply_rotary_pos_emb_interleave``) where DeepSeek-V3.2's are half-split:
megatron-core 0.16-0.18's pairs are already interleaved, so each indexer head's rows only move the
rope channels from last to first; 0.19 ropes the first channels, in interleaved pairs with
``dsa_indexer_rope_interleaved=True`` (the identity) or half-split ones (re-paired) (layout kind
``indexer_rope_interleaved``).

Refused besides DeepSeek-V3.2's refusals (naming the field): ``indexer_types`` with a ``"shared"``
layer (transformers builds no indexer there and reuses the previous layer's top-k; megatron-core's
DSA runs an indexer on every layer) and ``mlp_layer_types`` other than the first
``first_k_dense_replace`` layers dense (megatron's ``moe_layer_freq`` is built from that count).
``norm_topk_prob`` and group scores are exported as they are, as for GLM-4.5 (``glm4_moe.py``).
"""

from __future__ import annotations

from typing import Any

from .deepseek_v32 import dsa_family

__all__ = ["FAMILY"]


def _glm_unsupported(hf: Any) -> str | None:
    why = []
    shared = [i for i, t in enumerate(getattr(hf, "indexer_types", None) or []) if t != "full"]
    if shared:
        why.append(
            f"indexer_types has 'shared' layers {shared}: transformers reuses the previous layer's top-k there "
            "(no indexer tensors), megatron-core's DSA runs an indexer on every layer"
        )
    first = getattr(hf, "first_k_dense_replace", 0) or 0
    mlp = list(getattr(hf, "mlp_layer_types", None) or [])
    want = ["dense" if i < first else "sparse" for i in range(hf.num_hidden_layers)]
    if mlp and mlp != want:
        why.append(f"mlp_layer_types={mlp} is not first_k_dense_replace={first} dense layers then MoE")
    return "; ".join(why) or None


FAMILY = dsa_family("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), pairing="interleaved", also_unsupported=_glm_unsupported)
