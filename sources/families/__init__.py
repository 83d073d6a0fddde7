"""Model families: one module per family, found by name.

A family module (``llama.py``, ``qwen3_moe.py``, ``deepseek_v3.py``...) is named after transformers'
``model_type`` and defines ``FAMILY``, a ``base.Family`` holding side by side everything weightsync
knows about that family:

* its checkpoint's tensor table -- which Megatron-core ``GPTModel`` parameter becomes which Hugging
  Face tensor(s), with which TP layout kind (the shared decoder table in ``base`` plus the family's
  flags: q/k/v bias, q/k norm..., or its own attention table, e.g. DeepSeek-V3's latent attention);
* ``megatron_fields(hf_config)`` / ``gpt_model_fields(hf_config)``: the ``TransformerConfig``
  fields and ``GPTModel`` arguments of a Megatron model of that config. The one builder
  (``weightsync.plugins.testbed.megatron``) builds from them and ``MegatronSource`` checks a live
  model against the same table;
* its MoE roles (router, router bias, shared expert, shared-expert gate), for ``sources/megatron/moe_names.py``;
* what it refuses, and why: configs no Megatron model expresses (``unsupported``), configs the
  builder cannot build (``unbuildable``).

The registry is lazy, in the style of vLLM's ``WeightTransferEngineFactory``: ``model_types()``
lists the modules without importing them (the CLI checks ``--layout megatron`` before any heavy
import); a module is imported the first time its family is asked for. Family modules import neither
torch nor transformers. ``register(family)`` adds one from outside this package.

Adding a family: one module here defining ``FAMILY`` (plus a preset and tests); nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from ..core.ground.errors import UnmappedParameterError
from .base import GLOBAL, HF_LAYER_PREFIX, Entry, Family, MoERoles, canonical_suffix, rope_theta

__all__ = [
    "Entry", "Family", "MoERoles", "family_for", "get", "megatron_to_hf", "model_types", "register", "rope_theta",
]

_REGISTERED: dict[str, Family] = {}


def model_types() -> tuple[str, ...]:
    """Every family's ``model_type``, sorted: this package's modules (not imported) and registered ones."""
    here = {m.name for m in pkgutil.iter_modules(__path__) if m.name != "base" and not m.name.startswith("_")}
    return tuple(sorted(here | set(_REGISTERED)))


def get(model_type: str) -> Family:
    """The family of ``model_type`` (imports its module once); ``KeyError`` if there is none."""
    if model_type not in _REGISTERED:
        if model_type not in model_types():
            raise KeyError(model_type)
        _REGISTERED[model_type] = importlib.import_module(f"{__name__}.{model_type}").FAMILY
    return _REGISTERED[model_type]


def register(family: Family) -> None:
    """Add (or replace) a family defined outside this package."""
    _REGISTERED[family.name] = family


def family_for(hf_config: Any, *, check: bool = True) -> Family:
    """The family serving ``hf_config.architectures`` (or else its ``model_type``); raises
    ``UnmappedParameterError`` if none does, or (``check``) if the family cannot export this config,
    naming the fields."""
    archs = tuple(getattr(hf_config, "architectures", None) or ())
    model_type = getattr(hf_config, "model_type", None)
    every = [get(t) for t in model_types()]
    found = next((f for f in every if any(a in f.architectures for a in archs)), None)
    found = found or next((f for f in every if model_type == f.name), None)
    if found is None:
        known = sorted(a for f in every for a in f.architectures)
        raise UnmappedParameterError(
            f"MegatronSource has no name table for architectures={list(archs)} "
            f"(model_type={model_type!r}); known: {known}"
        )
    if check:
        found.check_supported(hf_config)
    return found


def megatron_to_hf(
    name: str, *, hf_config: Any, layer_of: Callable[[int], int] = lambda j: j
) -> tuple[str, ...]:
    """HF checkpoint name(s) of one Megatron ``GPTModel`` parameter name (names only, no tensors).

    ``layer_of`` maps the module's local layer index to the global (0-based) layer number.
    Raises ``UnmappedParameterError`` for a name the family's checkpoint does not carry.
    """
    fam = family_for(hf_config)
    if name in GLOBAL:
        return GLOBAL[name][1].hf
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "decoder" and parts[1] == "layers" and parts[2].isdigit():
        suffix = canonical_suffix(".".join(parts[3:]))
        entry = fam.layer_keys(hf_config, layer=layer_of(int(parts[2])) if fam.hybrid else None).get(suffix)
        if entry is None and fam.layer_table is not None:  # e.g. MLA's fused down projection
            try:
                entry = fam.layer_keys(hf_config, fused_down=True).get(suffix)
            except UnmappedParameterError:
                entry = None
        if entry is not None:
            prefix = HF_LAYER_PREFIX.format(layer_of(int(parts[2])))
            return tuple(prefix + h for h in entry.hf)
    raise UnmappedParameterError(
        f"Megatron parameter {name!r} has no Hugging Face name in the {fam.name} table for this "
        "hf_config"
    )
