"""Hugging Face checkpoint names of one MoE layer, for sources that do not hold a transformers model.

Invariant: the only hand-written facts used here are *which transformers in-memory module* plays
each MoE role (router, router bias, router linear bias, shared expert, shared-expert gate: the
family's ``MoERoles``,
``sources/families/``); every
checkpoint name and shape is then read off a meta-device transformers model built from the same
``hf_config`` and passed through transformers' own save-time reversal
(``revert_weight_conversion``, via ``experts.expert_names``), so renamings such as Mixtral's
``mlp`` -> ``block_sparse_moe`` and ``w1/w3/w2`` come from transformers, not from this file. A role
the family declares but the built model lacks (or the reverse) raises naming the layer.

Nothing here allocates real tensors or communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .. import families
from ..core.ground.errors import UnmappedParameterError
from ..core.hf.experts import ExpertLayerSpec, expert_names, is_fused_expert_param

__all__ = ["HFMoELayer", "HFMoENames"]


@dataclass(frozen=True)
class HFMoELayer:
    """Checkpoint names and full shapes of one MoE layer's non-attention tensors."""

    layer: int
    router: tuple[str, tuple[int, ...]]
    router_bias: tuple[str, tuple[int, ...]] | None  # score-correction bias (Megatron expert_bias)
    router_linear_bias: tuple[str, tuple[int, ...]] | None  # the router linear's bias (Megatron router.bias)
    experts: ExpertLayerSpec
    shared: tuple[tuple[str, tuple[int, ...]], ...] | None  # (gate, up, down)
    shared_gate: tuple[str, tuple[int, ...]] | None


class HFMoENames:
    """Per-layer ``HFMoELayer`` for an ``hf_config``, read from a meta-device model (built once)."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        model_type = getattr(hf_config, "model_type", None)
        try:
            roles = families.get(str(model_type)).moe
        except KeyError:
            roles = None
        if roles is None:
            known = [t for t in families.model_types() if families.get(t).moe is not None]
            raise UnmappedParameterError(f"no MoE role table for model_type={model_type!r}; known: {known}")
        self.roles = roles
        self._saved: dict[str, str | None] = {}

    @cached_property
    def _model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config)

    @cached_property
    def _tensors(self) -> dict[str, tuple[int, ...]]:
        m = self._model
        return {n: tuple(t.shape) for n, t in [*m.named_parameters(), *m.named_buffers()]}

    def _saved_name(self, name: str) -> str | None:
        """Checkpoint name of one non-expert in-memory tensor, by transformers' reversal (cached)."""
        if name not in self._saved:
            from transformers.core_model_loading import revert_weight_conversion

            got = revert_weight_conversion(self._model, {name: torch.empty(self._tensors[name], device="meta")})
            self._saved[name] = next(iter(got)) if len(got) == 1 else None
        return self._saved[name]

    @cached_property
    def _specs(self) -> dict[str, ExpertLayerSpec]:
        fused = {n: s for n, s in self._tensors.items() if is_fused_expert_param(n, s)}
        return expert_names(self._model, fused)

    def moe_layers(self) -> list[int]:
        return sorted(int(k.split(".")[2]) for k in self._specs)

    def layer(self, layer: int) -> HFMoELayer:
        pre = f"model.layers.{layer}."
        spec = self._specs.get(f"{pre}mlp.experts")
        if spec is None:
            raise UnmappedParameterError(
                f"layer {layer}: the transformers model built from hf_config has no routed experts "
                f"there (MoE layers: {self.moe_layers()}); Megatron's moe_layer_freq / first-k-dense "
                "settings disagree with hf_config"
            )

        def one(rel: str | None, role: str) -> tuple[str, tuple[int, ...]] | None:
            if rel is None:
                return None
            name = pre + rel
            if name not in self._tensors:
                raise UnmappedParameterError(f"layer {layer}: transformers model has no {role} {name!r}")
            saved = self._saved_name(name)
            if saved is None:
                raise UnmappedParameterError(f"layer {layer}: {name!r} ({role}) is not saved by save_pretrained")
            return saved, self._tensors[name]

        shared = None
        if self.roles.shared is not None:
            shared = tuple(
                one(f"{self.roles.shared}.{p}.weight", "shared expert")  # type: ignore[misc]
                for p in ("gate_proj", "up_proj", "down_proj")
            )
        return HFMoELayer(
            layer=layer,
            router=one(self.roles.router, "router"),  # type: ignore[arg-type]
            router_bias=one(self.roles.router_bias, "router bias"),
            router_linear_bias=one(self.roles.router_linear_bias, "router linear bias"),
            experts=spec,
            shared=shared,
            shared_gate=one(self.roles.shared_gate, "shared-expert gate"),
        )
