"""transformers' save-time weight conversions, applied while streaming.

transformers 5 holds some tensors in memory in another layout than its checkpoints: a conversion
mapping (``transformers.conversion_mapping``) that ``from_pretrained`` applies and ``save_pretrained``
reverts (``transformers.core_model_loading.revert_weight_conversion``): renames, prefix changes,
splits and concatenations (``Chunk`` / ``Concatenate``), per-expert <-> stacked
(``SplitModulelist`` / ``MergeModulelist``), transposes, interleaves, rotary permutations. A source
that sends the in-memory names sends what vLLM would misload, so this module reverts them -- with
transformers' own code, never a table of its own.

Invariants:

* **Same conversions as ``save_pretrained``** (``saved_conversions``): the model's
  ``_weight_conversions`` when ``from_pretrained`` built it, else the default mapping without
  ``PrefixChange`` (``revert_weight_conversion``'s own choice), looked up on the *unwrapped* class
  tree (``fully_shard`` renames classes to ``FSDP<cls>``, which transformers skips as custom code),
  for the root and every sub-model whatever ``model_type`` a sub-config carries.
* **Same grouping** (``plan_conversions``): names are renamed and grouped exactly as
  ``revert_weight_conversion`` does (natural key order, ``rename_source_key(reverse=True)``, one
  converter instance per target key), so a group is the set of in-memory tensors one reversed
  ``WeightConverter`` consumes together.
* **Metadata without data**: each group's converter runs once on meta tensors of the global
  shapes; its outputs are the checkpoint names and shapes. No collective, identical on every rank.
* **Streaming**: at stream time the same converter runs on the gathered full tensors. A group of
  one tensor (a split: ``Chunk``, ``SplitModulelist``) converts as soon as it arrives (``Chunk``
  along dim 0 and ``SplitModulelist`` yield views); a group of several (a concatenation, a stack,
  a fused q/k/v with rope permutation) holds its members until the last one (in stream order)
  arrives, then converts and releases them: the source holds at most one group's inputs plus its
  outputs, never a model-size buffer.
* **Refusal, never a silent difference**: a conversion transformers cannot reverse (quantized
  transforms) or whose reversal fails on the global shapes raises ``UnmappedParameterError`` at
  metadata time, on every rank (same names and shapes everywhere), naming the operations and the
  tensors, before any bytes move.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..ground.errors import UnmappedParameterError
from ..ground.logs import get_logger

__all__ = [
    "ConversionTransform",
    "ConversionView",
    "saved_conversions",
    "plan_conversions",
]

logger = get_logger(__name__)


def saved_conversions(root: nn.Module, lookup_tree: nn.Module | None = None) -> list[Any]:
    """The ``WeightTransform`` list ``save_pretrained`` of ``root`` reverts (load order).

    ``root._weight_conversions`` when ``from_pretrained`` set it (the transforms used at load, with
    their scopes); otherwise ``get_model_conversion_mapping`` of ``lookup_tree`` (``root`` before
    wrapping: ``naming._unwrapped_tree``) without legacy renames and ``PrefixChange`` -- the choice
    ``revert_weight_conversion`` makes for a model not built by ``from_pretrained``.
    """
    conversions = getattr(root, "_weight_conversions", None)
    if conversions is not None:
        return list(conversions)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    found = get_model_conversion_mapping(root if lookup_tree is None else lookup_tree, add_legacy=False)
    return [c for c in found if not isinstance(c, PrefixChange)]


class ConversionView:
    """``root`` as transformers' conversion code should see it: ``_weight_conversions`` fixed to
    ``saved_conversions`` (so ``revert_weight_conversion(view, ...)`` reverts what
    ``save_pretrained`` of the unwrapped model reverts), ``get_parameter`` answering global shapes
    by de-wrapped name (ops such as ``Transpose(check_dims=True)`` compare against the parameter;
    a sharded or wrapped model has other names and local shapes). Everything else is ``root``'s."""

    def __init__(self, root: nn.Module, conversions: Sequence[Any], shapes: dict[str, tuple[int, ...]]) -> None:
        self._root = root
        self._weight_conversions = list(conversions)
        self._shapes = dict(shapes)
        self.config = getattr(root, "config", None)

    def get_parameter(self, target: str) -> torch.Tensor:
        shape = self._shapes.get(target)
        if shape is None:
            return self._root.get_parameter(target)
        return torch.empty(shape, device="meta")

    def __getattr__(self, name: str) -> Any:
        if name == "_root":  # not set yet (copy / unpickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._root, name)


@dataclass
class _Group:
    """One reversed ``WeightConverter`` instance and the in-memory tensors it consumes."""

    key: str  # transformers' conversion key (the first checkpoint name the converter yields)
    converter: Any
    members: list[tuple[str, str]]  # (in-memory name, matched source pattern), transformers' add order
    first: str = ""  # first / last member in stream order
    last: str = ""
    outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def describe(self) -> str:
        ops = ", ".join(type(op).__name__ for op in getattr(self.converter, "operations", ()))
        return f"[{ops}] of {[n for n, _ in self.members][:4]}{' ...' if len(self.members) > 4 else ''}"


