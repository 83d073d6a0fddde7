"""Walking this rank's Megatron modules: which local parameter is which plan key.

Invariant: every parameter of every local model chunk is either bound to exactly one plan key
(``("embed",)``, ``("norm",)``, ``("lm_head",)``, ``("layer", global_layer, local_spec_suffix)``) or
reported as unmapped -- nothing is dropped silently. The global layer is read from the layer
module's own 1-based ``layer_number`` (Megatron already applied the PP/VPP offset), not recomputed.
TE fused-norm names bind to the same key as their local-spec names.

Multi-token prediction (``GPTModel(mtp_block_spec=...)``, megatron-core's ``MultiTokenPredictionBlock``
at ``mtp.layers.{j}``): the decoder layer inside MTP layer ``i`` (``transformer_layer``) binds like a
decoder layer, under its own ``layer_number`` (megatron numbers it ``num_layers + i + 1``); the MTP
layer's own tensors bind to ``("mtp", i, suffix)`` (``enorm.weight``, ``hnorm.weight``,
``eh_proj.weight``, ``final_layernorm.weight``), ``i`` from the MTP layer's ``layer_number``. The
embedding copy a last pipeline stage holds for MTP binds to ``("embed",)`` like the first stage's;
``part_params`` decides which part (the policy, the MTP draft) each key belongs to.

Each bound parameter also carries the dim along which Megatron's own module splits it over TP
(``tp_split_dim``): megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` tag their
weights ``tensor_model_parallel`` + ``partition_dim`` (what ``sharded_state_dict`` shards by);
Transformer-Engine linears declare ``parallel_mode`` (``"column"`` / ``"row"``, or ``None`` for
megatron's ``"duplicated"`` ``TELinear``, which every TP rank holds whole). Layouts that differ
between specs -- MLA's down projections -- are read from here instead of being assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..families.base import GLOBAL, canonical_suffix
from .plan import Unit

__all__ = ["Bound", "model_chunks", "part_params", "tp_split_dim", "walk_chunks"]

_ABSENT = object()


@dataclass(frozen=True)
class Bound:
    """A local parameter bound to a plan key."""

    param: torch.Tensor
    name: str  # Megatron name inside its chunk, for messages
    chunk: int
    tp_dim: int | None = None  # dim TP ranks hold different pieces of (None: every rank holds it whole)


def tp_split_dim(module: torch.nn.Module, attr: str, param: torch.Tensor) -> int | None:
    """The dim along which ``module.<attr>`` is split over TP ranks, as Megatron's module declares it.

    TE modules: ``parallel_mode`` ("column" -> 0, "row" -> 1 for matrices; ``None`` = duplicated);
    their fused ``layer_norm_*`` and a row-parallel bias are replicated. Megatron-core's own layers:
    the ``tensor_model_parallel`` / ``partition_dim`` attributes they set on their parameters --
    except core attention's ``softmax_offset`` (per query head, dim 0), which has none.
    """
    if attr.startswith("layer_norm_"):
        return None
    if attr == "softmax_offset":
        # core attention's learnable softmax offset (attention sinks): one per local query head;
        # megatron's sharded_state_dict splits it on dim 0 over TP, the parameter carries no tags
        return 0 if param.dim() == 1 else None
    mode = getattr(module, "parallel_mode", _ABSENT)
    if mode is not _ABSENT and not isinstance(mode, str | type(None)):
        mode = _ABSENT  # not TE's attribute (e.g. a mock): fall back to the parameter's tags
    if mode is not _ABSENT:
        if mode == "column":
            return 0
        if mode == "row" and param.dim() > 1:
            return 1
        return None
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


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
        for name, param, tp_dim in _parameters(chunk):
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
                elif len(parts) > 3 and parts[:2] == ["mtp", "layers"] and parts[2].isdigit():
                    mtp_layer = chunk.mtp.layers[int(parts[2])]
                    suffix = ".".join(parts[3:])
                    if parts[3] == "transformer_layer" and len(parts) > 4:
                        layer = int(mtp_layer.transformer_layer.layer_number) - 1
                        suffix = ".".join(parts[4:])
                        layer_names.setdefault(layer, []).append(suffix)
                        key = ("layer", layer, canonical_suffix(suffix))
                    else:
                        key = ("mtp", int(mtp_layer.layer_number) - 1, suffix)
            if key is None or key in bound:
                unmapped.append(f"chunk{v}:{name}")
                continue
            bound[key] = Bound(param, name, v, tp_dim)
    return bound, unmapped, layer_names


def _parameters(chunk: torch.nn.Module):
    """``(name, param, tp_dim)`` in ``named_parameters()`` order (shared parameters once)."""
    owner: dict[int, tuple[torch.nn.Module, str]] = {}
    for mod_name, mod in chunk.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            owner.setdefault(id(p), (mod, attr))
    for name, param in chunk.named_parameters():
        mod, attr = owner[id(param)]
        yield name, param, tp_split_dim(mod, attr, param)


def part_params(
    bound: dict[tuple, Bound], part: str, *, num_layers: int, pp_rank: int, tied: bool, plan: list[Unit]
) -> dict[tuple, Bound]:
    """The walked parameters ``part`` exports (the source then requires every one of them to be in
    the plan): ``"policy"`` drops the MTP block (``("mtp", ...)`` and decoder layers numbered past
    ``num_layers``) and, off the first stage, the embedding copy megatron keeps for MTP; ``"mtp"``
    keeps only the MTP block, plus the shared embedding / output head under the plan's copy keys
    (``("mtp_embed", i)`` / ``("mtp_head", i)``; tied: the embedding for both) on their stage."""
    def is_mtp(key: tuple) -> bool:
        return key[0] == "mtp" or (key[0] == "layer" and key[1] >= num_layers)

    if part == "policy":
        out = {k: b for k, b in bound.items() if not is_mtp(k)}
        if pp_rank != 0:
            out.pop(("embed",), None)
        return out
    out = {k: b for k, b in bound.items() if is_mtp(k)}
    embed = bound.get(("embed",))
    head = embed if tied else bound.get(("lm_head",))
    for unit in plan:
        shared = {"mtp_embed": embed, "mtp_head": head}.get(unit.key[0])
        if shared is not None and unit.stage == pp_rank:
            out[unit.key] = shared
    return out
