"""Qwen3.5 dense text model (``Qwen3_5ForCausalLM``, ``model_type="qwen3_5_text"``): Qwen3-Next's
hybrid decoder (``qwen3_next.py``: gated delta net + gated attention, the same megatron fields, norms
and refusals) with a dense MLP on every layer and four flat in-projection tensors:
``linear_attn.in_proj_qkv`` = ``[q; k; v]`` over all heads, ``in_proj_z``, ``in_proj_b`` (beta),
``in_proj_a`` (alpha) (``Qwen3_5GatedDeltaNet.__init__`` / ``forward``). Megatron's per-rank
``[q_r | k_r | v_r | z_r | beta_r | alpha_r]`` is regrouped by layout kind ``gdn_qkv_z_b_a``.

The rope is interleaved multimodal rope (``mrope_section``); for text-only positions (all three
position ids equal) it is the plain partial rope megatron computes. The vision-language wrapper
(``qwen3_5``, ``Qwen3_5ForConditionalGeneration``) is not served here."""

from .qwen3_next import gdn_family

FAMILY = gdn_family(
    "qwen3_5_text",
    ("Qwen3_5ForCausalLM",),
    "gdn_qkv_z_b_a",
    ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
    lambda qk, v, nv: (2 * qk + v, v, nv, nv),
    mtp_count="mtp_num_hidden_layers",
)
