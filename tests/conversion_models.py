"""Models of every architecture transformers ships, for the conversion tests (test helpers).

* ``registry()``: transformers' causal-LM and image-text-to-text classes (its own auto mappings),
  plus the multimodal models RL teams train whose class is in neither (Qwen3-Omni's thinker).
* ``meta_model(model_type)``: the architecture's default config with at most 4 layers per stack
  (lists indexed by layer truncated alike), built on the meta device: the names and global shapes
  of a real checkpoint at no memory cost.
* ``saved_layout(model)``: what ``save_pretrained`` writes -- names, shapes, dtypes -- by running
  ``save_pretrained`` itself with safetensors' writer replaced by a recorder (works on meta
  tensors). This is the oracle: transformers' own save path, tied weights, ignored keys and
  conversion reversal included.
* ``tiny_model(model_type)``: a real, small model of the architectures ``test_conversions`` streams
  multi-rank (``TINY``): generic small dimensions plus the few fields each config needs.
"""

from __future__ import annotations

import copy
import tempfile
import warnings

import torch

#: Per-stack layer fields shrunk by ``shrink``.
LAYER_KEYS = ("num_hidden_layers", "num_layers", "depth", "n_layer", "num_decoder_layers")

#: Default-config fields some architectures leave unset (``None``) although building needs them.
CONFIG_FIXES: dict[str, dict] = {
    "hunyuan_v1_moe": dict(head_dim=128),
    "hunyuan_v1_dense": dict(head_dim=128),
    "ministral": dict(head_dim=128),
    "nemotron": dict(num_key_value_heads=8),
    "dots1": dict(n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2),
    # QSA indexer on the attention layers, per-layer n-gram embedding on layer 0 (saved in shards)
    "qwen4_exp_text": dict(
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=64,
        indexer_compress_ratio=4, ple_layer_ids=[1], eos_token_id=1, ngram_vocab_size_base=1000, split_ngram_parts=4,
    ),
}
CONFIG_FIXES["qwen4_exp"] = dict(text_config=CONFIG_FIXES["qwen4_exp_text"])
CONFIG_FIXES.update(
    lfm2_moe=dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"]),
    hunyuan_vl=dict(text_config=dict(head_dim=128)),
    deepseek_ocr2=dict(text_config=dict(
        num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_group=1, topk_group=1,
        num_experts_per_tok=2,
    )),
    reformer=dict(is_decoder=True),
    aya_vision=dict(vision_config=dict(num_attention_heads=16)),
    emu3=dict(pad_token_id=0),
)

