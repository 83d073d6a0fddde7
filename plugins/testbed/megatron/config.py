"""The megatron-core ``TransformerConfig`` a trainer would use for a transformers config.

Invariant: the config comes from the model family's own table (``Family.megatron_fields``: the one
``MegatronSource`` checks a live model against), plus the parallel sizes, the dtype and this
builder's CPU choices -- so a model built from it has the parameters a trainer of that config holds.
The CPU choices change how a model runs, never which parameters it has:

* MoE layers use the ``allgather`` token dispatcher: the others allocate CUDA buffers at
  construction. The dispatcher decides how tokens move in forward, not which parameters exist.
* MLA and gated-delta-net hybrids build from the local spec (``transformer_impl="local"``): no
  Transformer Engine here; MLA also turns off fused rope, which megatron refuses for
  ``rope_type="rope"``.
* MoE layers with biases run at ``expert_tensor_parallel_size`` 1 (``expert_tp_size``), the only
  size megatron-core supports MoE biases at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from weightsync.sources.toolkit import family_for, model_types

__all__ = [
    "MegatronParallel", "SUPPORTED_MODEL_TYPES", "VOCAB_DIVISIBLE_BY", "family_of", "expert_tp_size",
    "megatron_config",
]

#: every ``model_type`` of ``weightsync.sources.families`` (one declarative module per family).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = model_types()

#: megatron's default ``make_vocab_size_divisible_by``: vocabulary rows are padded to a multiple
#: of this times TP (``MegatronSource`` trims them back to ``vocab_size``).
VOCAB_DIVISIBLE_BY = 128


class MegatronParallel:
    """Sizes of the parallel layout (``vpp=None``: no virtual pipeline)."""

    def __init__(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1) -> None:
        self.tp, self.pp, self.vpp, self.ep = tp, pp, vpp, ep

    def __repr__(self) -> str:
        return f"tp{self.tp} pp{self.pp} vpp{self.vpp or 1} ep{self.ep}"


def family_of(hf: Any) -> Any:
    """The family table of ``hf`` (``weightsync.sources.families``), or ``ValueError``."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={mt!r}: no CPU Megatron builder for it (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return family_for(hf, check=False)


def megatron_config(
    hf: Any, par: MegatronParallel, dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None
) -> Any:
    """The megatron-core ``TransformerConfig`` a trainer would use for transformers config ``hf``:
    its family's table (``Family.megatron_fields``, the one ``MegatronSource`` checks a model
    against) plus the parallel sizes, ``dtype`` and this builder's CPU choices. ``overrides``: fields
    to set differently (oracle knobs, or a variant that must be refused)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    family = family_of(hf)
    fields = _fields(hf)
    if isinstance(fields.get("activation_func"), str):
        fields["activation_func"] = _activation(fields["activation_func"])
    build: dict[str, Any] = {}
    if fields.get("num_moe_experts"):
        build.update(
            moe_token_dispatcher_type="allgather",  # the others allocate CUDA buffers at construction
            moe_grouped_gemm=False,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=expert_tp_size(hf, par),
        )
    mla = family.attention == "mla"
    if mla:  # no TE here; megatron refuses fused rope for rope_type="rope"
        build.update(transformer_impl="local", apply_rope_fusion=False)
    if fields.get("experimental_attention_variant") == "gated_delta_net":
        build.update(transformer_impl="local")
    base = dict(
        activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        sequence_parallel=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    cls = MLATransformerConfig if mla else TransformerConfig
    every = {**base, **fields, **build, **(overrides or {})}
    # GPTModel reads its YaRN settings as plain config attributes (``yarn_*``), not dataclass fields
    known = {f.name for f in dataclasses.fields(cls)}
    extra = {k: every.pop(k) for k in list(every) if k.startswith("yarn_") and k not in known}
    config = cls(**every)
    for k, v in extra.items():
        setattr(config, k, v)
    return config


def _fields(hf: Any) -> dict[str, Any]:
    """The family table's ``TransformerConfig`` values for ``hf`` (``ValueError`` if unbuildable)."""
    family = family_of(hf)
    why = family.unbuildable(hf)
    if why:
        raise ValueError(why)
    return {k: f.value for k, f in family.megatron_fields(hf).items()}


def expert_tp_size(hf: Any, par: MegatronParallel) -> int:
    """The expert tensor-parallel size: the TP size, but 1 for MoE layers with biases
    (``add_bias_linear``: megatron-core supports MoE biases at expert_tensor_parallel_size=1 only)."""
    fields = _fields(hf)
    return 1 if fields.get("num_moe_experts") and fields.get("add_bias_linear") else par.tp


def _activation(name: str) -> Callable[..., Any]:
    """The activation function a family table names (tables import neither torch nor megatron)."""
    if name == "silu":
        return torch.nn.functional.silu
    if name == "quick_gelu":  # x * sigmoid(1.702 x): GPT-OSS's gate activation
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    raise ValueError(f"no activation function {name!r} in the builder (silu, quick_gelu)")
