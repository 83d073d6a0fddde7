"""Walking this rank's Megatron modules: which local parameter is which plan key.

Invariant: every parameter of every local model chunk is either bound to exactly one plan key
(``("embed",)``, ``("norm",)``, ``("lm_head",)``, ``("layer", global_layer, local_spec_suffix)``) or
reported as unmapped -- nothing is dropped silently. The global layer is read from the layer
module's own 1-based ``layer_number`` (Megatron already applied the PP/VPP offset), not recomputed.
TE fused-norm names bind to the same key as their local-spec names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .families import GLOBAL, canonical_suffix

__all__ = ["Bound", "model_chunks", "walk_chunks"]


@dataclass(frozen=True)
class Bound:
    """A local parameter bound to a plan key."""

    param: torch.Tensor
    name: str  # Megatron name inside its chunk, for messages
    chunk: int


def _unwrap(module: Any) -> torch.nn.Module:
    # DDP / Float16Module / other wrappers keep the GPTModel at ``.module``.
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "decoder"):
        raise TypeError(
            f"MegatronSource expects a megatron-core GPTModel (or a list of virtual-pipeline chunks), "
            f"got {type(module).__name__} without a .decoder"
        )
    return module


def model_chunks(model: Any) -> list[torch.nn.Module]:
    """The GPTModel chunk(s) on this rank, wrappers removed, in virtual-pipeline order."""
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError("MegatronSource got an empty list of model chunks")
        return [_unwrap(m) for m in model]
    return [_unwrap(model)]


def walk_chunks(
    chunks: list[torch.nn.Module],
) -> tuple[dict[tuple, Bound], list[str], dict[int, list[str]]]:
    """Bind every local parameter.

    Returns ``(bound, unmapped, layer_names)``: ``bound`` maps plan keys to parameters,
    ``unmapped`` lists ``"chunk{v}:{name}"`` for parameters with no key, ``layer_names`` maps each
    local global layer to its layer-relative names (for handler error messages).
    A duplicate key (the same layer on two chunks) is reported as unmapped too.
    """
    bound: dict[tuple, Bound] = {}
    unmapped: list[str] = []
    layer_names: dict[int, list[str]] = {}
    for v, chunk in enumerate(chunks):
        layers = getattr(chunk.decoder, "layers", [])
        for name, param in chunk.named_parameters():
            key: tuple | None = None
            if name in GLOBAL:
                key = (GLOBAL[name][0],)
            else:
                parts = name.split(".")
                if len(parts) > 3 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
                    layer = int(layers[int(parts[2])].layer_number) - 1
                    suffix = ".".join(parts[3:])
                    layer_names.setdefault(layer, []).append(suffix)
                    key = ("layer", layer, canonical_suffix(suffix))
            if key is None or key in bound:
                unmapped.append(f"chunk{v}:{name}")
                continue
            bound[key] = Bound(param, name, v)
    return bound, unmapped, layer_names