#: Multimodal architectures an RL team trains whose model class is in neither auto mapping.
EXTRA = {"qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}


def registry() -> list[tuple[str, str]]:
    """``(model_type, kind)`` of every causal-LM and image-text-to-text class (kind: ``causal``,
    ``vlm``, or an explicit class name from ``EXTRA``)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    out = [(mt, "causal") for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    out += [(mt, "vlm") for mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    out += [(mt, cls) for mt, cls in EXTRA.items()]
    return out


def _subconfigs(cfg, seen=None):
    from transformers import PretrainedConfig

    seen = set() if seen is None else seen
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    yield cfg
    for v in list(vars(cfg).values()):
        if isinstance(v, PretrainedConfig):
            yield from _subconfigs(v, seen)


def _get(cfg, key):
    try:
        return getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - heterogeneous configs refuse global reads of per-layer fields
        return None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def shrink(cfg, keep: int = 4):
    """At most ``keep`` layers in every stack of ``cfg`` and its sub-configs; per-layer lists of the
    old length are truncated alike (``layer_types``, ``mlp_only_layers`` masks ...)."""
    for c in _subconfigs(cfg):
        for k in LAYER_KEYS:
            n = _get(c, k)
            if _int(n) and n > keep:
                setattr(c, k, keep)
                for a, v in list(vars(c).items()):
                    if isinstance(v, (list, tuple)) and len(v) == n and a not in LAYER_KEYS:
                        setattr(c, a, type(v)(v[:keep]))
    return cfg


def _apply(cfg, fixes: dict):
    for k, v in fixes.items():
        if isinstance(v, dict) and not isinstance(_get(cfg, k), dict) and _get(cfg, k) is not None:
            _apply(getattr(cfg, k), v)
        else:
            setattr(cfg, k, copy.deepcopy(v))
    return cfg


def config_of(model_type: str, *, fixes: dict | None = None):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    _apply(cfg, CONFIG_FIXES.get(model_type, {}))
    if fixes:
        _apply(cfg, fixes)
    return cfg


def build(model_type: str, kind: str, cfg, *, meta: bool):
    """The model transformers' auto class builds for ``cfg`` (``kind``: ``causal`` / ``vlm``), or
    the named class (``EXTRA``; a thinker class gets the config's ``thinker_config``)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if kind in ("causal", "vlm"):
        auto = AutoModelForCausalLM if kind == "causal" else AutoModelForImageTextToText
        make = auto.from_config
    else:
        make = getattr(transformers, kind)._from_config
        cfg = getattr(cfg, "thinker_config", None) or cfg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if meta:
            with torch.device("meta"):
                return make(cfg)
        return make(cfg)


def meta_model(model_type: str, kind: str):
    """The architecture on the meta device: default config, shrunk layers (the full default config
    when the shrunk one does not build)."""
    try:
        return build(model_type, kind, shrink(config_of(model_type)), meta=True)
    except Exception:  # noqa: BLE001 - some configs tie other fields to the layer count
        return build(model_type, kind, config_of(model_type), meta=True)


def meta_model_and_layout(model_type: str, kind: str):
    """``(meta_model, saved_layout)``; the full default config when the shrunk one does not build or
    save (configs that validate per-layer indices at save time)."""
    try:
        model = build(model_type, kind, shrink(config_of(model_type)), meta=True)
        return model, saved_layout(model)
    except Exception:  # noqa: BLE001
        model = build(model_type, kind, config_of(model_type), meta=True)
        return model, saved_layout(model)


def saved_layout(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` that ``model.save_pretrained`` writes (module docstring)."""
    import transformers.modeling_utils as mu

    got: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def record(tensors, filename, metadata=None):
        for k, v in tensors.items():
            got[k] = (tuple(v.shape), v.dtype)

    from transformers.utils import logging as hf_logging

    orig, bars = mu.safe_save_file, hf_logging.is_progress_bar_enabled()
    mu.safe_save_file = record
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(d)
    finally:
        mu.safe_save_file = orig
        if bars:
            hf_logging.enable_progress_bar()
    return got


# ---- real tiny models of the architectures streamed multi-rank -----------------------------------

#: Small dimensions applied to every (sub-)config where the field exists and is larger.
SMALL = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=97,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    embed_dim=32, num_heads=4, out_hidden_size=32, projection_dim=32,
    # latent attention, linear attention, indexers, projectors
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    linear_head_dim=8, linear_num_heads=4, index_head_dim=16, index_n_heads=2, rotary_dim=4,
    dense_intermediate_size=48, shared_intermediate_size=24, projection_intermediate_size=48,
    projection_hidden_size=32, projector_hidden_size=32, merged_hidden_size=128,
    linear_key_head_dim=8, linear_value_head_dim=8, ple_embed_dim=32, mamba_head_dim=8, mamba_num_heads=8,
    ssm_state_size=8, downsample_hidden_size=16, d_model=32, encoder_ffn_dim=48, output_dim=32,
)

#: model_type -> (kind, config fields beyond ``SMALL``): the architectures issue 33 names and the
#: ones it lists as already exact, each small enough to stream on 2 CPU ranks in well under a second.
TINY: dict[str, tuple[str, dict]] = {
    "kimi_linear": ("causal", {}),
    "olmo_hybrid": ("causal", {}),
    "glm5_next": ("vlm", dict(text_config=dict(num_key_value_heads=4))),
    "qwen4_exp_text": ("causal", {}),
    "minimax_m3_vl": ("vlm", {}),
    "kimi_k25": ("vlm", {}),
    "nemotron_h": ("causal", {}),
    "step3p7": ("vlm", dict(vision_config=dict(intermediate_size=186))),  # hidden_size * mlp_ratio
    "llama4_text": ("causal", {}),
    "qwen3_omni_moe": ("Qwen3OmniMoeThinkerForConditionalGeneration", {}),
}


def small(cfg):
    for c in _subconfigs(cfg):
        for k, v in SMALL.items():
            cur = _get(c, k)
            if _int(cur) and cur > v:
                try:
                    setattr(c, k, v)
                except Exception:  # noqa: BLE001
                    pass
        pad = _get(c, "pad_token_id")
        vocab = _get(c, "vocab_size")
        if _int(pad) and _int(vocab) and pad >= vocab:
            c.pad_token_id = 0
    return cfg


def tiny_model(model_type: str, seed: int = 0, fixes: dict | None = None) -> torch.nn.Module:
    """``TINY[model_type]``'s model (``fixes``: more config fields, e.g. a wider tower for a bench)."""
    kind, own = TINY[model_type]
    cfg = _apply(_apply(small(shrink(config_of(model_type), keep=4)), own), fixes or {})
    torch.manual_seed(seed)
    return build(model_type, kind, cfg, meta=False)
