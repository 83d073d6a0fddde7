"""Streaming routed experts: a layer's fused tensors cut into per-expert views or built from
per-expert pieces, in bounded batches, and the per-name transform a module-walking source plugs in.

The names and shapes come from ``expert_spec.py`` (``ExpertLayerSpec``, derived from transformers'
own reversal); this module moves the bytes. Its memory invariants are the reason it exists (verl
#6691 stacked a whole layer's experts into one tensor at once):

* ``split_fused`` turns a fused tensor into per-expert tensors as *views* (``t[e, a:b]`` of a
  contiguous ``[E, R, C]`` tensor is contiguous): zero extra bytes.
* ``FusedExpertBuffer`` builds a fused tensor from per-expert pieces by copying each piece into one
  preallocated ``[E, R, C]`` buffer as it arrives: the layer's fused tensor plus one in-flight batch
  of experts, never a ``torch.stack`` over separately materialized experts (which doubles the peak).
* ``expert_batches`` cuts a layer's experts into batches of at most ``max_bytes``, so a per-expert
  stream holds a bounded number of experts at once.
* ``ExpertTransform`` (a ``naming.TensorTransform``) feeds metadata and stream from one function,
  so they cannot drift apart; ``expert_transform_for`` decides whether a module needs one.

The spec's names are re-exported here (``ExpertLayerSpec``, ``expert_names``, ...): a caller that
streams experts imports its whole vocabulary from this one module.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..ground.errors import UnmappedParameterError
from ..ground.logs import current_rank, get_logger
from .expert_spec import (
    EXPERT_LAYOUTS,
    ExpertLayerSpec,
    ExpertLayout,
    Part,
    check_expert_layout,
    default_expert_layout,
    expert_names,
    is_fused_expert_param,
)
from .naming import TensorTransform, checkpoint_name, conversion_view, defined_by_transformers, wrapper_paths

__all__ = [
    "ExpertLayout",
    "EXPERT_LAYOUTS",
    "DEFAULT_EXPERT_BATCH_BYTES",
    "ExpertLayerSpec",
    "is_fused_expert_param",
    "expert_names",
    "check_expert_layout",
    "default_expert_layout",
    "split_fused",
    "FusedExpertBuffer",
    "expert_batches",
    "ExpertTransform",
    "expert_transform_for",
]

logger = get_logger(__name__)

#: Default bound on the bytes of routed experts a per-expert stream holds at once (per rank).
DEFAULT_EXPERT_BATCH_BYTES = 256 * 1024 * 1024


def split_fused(
    spec: ExpertLayerSpec,
    part: str,
    full: torch.Tensor,
    *,
    experts: range | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert ``(checkpoint name, view)`` of a full fused tensor, in ``spec.entries`` order.

    ``full`` is the ``part``'s fused tensor (``spec.fused_shape(part)``: ``[E, 2I, H]`` for
    ``"gate_up"``, ``[E, H, I]`` for ``"down"`` ...); when ``experts`` is given, ``full`` holds only
    those experts (``[len(experts), ...]``). Views of a contiguous tensor are contiguous, so
    nothing is copied.
    """
    rng = experts if experts is not None else range(spec.num_experts)
    want = (len(rng),) + spec.fused_shape(part)[1:]
    if tuple(full.shape) != want:
        raise ValueError(f"{spec.prefix} {part}: expected a {want} tensor, got {tuple(full.shape)}")
    if not full.is_contiguous():
        full = full.contiguous()
    # one C call per run of views (``unbind``) and names built once per layer: a 30B-A3B checkpoint
    # has 18,432 expert tensors, so per-expert Python work is the cost of a pass
    names = _expert_names(spec, part)[rng.start: rng.stop]
    if spec.saved == "fused" or part != "gate_up":
        yield from zip(names, full.unbind(0))
        return
    i = spec.intermediate
    for (gname, uname), g, u in zip(names, full[:, :i].unbind(0), full[:, i:].unbind(0)):
        yield gname, g
        yield uname, u


@functools.lru_cache(maxsize=1024)
def _expert_names(spec: ExpertLayerSpec, part: str) -> tuple[Any, ...]:
    """Per expert, its wire name (``(gate, up)`` names for a per-expert checkpoint's ``gate_up``)."""
    e = range(spec.num_experts)
    if spec.saved == "fused":
        return tuple(spec.expert_name(k, part) for k in e)
    if part == "gate_up":
        return tuple((spec.expert_name(k, "gate"), spec.expert_name(k, "up")) for k in e)
    return tuple(spec.expert_name(k, "down") for k in e)