class ConversionTransform:
    """A ``TensorTransform`` that reverts transformers' conversions of the tensors it handles.

    ``entries(name)`` is empty for every member of a group but its last one in stream order, whose
    entries are the group's checkpoint tensors (so metadata lists each output once, where the stream
    yields it); ``apply`` holds earlier members (full wire-dtype tensors) and converts on the last.
    Outputs travel in the wire dtype of the last member (a concatenation of tensors of different
    wire dtypes is cast to it). Implements no ``pieces``: delta passes gather these entries whole.
    """

    def __init__(self, groups: list[_Group], model: Any, config: Any) -> None:
        self._groups = {g.key: g for g in groups}
        self._member = {name: g.key for g in groups for name, _ in g.members}
        self._model = model
        self._config = config
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"ConversionTransform({len(self._groups)} groups, {len(self._member)} tensors)"

    @property
    def groups(self) -> list[_Group]:
        return list(self._groups.values())

    def handles(self, name: str) -> bool:
        return name in self._member

    def entries(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        g = self._groups[self._member[name]]
        return list(g.outputs) if name == g.last else []

    def held_bytes(self) -> int:
        """Bytes of member tensors held for groups not complete yet (0 between groups)."""
        return sum(t.numel() * t.element_size() for h in self._held.values() for t in h.values())

    def apply(self, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        g = self._groups[self._member[name]]
        if len(g.members) == 1:
            yield from self._convert(g, {name: full}, full.dtype)
            return
        if name == g.first:
            self._held[g.key] = {}  # a new pass (an earlier one may have stopped mid-group)
        held = self._held.setdefault(g.key, {})
        held[name] = full
        if name != g.last:
            return
        tensors = self._held.pop(g.key)
        missing = [n for n, _ in g.members if n not in tensors]
        if missing:
            raise UnmappedParameterError(
                f"conversion {g.describe()}: members {missing[:4]} did not arrive before {name!r}"
            )
        yield from self._convert(g, tensors, full.dtype)

    def _convert(self, g: _Group, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        out = _run(g, tensors, self._model, self._config)
        got = [(n, tuple(t.shape)) for n, t in out]
        if got != g.outputs:
            raise UnmappedParameterError(
                f"conversion {g.describe()} yielded {got[:4]}, metadata declared {g.outputs[:4]}"
            )
        for n, t in out:
            yield n, t.to(dtype).contiguous()


def _run(g: _Group, tensors: dict[str, torch.Tensor], model: Any, config: Any) -> list[tuple[str, torch.Tensor]]:
    """``g``'s converter applied to ``tensors`` (by in-memory name), as ``revert_weight_conversion``
    applies it: members added in transformers' order, ``convert(key, model=, config=)``."""
    conv = g.converter
    for name, pattern in g.members:
        conv.add_tensor(g.key, name, pattern, tensors[name])
    try:
        realized = conv.convert(g.key, model=model, config=config)
    finally:
        conv.collected_tensors.clear()
    return [(n, t[0] if isinstance(t, list) else t) for n, t in realized.items()]


def plan_conversions(
    conversions: Sequence[Any],
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    order: Iterable[str],
    model: Any,
    *,
    rank: int,
) -> tuple[dict[str, str], ConversionTransform | None]:
    """What ``save_pretrained`` does to each of ``tensors`` (de-wrapped in-memory name -> (global
    shape, dtype)): ``(renames, transform)``.

    ``renames``: names a reversed ``WeightRenaming`` / ``PrefixChange`` only renames (same tensor).
    ``transform``: the ``ConversionTransform`` for names a reversed ``WeightConverter`` consumes (None
    if there are none). ``order`` is the stream order of the names (which member of a group comes
    last). ``model`` is what converters get as ``model=`` (a ``ConversionView``).
    Raises ``UnmappedParameterError`` (module docstring) for what cannot be reverted while streaming.
    """
    if not conversions:
        return {}, None
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    try:
        reverse = [c.reverse_transform() for c in list(conversions)[::-1]]
    except Exception as err:  # quantized / TP transforms: transformers itself cannot reverse them
        raise UnmappedParameterError(
            f"rank {rank}: transformers cannot reverse this model's weight conversions ({err}); "
            "save_pretrained could not write its checkpoint either"
        ) from err
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    renames: dict[str, str] = {}
    groups: dict[str, _Group] = {}
    for name in sorted(tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(name, renamings, converters, reverse=True)
        if pattern is None:
            if renamed != name:
                renames[name] = renamed
            continue
        g = groups.get(renamed)
        if g is None:
            g = groups[renamed] = _Group(renamed, copy.deepcopy(by_pattern[pattern]), [])
        g.members.append((name, pattern))
    if not groups:
        return renames, None

    position = {n: i for i, n in enumerate(order)}
    config = getattr(model, "config", None)
    bad: list[str] = []
    for g in groups.values():
        ranked = sorted((position.get(n, -1), n) for n, _ in g.members)
        g.first, g.last = ranked[0][1], ranked[-1][1]
        metas = {n: torch.empty(tensors[n][0], dtype=tensors[n][1], device="meta") for n, _ in g.members}
        try:
            g.outputs = [(n, tuple(t.shape)) for n, t in _run(g, metas, model, config)]
            if not g.outputs:
                raise ValueError("it yields no tensor")
        except Exception as err:  # noqa: BLE001 - any failure is a refusal naming the conversion
            bad.append(f"{g.describe()}: {type(err).__name__}: {err}")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UnmappedParameterError(
            f"rank {rank}: {len(bad)} of transformers' save-time conversion(s) cannot be reverted on the "
            f"global shapes: {'; '.join(bad[:3])}{more}. Sending the in-memory tensors would not load in vLLM."
        )
    n = sum(len(g.members) for g in groups.values())
    logger.debug("transformers' conversions: %d renamed tensor(s), %d converted in %d group(s)",
                 len(renames), n, len(groups))
    return renames, ConversionTransform(list(groups.values()), model, config)
