"""Qwen3.5 vision-language models (``Qwen3_5ForConditionalGeneration``, ``model_type="qwen3_5"``, and
the MoE ``Qwen3_5MoeForConditionalGeneration``): refused, saying what to do instead.

The usual RL setup trains the language model under Megatron and the vision tower elsewhere (or
frozen). ``MegatronSource`` exports a language model: for these configs pass
``hf_config=config.text_config`` (``qwen3_5_text`` / ``qwen3_5_moe_text``, the families in
``qwen3_5_text.py`` / ``qwen3_5_moe_text.py``), which sends what ``Qwen3_5ForCausalLM.save_pretrained``
writes (``model.layers.*``, ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``).
The VLM's own checkpoint names the same tensors ``model.language_model.*`` and adds the tower
(``model.visual.*``); renaming the language model into it and merging the tower's stream (an
``FSDPSource`` over the vision module) into one sync is not implemented, so a VLM ``hf_config`` is
refused rather than exported under names its checkpoint does not have.
"""

from __future__ import annotations

from typing import Any

from .base import Family

__all__ = ["FAMILY"]


def unsupported(hf: Any) -> str:
    return (
        "a vision-language config: MegatronSource exports the language model only -- pass "
        "hf_config=config.text_config (model_type "
        f"{getattr(getattr(hf, 'text_config', None), 'model_type', 'qwen3_5_text')!r}: names model.layers.*, as "
        "Qwen3_5ForCausalLM saves them); the VLM checkpoint's names (model.language_model.*, plus the vision "
        "tower model.visual.*, which an FSDPSource over the vision module would send) are not produced"
    )


FAMILY = Family(
    "qwen3_5",
    ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    unsupported=unsupported,
    unbuildable=unsupported,
)
