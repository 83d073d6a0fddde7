"""Tiny DeepSeek-V3 models (multi-head latent attention + MoE) on both sides, for the MLA tests here
and the GPU evidence: transformers configs, megatron-core models built from them, and the two
forwards the logits oracle compares (helpers, no tests).

* ``hf_config(variant, **over)``: a ``DeepseekV3Config``; ``"q_lora"`` is the ``tiny-deepseek-v3``
  preset (MLA with q_lora_rank, layer 0 dense, then MoE with a shared expert, sigmoid
  group-limited routing, ``e_score_correction_bias``), ``"no_q_lora"`` the same with one
  ``q_proj``. Every size differs, so a transposed or swapped tensor fails its shape check.
* ``unsupported(variant)``: why this megatron-core cannot build the variant (0.17+ without
  q_lora_rank), else None -- report it as a skip.
* ``build_megatron(hf, par)``: this rank's GPTModel chunks via ``weightsync.plugins.megatron_build``
  (local spec; parallel state initialized), norms / expert bias moved off 1 / 0 so a swapped
  tensor shows. ``par`` is ``MegatronParallel(tp, pp, vpp, ep)``.
* ``megatron_logits(model, ids, vocab_size)`` (TP1 / PP1) and ``hf_logits(hf, exported, ids)`` (the export
  written as safetensors and loaded with ``from_pretrained``, eager, fp32): ``[batch, seq, vocab]``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.plugins.presets import PRESETS

VARIANTS = {"q_lora": "tiny-deepseek-v3", "no_q_lora": "tiny-deepseek-v3-no-q-lora"}


def hf_config(variant: str = "q_lora", **over: Any) -> Any:
    """The preset's ``DeepseekV3Config`` (``architectures`` set) with ``over`` applied."""
    from transformers import AutoConfig

    kw = {**PRESETS[VARIANTS[variant]], **over}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def fused_down_spec(spec: Any) -> Any:
    """``spec`` with megatron-core 0.17+'s ``FusedMLASelfAttention`` (one column-parallel
    ``linear_qkv_down_proj``, what ``mla_down_proj_fusion`` builds) instead of ``MLASelfAttention``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attn = layer.submodules.self_attention
        attn.module = FusedMLASelfAttention
        attn.submodules.linear_qkv_down_proj = ColumnParallelLinear
        attn.submodules.linear_q_down_proj = attn.submodules.linear_kv_down_proj = None
    return spec


def has_fused_down() -> bool:
    """Whether this megatron-core has ``FusedMLASelfAttention`` (0.17+)."""
    try:
        from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported(variant: str) -> str | None:
    """Why this megatron-core cannot build ``variant`` from the local spec, else None."""
    import importlib.util

    if variant == "no_q_lora" and importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config"):
        return "megatron-core >= 0.17 builds MLA without q_lora_rank only with TE's fused q norm"
    return None


def build_megatron(hf: Any, par: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   overrides: dict[str, Any] | None = None, spec_hook: Any = None) -> list[torch.nn.Module]:
    """This rank's chunk(s) of ``hf`` under ``par`` with distinctive norms and expert biases
    (``overrides`` / ``spec_hook``: as ``build_megatron_gpt`` takes them)."""
    from megatron_worlds import randomize_norms_and_biases

    from weightsync.plugins.megatron_build import build_megatron_gpt

    chunks = build_megatron_gpt(hf, par, dtype=dtype, seed=seed, overrides=overrides, spec_hook=spec_hook)
    randomize_norms_and_biases(chunks)
    with torch.no_grad():  # the router's expert bias is a buffer: seed it by its global layer
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
                if bias is not None:
                    g = torch.Generator().manual_seed(zlib.crc32(f"expert_bias{layer.layer_number}".encode()))
                    bias.copy_(0.1 * torch.randn(bias.shape, generator=g))
    return chunks


@contextlib.contextmanager
def forward_shims() -> Iterator[None]:
    """What a megatron-core MoE forward needs on a host without TE / CUDA: 0.16's router names
    ``te_general_gemm`` only when TE imported, and allocates on ``torch.cuda.current_device()``."""
    from megatron.core.transformer.moe import moe_utils

    saved_dev = torch.cuda.current_device
    added = not hasattr(moe_utils, "te_general_gemm")
    if added:
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved_dev
        if added:
            del moe_utils.te_general_gemm


@torch.no_grad()
def megatron_logits(model: Any, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Megatron's own forward (TP1 / PP1): ``[batch, seq, vocab_size]`` logits, padding cut."""
    model = model[0] if isinstance(model, (list, tuple)) else model
    model.eval()
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with forward_shims():
        out = model(ids, pos, attention_mask=None)
    return out[..., :vocab_size].float()


@torch.no_grad()
def hf_logits(hf: Any, exported: dict[str, torch.Tensor], ids: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    """transformers' DeepseekV3 loaded (``from_pretrained``) from ``exported``; its logits.

    Raises if loading left out or did not use any tensor: the export must be a whole checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in exported.items()}, os.path.join(d, "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise AssertionError(f"from_pretrained of the export: {bad}")
    model = model.to(device).eval()
    return model(ids.to(device)).logits.float()
