"""Hugging Face checkpoint names for the tensors of an in-memory (possibly wrapped) module.

Invariant: ``checkpoint_entries(module)`` lists exactly the tensors ``save_pretrained`` of the
unwrapped, unsharded model would write, under the names it would write them, in the module's own
``named_parameters()`` order (persistent buffers in ``state_dict`` position) -- and nothing else.
It reads module structure only: no tensor data, no collective, so every rank computes the same list.

Three things separate an in-memory name from a checkpoint name:

* **Wrappers** add path segments that the checkpoint does not have: ``_orig_mod`` (torch.compile),
  ``_checkpoint_wrapped_module`` (activation checkpointing), ``_fsdp_wrapped_module`` (FSDP1) are
  wrapper-only attribute names and are always dropped. ``module`` is also a legitimate submodule
  name, so it is dropped only where it is a wrapper: the only child of a module that holds no
  tensors of its own (DDP, DataParallel, accelerate/deepspeed engines).
* **Aliases**: a tied tensor is one object under several names; a checkpoint holds it once.
  Which name survives is what transformers decides: names matching a module's
  ``_tied_weights_keys`` are the duplicates (``remove_tied_weights_from_state_dict``), so
  ``lm_head.weight`` is written iff it is not tied to the embeddings. Without that information the
  first name in ``named_parameters()`` order wins (what ``named_parameters`` itself keeps).
* **Weight conversions**: transformers 5 stores some tensors in another in-memory layout than its
  checkpoint and ``save_pretrained`` reverts it (``revert_weight_conversion``). Pure renamings
  (Mixtral's in-memory ``mlp.`` is ``block_sparse_moe.``, VLM prefixes) just give the entry the
  name transformers writes. Everything else (splits, concatenations, per-expert <-> stacked,
  transposes, rope permutations) gets a ``conversions.ConversionTransform`` that runs
  transformers' own reversed converter on the gathered tensors -- unless a caller's
  ``TensorTransform`` (``experts.ExpertTransform``) already handles the name. The conversions are
  looked up on the unwrapped class tree (``conversion_view``), as ``save_pretrained`` of the
  unsharded model would; what cannot be reverted while streaming raises ``UnmappedParameterError``
  (``core/hf/conversions.py``).

PEFT names (``base_model.model.``, ``.base_layer.``, ``lora_A/B``, ``modules_to_save``) are mapped
by the caller: ``rename`` (``lora.LoraPlan.rename``) turns a de-wrapped path into the base
checkpoint's name or drops it, and ``root`` (the transformers model inside the tuner) is where tied
weights, conversions and ``_keys_to_ignore_on_save`` are read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..ground.errors import UnmappedParameterError
from ..ground.logs import current_rank, get_logger

__all__ = [
    "WRAPPER_SEGMENTS",
    "CheckpointEntry",
    "TensorTransform",
    "checkpoint_entries",
    "checkpoint_name",
    "conversion_view",
    "defined_by_transformers",
    "hf_root",
    "tied_weight_patterns",
    "wrapper_paths",
]

logger = get_logger(__name__)

#: Attribute names that only wrappers use; always dropped from a path.
WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)
#: Dropped only where the module at that path is a pure wrapper (see module docstring).
_MAYBE_WRAPPER = "module"


@runtime_checkable
class TensorTransform(Protocol):
    """A per-name hook that turns one gathered in-memory tensor into checkpoint tensors
    (``experts.ExpertTransform`` implements it for transformers-5 fused MoE experts).

    ``handles(name)``: whether it converts the tensor whose de-wrapped in-memory name is ``name``.
    ``entries(name)``: the ``(checkpoint name, full shape)`` pairs it turns it into, from names
    alone (no data), so metadata stays collective-free; they travel in the input's wire dtype.
    ``apply(name, full)``: runs after the gather on the full wire-dtype tensor and yields exactly
    those pairs, in order, as contiguous tensors. A transform whose outputs need several in-memory
    tensors (``conversions.ConversionTransform``: a concatenation) declares them all under the last
    of those names in stream order, and none under the others, whose ``apply`` holds the tensor.
    """

    def handles(self, name: str) -> bool: ...

    def entries(self, name: str) -> list[tuple[str, tuple[int, ...]]]: ...

    def apply(self, name: str, full: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class CheckpointEntry:
    """One tensor of the module as a checkpoint would hold it.

    ``name``: the checkpoint name. ``path``: the in-memory qualified name to resolve it from
    (``get_parameter``/``get_buffer`` semantics). ``aliases``: other in-memory paths of the same
    tensor that the checkpoint does not hold. ``transform``: the hook that converts it, if any.
    """

    name: str
    path: str
    is_buffer: bool = False
    aliases: tuple[str, ...] = ()
    transform: TensorTransform | None = field(default=None, compare=False)


def _is_pure_wrapper(mod: nn.Module) -> bool:
    children = list(mod._modules.keys())
    return (
        children == [_MAYBE_WRAPPER]
        and not any(p is not None for p in mod._parameters.values())
        and not any(b is not None for b in mod._buffers.values())
    )


def wrapper_paths(module: nn.Module) -> set[str]:
    """In-memory module paths whose ``module`` child is a wrapper segment (DDP-style: the only child
    of a module holding no tensors of its own), for ``checkpoint_name``.

    Computed from module structure only (no tensor data, no collective), so every rank gets the
    same set; compute it once per module tree and pass it to every ``checkpoint_name`` call, which
    is how each caller (``FSDPSource``, ``lora.LoraPlan``, ``LoRAAdapterSource``, the expert
    transform) turns in-memory paths into the names ``save_pretrained`` writes."""
    out: set[str] = set()
    for path, mod in module.named_modules(remove_duplicate=False):
        if _is_pure_wrapper(mod):
            out.add(path)
    return out


def checkpoint_name(path: str, wrapper_paths: set[str] | None = None) -> str:
    """The checkpoint name of in-memory ``path``: wrapper segments removed.

    ``wrapper_paths`` (``wrapper_paths(module)`` of the tree) says where a ``module`` segment is a
    wrapper; without it only the unambiguous wrapper segments are removed.
    """
    parts = path.split(".")
    kept: list[str] = []
    for i, part in enumerate(parts):
        if part in WRAPPER_SEGMENTS:
            continue
        if part == _MAYBE_WRAPPER and wrapper_paths is not None:
            parent = ".".join(parts[:i])
            if parent in wrapper_paths:
                continue
        kept.append(part)
    return ".".join(kept)


def hf_root(module: nn.Module) -> nn.Module:
    """The outermost module under any chain of wrappers (``torch.compile``, checkpoint, DDP...)."""
    seen = 0
    while seen < 16:
        seen += 1
        for attr in WRAPPER_SEGMENTS:
            inner = module._modules.get(attr)
            if inner is not None and len(module._modules) == 1:
                module = inner
                break
        else:
            if _is_pure_wrapper(module):
                module = module._modules[_MAYBE_WRAPPER]
                continue
            return module
    return module


def tied_weight_patterns(module: nn.Module, wrapper_paths: set[str] | None = None) -> list[str]:
    """Checkpoint-name patterns of tied duplicates, as transformers collects them.

    Every submodule's ``_tied_weights_keys`` (a dict target -> source in transformers 5, a list in
    older versions) contributes its keys, prefixed by the submodule's checkpoint path -- the same
    walk as transformers' ``_get_tied_weight_keys``, but over de-wrapped paths.
    """
    pats: list[str] = []
    for path, sub in module.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or {}
        keys = tied.keys() if isinstance(tied, dict) else tied
        prefix = checkpoint_name(path, wrapper_paths)
        pats.extend(f"{prefix}.{k}" if prefix else k for k in keys)
    return pats


def _state_tensors(module: nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor, bool]]:
    """``(path, tensor, is_buffer)`` in ``state_dict`` order, aliases included."""
    out: list[tuple[str, torch.Tensor, bool]] = []
    for mpath, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mpath}." if mpath else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + n, p, False))
        if include_buffers:
            non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
            for n, b in mod._buffers.items():
                if b is not None and n not in non_persistent:
                    out.append((prefix + n, b, True))
    return out


def _unwrapped_class(cls: type) -> type:
    """The class a module had before ``fully_shard`` / ``replicate`` swapped in their dynamic
    subclass (``type(f"FSDP{cls.__name__}", (FSDPModule, cls), ...)``)."""
    for _ in range(8):
        bases = cls.__bases__
        if (
            len(bases) == 2
            and bases[0].__module__.startswith("torch.distributed.")
            and cls.__name__.endswith(bases[1].__name__)
        ):
            cls = bases[1]
        else:
            break
    return cls


def defined_by_transformers(module: nn.Module, names: Iterable[str]) -> bool:
    """Whether every parameter in ``names`` (de-wrapped) belongs to a module whose class (before
    ``fully_shard`` renamed it) transformers itself defines: its save-time layout is then
    transformers' to say (its conversion mapping, or the in-memory layout), not a guess."""
    wrappers = wrapper_paths(module)
    owner = {}
    for path, mod in module.named_modules():
        owner[checkpoint_name(path, wrappers)] = mod
    names = list(names)
    for name in names:
        mod = owner.get(name.rpartition(".")[0])
        if mod is None or not _unwrapped_class(type(mod)).__module__.startswith("transformers."):
            return False
    return bool(names)


