"""Tiny DeepSeek-V3 models (multi-head latent attention + MoE) on both sides, for the MLA tests here
and the GPU evidence: transformers configs, megatron-core models built from them, and the two
forwards the logits oracle compares (helpers, no tests).

* ``hf_config(variant, **over)``: a ``DeepseekV3Config``; ``"q_lora"`` is the ``tiny-deepseek-v3``
  preset (MLA with q_lora_rank, layer 0 dense, then MoE with a shared expert, sigmoid
  group-limited routing, ``e_score_correction_bias``), ``"no_q_lora"`` the same with one
  ``q_proj``. Every size differs, so a transposed or swapped tensor fails its shape check.
* ``unsupported(variant)``: why this megatron-core cannot build the variant (0.17+ without
  q_lora_rank), else None -- report it as a skip.
* ``build_megatron(hf, par)``: this rank's GPTModel chunks via ``weightsync.plugins.testbed.megatron``
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

from weightsync.plugins.testbed.presets import PRESETS

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


# ---- Transformer-Engine spec names without TE (construction-only test doubles) ---------------------


class DuplicatedLinear(torch.nn.Module):
    """Stand-in for megatron's ``TELinear(parallel_mode="duplicated")`` (the TE spec's MLA down
    projections): the whole ``[out, in]`` weight on every TP rank, ``parallel_mode`` None as TE
    stores it, and megatron's duplicated ``sharded_state_dict`` (replicated over TP)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool = False,
                 parallel_mode: str | None = None, **_: Any) -> None:
        super().__init__()
        assert parallel_mode == "duplicated" and not bias, (parallel_mode, bias)
        self.parallel_mode = None
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> Any:
        raise NotImplementedError("test double: names and TP layout only")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, None, sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def _norm_linear_class() -> type:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """Stand-in for ``TELayerNormColumnParallelLinear``: megatron's column-parallel weight plus
        the fused norm's ``layer_norm_weight`` (replicated; not in the TP axis map, as in TE)."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))

        def forward(self, x: torch.Tensor) -> Any:
            raise NotImplementedError("test double: names and TP layout only")

    return LayerNormColumnParallelLinear


def te_like_spec(spec: Any) -> Any:
    """``spec``'s MLA with the TE spec's module layout (megatron-core 0.16 ``gpt_layer_specs``):
    duplicated down projections, the latent norms fused into the up projections. Build inside
    ``te_like_build()``, which lets megatron's MLA recognise the duplicated linear as ``TELinear``."""
    from megatron.core.transformer.identity_op import IdentityOp

    norm_linear = _norm_linear_class()
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = layer.submodules.self_attention.submodules
        sub.linear_q_down_proj = sub.linear_kv_down_proj = DuplicatedLinear
        sub.linear_q_up_proj = sub.linear_kv_up_proj = norm_linear
        sub.q_layernorm = sub.kv_layernorm = IdentityOp
    return spec


@contextlib.contextmanager
def te_like_build() -> Iterator[None]:
    """megatron's MLA passes ``parallel_mode="duplicated"`` to a down projection that *is*
    ``TELinear``; during the build, ``DuplicatedLinear`` is that class."""
    import megatron.core.transformer.multi_latent_attention as mla

    saved = mla.TELinear
    mla.TELinear = DuplicatedLinear
    try:
        yield
    finally:
        mla.TELinear = saved


def te_like_unsupported() -> str | None:
    """megatron-core 0.17+ only fuses latent norms into TE's own class (QKNormConfigResolver)."""
    import importlib.util

    if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config"):
        return "megatron-core >= 0.17 accepts fused latent norms only from Transformer Engine itself"
    return None


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

    from weightsync.plugins.testbed.megatron import build_megatron_gpt

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
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in exported.items()}
        save_file(tensors, os.path.join(d, "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise AssertionError(f"from_pretrained of the export: {bad}")
    model = model.to(device).eval()
    return model(ids.to(device)).logits.float()