class FusedExpertBuffer:
    """One layer's fused tensors (``spec.parts``: ``gate_up`` ``[E, 2I, H]`` and ``down``
    ``[E, H, I]``, or the spec's own layout and biases), filled expert by expert as pieces arrive.

    Invariant: exactly one preallocated tensor per part; each ``put`` copies one expert's pieces
    into its slices (``spec.fill_expert``, so the caller may free them right away), and ``take``
    returns the tensors only once every expert has been put exactly once -- a missing or
    duplicated expert raises naming it instead of shipping uninitialized memory.
    """

    def __init__(self, spec: ExpertLayerSpec, dtype: torch.dtype, device: Any = "cpu") -> None:
        self.spec = spec
        self.tensors = {p: torch.empty(spec.fused_shape(p), dtype=dtype, device=device) for p in spec.parts}
        self._seen = torch.zeros(spec.num_experts, dtype=torch.bool)

    @property
    def gate_up(self) -> torch.Tensor:
        return self.tensors["gate_up"]

    @property
    def down(self) -> torch.Tensor:
        return self.tensors["down"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def put(
        self, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Expert ``e``'s ``gate``/``up`` ``[I, H]``, ``down`` ``[H, I]`` and, for biased experts,
        ``biases`` (gate ``[I]``, up ``[I]``, down ``[H]``)."""
        s = self.spec
        if not 0 <= e < s.num_experts:
            raise IndexError(f"{s.prefix}: expert {e} out of range [0, {s.num_experts})")
        if self._seen[e]:
            raise ValueError(f"{s.prefix}: expert {e} was put twice")
        i, h = s.intermediate, s.hidden
        given = [("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))]
        if s.bias:
            if biases is None:
                raise ValueError(f"{s.prefix}: expert {e} has biases; none were given")
            given += [("gate bias", biases[0], (i,)), ("up bias", biases[1], (i,)), ("down bias", biases[2], (h,))]
        for what, t, want in given:
            if tuple(t.shape) != want:
                raise ValueError(f"{s.prefix}: expert {e} {what} has shape {tuple(t.shape)}, expected {want}")
        s.fill_expert({p: t[e] for p, t in self.tensors.items()}, gate, up, down, biases)
        self._seen[e] = True

    def take(self) -> list[tuple[str, torch.Tensor]]:
        missing = (~self._seen).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"{self.spec.prefix}: experts {missing[:8]} never arrived")
        return [(self.spec.fused_name(p), self.tensors[p]) for p in self.spec.parts]


def expert_batches(num_experts: int, bytes_per_expert: int, max_bytes: int) -> list[range]:
    """Consecutive expert ranges of at most ``max_bytes`` each (at least one expert per batch)."""
    if max_bytes <= 0:
        raise ValueError(f"expert batch bytes must be positive, got {max_bytes}")
    per = max(1, max_bytes // max(1, bytes_per_expert))
    return [range(a, min(a + per, num_experts)) for a in range(0, num_experts, per)]


class ExpertTransform:
    """The per-name tensor transform a module-walking source (FSDPSource) plugs in for fused
    transformers-5 experts: ``in-memory fused name -> wire entries``.

    Built once from the model (names from transformers' reversal, no collective). ``entries``
    gives the metadata a fused parameter expands to; ``apply`` turns the gathered full tensor into
    exactly those ``(name, tensor)`` pairs, in the same order (views, no copy, for
    ``per_expert``; the tensor itself for ``fused``). One function feeds both, so metadata and
    stream cannot drift apart. The fused experts' biases (GPT-OSS) are handled alike.

    ``expert_layout=None``: each layer in the layout its checkpoint holds (``spec.saved``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        fused: dict[str, Sequence[int]],
        *,
        expert_layout: ExpertLayout | None = None,
    ) -> None:
        self.requested: ExpertLayout | None = check_expert_layout(expert_layout)
        self.specs = expert_names(model, fused) if fused else {}
        saved = {spec.saved for spec in self.specs.values()}
        #: the layout on the wire (with ``expert_layout=None``: the checkpoint's)
        self.layout: ExpertLayout = self.requested or (saved.pop() if len(saved) == 1 else default_expert_layout())

    def layout_of(self, spec: ExpertLayerSpec) -> ExpertLayout:
        return self.requested or default_expert_layout(spec)

    @classmethod
    def for_module(cls, module: torch.nn.Module, *, expert_layout: ExpertLayout | None = None) -> "ExpertTransform":
        """The transform for every fused expert parameter of ``module`` -- plain, ``fully_shard``-ed
        (global DTensor shapes, no gather) or wrapped (``torch.compile`` / activation checkpointing:
        wrapper segments are removed the way ``FSDPSource`` names tensors). Pass it to
        ``FSDPSource(module, transforms=[...])``."""
        wrappers = wrapper_paths(module)
        fused = {}
        for path, p in module.named_parameters():
            name = checkpoint_name(path, wrappers)
            if is_fused_expert_param(name, p.shape):
                fused[name] = tuple(p.shape)
        # transformers' reversal as save_pretrained of the unwrapped model runs it: a sharded
        # model's FSDP<cls> classes would otherwise be skipped as custom code (Qwen3-Omni's thinker).
        return cls(conversion_view(module), fused, expert_layout=expert_layout)

    def handles(self, name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        spec = self.specs.get(module)
        return spec is not None and spec.part_of(leaf) is not None

    def _spec_part(self, name: str) -> tuple[ExpertLayerSpec, Part]:
        module, _, leaf = name.rpartition(".")
        spec = self.specs.get(module)
        part = None if spec is None else spec.part_of(leaf)
        if part is None:
            raise UnmappedParameterError(f"{name!r} is not a fused expert parameter of this model")
        return spec, part

    def entries(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        spec, part = self._spec_part(name)
        return spec.entries(self.layout_of(spec), part)

    def apply(self, name: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        spec, part = self._spec_part(name)
        if self.layout_of(spec) == "fused":
            want = spec.fused_shape(part)
            if tuple(full.shape) != want:
                raise ValueError(f"{name}: expected {want}, got {tuple(full.shape)}")
            yield spec.fused_name(part), full.contiguous()
            return
        yield from split_fused(spec, part, full)

    def pieces(self, name: str, local: torch.Tensor, start: int) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
        """``(checkpoint name, offsets, tensor)`` boxes of experts ``start .. start + len(local) - 1``
        (``local``: a dim-0 slice of the fused tensor, e.g. an FSDP shard): the slice itself at
        ``(start, 0, ...)`` of the fused tensor, or each expert's whole per-expert tensors -- the
        same bytes ``apply`` yields for those experts (``core/layouts/pieces.py``: what delta sync diffs
        where the shard lives)."""
        spec, part = self._spec_part(name)
        if self.layout_of(spec) == "fused":
            yield spec.fused_name(part), (start,) + (0,) * (local.dim() - 1), local
            return
        for out, t in split_fused(spec, part, local, experts=range(start, start + local.shape[0])):
            yield out, (0,) * t.dim(), t


def expert_transform_for(
    module: nn.Module,
    expert_layout: str | None,
    transforms: Sequence[TensorTransform],
    *,
    rank: int | None,
    who: str,
) -> TensorTransform | None:
    """The ``ExpertTransform`` for ``module``'s fused experts, or None when there is nothing to do.

    Invariant: an explicit ``expert_layout`` always builds one (its validation and errors are the
    user's to see); the default (None) builds one only for fused expert parameters no
    ``transforms`` entry handles, so a dense model or a caller's own hook is untouched. Built from
    names and global shapes only (no collective), so every rank decides the same way. By default,
    experts of a transformers-defined module it cannot map take the generic conversion path
    (``core/hf/conversions.py``: exactly what ``save_pretrained`` writes); other experts it cannot map
    raise here (``who``, e.g. ``"FSDPSource"``, names the caller), on every rank, before bytes move.
    """
    check_expert_layout(expert_layout)
    if expert_layout is None:
        wrappers = wrapper_paths(module)
        fused = []
        for path, p in module.named_parameters():
            name = checkpoint_name(path, wrappers)
            if is_fused_expert_param(name, p.shape) and not any(t.handles(name) for t in transforms):
                fused.append(name)
        if not fused:
            return None
    try:
        transform = ExpertTransform.for_module(module, expert_layout=expert_layout)
        if expert_layout is None:
            logger.info(
                "%d fused expert parameter(s) (e.g. %s): exporting them %s, the target checkpoint's layout",
                len(fused), fused[0], transform.layout,
            )
        return transform
    except (UnmappedParameterError, ValueError) as e:
        if expert_layout is None and defined_by_transformers(module, fused):
            # transformers' own experts in a layout ExpertTransform does not stream (Llama 4's
            # [E, H, 2I], Step3.7's stacked projections): the generic conversion path sends exactly
            # what save_pretrained writes (core/hf/conversions.py).
            logger.info("fused experts (e.g. %s) go out as save_pretrained writes them: %s", fused[0], e)
            return None
        if not isinstance(e, UnmappedParameterError):
            raise
        r = current_rank() if rank is None else rank
        raise UnmappedParameterError(
            f"rank {r}: {who}(expert_layout={expert_layout!r}): cannot map the fused expert "
            f"parameters of {type(module).__name__} to checkpoint names: {e}"
        ) from e