def _unwrapped_tree(root: nn.Module, pretrained_cls: type) -> nn.Module:
    """``root`` as transformers' ``get_model_conversion_mapping`` should see it: the model before
    wrapping. That lookup goes by each ``PreTrainedModel`` submodule's class name (then
    ``config.model_type``), skips classes whose ``__module__`` is not transformers', and scopes by
    module path. ``fully_shard`` renames the classes (``FSDPQwen2_5_VLForConditionalGeneration``,
    defined in torch), so a sharded model built with ``from_config`` would otherwise lose its
    class-keyed mapping (Qwen2.5-VL's ``model.language_model.*`` -> ``model.*`` renames).

    When no class or path is wrapped, ``root`` itself. Otherwise a data-free skeleton: one bare
    instance of each unwrapped ``PreTrainedModel`` class (``__init__`` not run; only ``config``
    set) at its de-wrapped path, plain ``nn.Module`` placeholders between them. Nothing of the
    live model is changed.
    """
    wrappers = wrapper_paths(root)
    found = [
        (path, checkpoint_name(path, wrappers), m)
        for path, m in root.named_modules()
        if isinstance(m, pretrained_cls)
    ]
    if all(_unwrapped_class(type(m)) is type(m) and path == name for path, name, m in found):
        return root

    def bare(m: nn.Module) -> nn.Module:
        cls = _unwrapped_class(type(m))
        s = cls.__new__(cls)
        nn.Module.__init__(s)
        s.config = m.config
        return s

    top = bare(root)
    for _, name, m in found:
        if not name:
            continue
        parent = top
        *segs, leaf = name.split(".")
        for seg in segs:
            child = parent._modules.get(seg)
            if child is None:
                child = parent._modules[seg] = nn.Module()
            parent = child
        parent._modules[leaf] = bare(m)
    return top


def conversion_view(module: nn.Module, root: nn.Module | None = None):
    """``conversions.ConversionView`` of ``module``'s transformers model (``root``, default
    ``hf_root(module)``): the conversions ``save_pretrained`` of the unwrapped model reverts, and
    the global shapes of its parameters by de-wrapped name. What transformers' conversion code
    (``revert_weight_conversion``, ``expert_spec.expert_names``) must be given instead of the wrapped
    model, whose ``FSDP<cls>`` classes transformers skips as custom code."""
    from .conversions import ConversionView

    if root is None:
        root = hf_root(module)
    wrappers = wrapper_paths(module)
    shapes = {checkpoint_name(n, wrappers): tuple(p.shape) for n, p in module.named_parameters()}
    return ConversionView(root, _saved_conversions(root), shapes)


def _saved_conversions(root: nn.Module) -> list:
    """``conversions.saved_conversions`` of ``root``, looked up on the unwrapped class tree; empty
    for a model that is not a transformers ``PreTrainedModel``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    if not isinstance(root, PreTrainedModel):
        return []
    from .conversions import saved_conversions

    if getattr(root, "_weight_conversions", None) is not None:
        return saved_conversions(root)
    return saved_conversions(root, _unwrapped_tree(root, PreTrainedModel))


def _apply_conversions(
    root: nn.Module, entries: list[CheckpointEntry], tensors: dict[str, torch.Tensor]
) -> list[CheckpointEntry]:
    """``entries`` as ``save_pretrained`` writes them: transformers' reverse conversion mapping
    (``conversions.plan_conversions``, the grouping ``revert_weight_conversion`` uses) renames some
    (a ``WeightRenaming`` / ``PrefixChange``: same tensor, the name it writes, no transform: Mixtral's
    in-memory ``mlp.`` is ``block_sparse_moe.``) and converts others (a ``WeightConverter``: the
    entry keeps its in-memory name and gets a ``conversions.ConversionTransform``). Entries that
    already have a transform are left to it. Raises ``UnmappedParameterError`` for conversions that
    cannot be reverted while streaming."""
    from .conversions import ConversionView, plan_conversions

    conversions = _saved_conversions(root)
    if not conversions:
        return entries
    todo = [e for e in entries if e.transform is None]
    meta = {e.name: (tuple(tensors[e.path].shape), tensors[e.path].dtype) for e in todo}
    view = ConversionView(root, conversions, {n: s for n, (s, _) in meta.items()})
    renames, transform = plan_conversions(
        conversions, meta, [e.name for e in todo], view, rank=current_rank()
    )
    out = []
    for e in entries:
        if e.transform is None and transform is not None and transform.handles(e.name):
            e = CheckpointEntry(e.name, e.path, e.is_buffer, e.aliases, transform)
        elif e.transform is None and e.name in renames:
            e = CheckpointEntry(renames[e.name], e.path, e.is_buffer, e.aliases)
        out.append(e)
    # Two tensors under one checkpoint name: save_pretrained would keep one of them silently.
    seen: dict[str, str] = {}
    clashes = []
    for e in out:
        for name in [n for n, _ in e.transform.entries(e.name)] if e.transform is not None else [e.name]:
            if name in seen:
                clashes.append(f"{name!r} (from {seen[name]!r} and {e.path!r})")
            seen[name] = e.path
    if clashes:
        raise UnmappedParameterError(
            f"rank {current_rank()}: transformers' save-time conversions give {len(clashes)} checkpoint "
            f"name(s) to several tensors: {', '.join(clashes[:3])}"
        )
    return out


def checkpoint_entries(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    transforms: Sequence[TensorTransform] = (),
    rename: Callable[[str], str | None] | None = None,
    root: nn.Module | None = None,
) -> list[CheckpointEntry]:
    """Every tensor ``save_pretrained`` would write for ``module``, in checkpoint order.

    ``rename`` maps a de-wrapped in-memory path to its checkpoint name (None: not a checkpoint
    tensor); ``root`` overrides the model whose tied-weight keys and conversions apply (both for
    PEFT models, whose checkpoint is the base model's).

    Tensors transformers converts at save time get a ``conversions.ConversionTransform`` unless a
    ``transforms`` entry matches them; ``UnmappedParameterError`` names the conversions that cannot
    be reverted while streaming.
    """
    wrappers = wrapper_paths(module)
    tensors = _state_tensors(module, include_buffers)
    if root is None:
        root = hf_root(module)
        tied_source, tied_wrappers = module, wrappers
    else:
        tied_source, tied_wrappers = root, wrapper_paths(root)

    # Group aliases by tensor identity; first appearance fixes the position.
    by_id: dict[int, list[tuple[str, str, bool]]] = {}
    order: list[int] = []
    for path, t, is_buf in tensors:
        key = id(t)
        name = checkpoint_name(path, wrappers)
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if key not in by_id:
            by_id[key] = []
            order.append(key)
        by_id[key].append((name, path, is_buf))

    tied = [re.compile(p) for p in tied_weight_patterns(tied_source, tied_wrappers)]
    ignore_on_save = set(getattr(root, "_keys_to_ignore_on_save", None) or ())

    entries: list[CheckpointEntry] = []
    for key in order:
        group = by_id[key]
        # Distinct checkpoint names only: a wrapper seen twice is not an alias.
        uniq: dict[str, tuple[str, bool]] = {}
        for name, path, is_buf in group:
            uniq.setdefault(name, (path, is_buf))
        names = list(uniq)
        if len(names) > 1:
            # transformers: among sorted names, those matching a tied pattern are deleted while
            # another name remains.
            deleted: set[str] = set()
            for name in sorted(names):
                if any(p.search(name) for p in tied) and len(deleted) < len(names) - 1:
                    deleted.add(name)
            names = [n for n in names if n not in deleted]
        keep = names[0]
        if keep in ignore_on_save:
            continue
        path, is_buf = uniq[keep]
        aliases = tuple(uniq[n][0] for n in uniq if n != keep)
        entries.append(CheckpointEntry(keep, path, is_buf, aliases))

    # Tensor transforms and transformers' own conversions.
    out: list[CheckpointEntry] = []
    for e in entries:
        t = next((t for t in transforms if t.handles(e.name)), None)
        out.append(e if t is None else CheckpointEntry(e.name, e.path, e.is_buffer, e.aliases, t))
    return _apply_conversions(root, out, {path: t for path, t, _ in tensors})

