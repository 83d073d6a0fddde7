"""The plan of a safetensors checkpoint: every file, header and byte offset, before any byte moves.

``plan_checkpoint(metadata, ...)`` decides from a source's ``metadata`` (names, wire dtypes, full
shapes) -- and, when one is at hand, the transformers model class and config -- which tensor goes in
which file at which offset, and the exact bytes of every header and of the index. Nothing here reads
tensor data or runs a collective, so every rank computes the same plan and the writer can stream each
tensor to its place the moment the source yields it.

Invariant: for the tensors ``save_pretrained`` would write (same names, dtypes, shapes), the plan is
what transformers 5 + huggingface_hub + safetensors write, byte for byte:

* **Split** (huggingface_hub ``split_torch_state_dict_into_shards``): walk the tensors in *save
  order*; a tensor larger than ``max_shard_bytes`` gets a shard of its own, otherwise a new shard
  starts when the next tensor would tip the current one over the limit. Tensors that share one
  storage (transformers' per-expert views of a fused MoE parameter) form one unit: it is counted
  once, with its whole storage's bytes, and lands in the shard of its first member.
* **Save order and storages** are transformers' own, asked of a *meta-device* instance of the model
  class built from the config (no memory, no data): its ``state_dict`` minus tied duplicates
  (``remove_tied_weights_from_state_dict``), through ``revert_weight_conversion`` (which re-sorts a
  converted model naturally and splits fused experts into per-expert views). This is why a fused MoE
  checkpoint splits exactly like ``save_pretrained``; without a model class or config, or when the
  source's names are not what that model would save (vLLM's fused expert layout on the wire), the
  plan uses ``metadata`` order with one unit per tensor and says so (``CheckpointPlan.order``).
* **Names**: ``model.safetensors`` for one shard, else ``model-0000k-of-0000n.safetensors`` plus
  ``model.safetensors.index.json`` = ``json.dumps({"metadata": {"total_parameters",
  "total_size"}, "weight_map"}, indent=2, sort_keys=True) + "\\n"``; ``total_parameters`` is the
  meta model's ``num_parameters()`` (what ``save_pretrained`` writes), or the tensors' element count
  when there is no model (it then also counts persistent buffers, e.g. DeepSeek-V3's expert bias).
* **Headers** (safetensors ``serialize``): a u64 little-endian length, then compact JSON
  ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}`` with the tensors sorted
  by dtype -- descending in safetensors' ``Dtype`` enum order (``_ST_ORDER``) -- then by name, data
  offsets contiguous in that order, padded with spaces to a multiple of 8 bytes.
  ``__metadata__`` is ``{"format": "pt"}`` followed by the caller's entries. With more than one entry
  safetensors itself writes them in Rust ``HashMap`` order, which differs from process to process:
  only then can the header not be byte-identical to ``safetensors.save_file`` (same content, other
  key order; every reader parses both alike).
"""

from __future__ import annotations

import copy
import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from weightsync.sources import CheckpointError
from weightsync.sources.toolkit import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    get_logger,
)

__all__ = [
    "SAFETENSORS_NAMES",
    "serialise_header",
    "SINGLE_FILE",
    "INDEX_FILE",
    "PlannedTensor",
    "PlannedFile",
    "CheckpointPlan",
    "SaveLayout",
    "plan_checkpoint",
    "transformers_save_layout",
    "safetensors_dtype",
]

logger = get_logger(__name__)

#: torch dtype -> safetensors dtype string (the inverse of the reader's table: one table for both).
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in SAFETENSORS_DTYPES.items()}

#: safetensors' ``Dtype`` enum order (ascending); ``serialize`` sorts tensors by it, descending.
#: Pinned against ``safetensors.torch.save_file`` for every dtype above by tests/test_checkpoint.py.
_ST_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_ST_RANK = {name: i for i, name in enumerate(_ST_ORDER)}


def safetensors_dtype(dtype: torch.dtype, *, name: str, rank: int) -> str:
    """The safetensors dtype string of ``dtype``; ``CheckpointError`` naming the tensor if none."""
    st = SAFETENSORS_NAMES.get(dtype)
    if st is None:
        raise CheckpointError(
            f"rank {rank}: tensor {name!r} has dtype {dtype}, which safetensors cannot store "
            f"(supported: {', '.join(sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_NAMES))})"
        )
    return st


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor's place: ``file`` (index into ``CheckpointPlan.files``) and its absolute byte
    ``offset`` in that file (header included)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: int
    offset: int


@dataclass(frozen=True)
class PlannedFile:
    """One ``.safetensors`` file: its name, its complete header (length prefix included), its final
    size in bytes and its tensors in data-region order."""

    name: str
    header: bytes
    size: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class SaveLayout:
    """What ``save_pretrained`` of a model class + config would write, from a meta-device instance:
    names in save order, each name's storage (``storage[name]`` = ``(storage key, numel of the whole
    storage)``), the shapes, the parameter count, and the class name (``config.architectures``)."""

    names: tuple[str, ...]
    storage: dict[str, tuple[int, int]]
    shapes: dict[str, tuple[int, ...]]
    num_parameters: int
    architecture: str
    generation_config: Any


@dataclass(frozen=True)
class CheckpointPlan:
    """Every byte the writer will put on disk except the tensors' own; identical on every rank.

    ``tensors`` are in ``metadata`` order (the order the source yields them); ``files`` in file
    order; ``index`` is None for a single file. ``order`` says where the save order came from:
    ``"transformers"`` (a meta instance of the model, see the module docstring) or ``"metadata"``.
    """

    tensors: tuple[PlannedTensor, ...]
    files: tuple[PlannedFile, ...]
    index: dict[str, Any] | None
    total_size: int
    total_parameters: int
    order: str
    layout: SaveLayout | None

    def index_json(self) -> str:
        """``model.safetensors.index.json`` exactly as ``save_pretrained`` formats it."""
        return json.dumps(self.index, indent=2, sort_keys=True) + "\n"

    @property
    def largest_file_bytes(self) -> int:
        return max((f.size for f in self.files), default=0)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def model_class(model: Any) -> type | None:
    """The transformers class of ``model`` under FSDP2's dynamic ``FSDP<cls>`` subclass, or None
    when ``model`` is not a ``PreTrainedModel``."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not cls.__name__.startswith("FSDP"):
            return cls
    return None


def transformers_save_layout(cls: type | None, config: Any) -> SaveLayout | None:
    """``SaveLayout`` of ``cls`` (default: ``AutoModelForCausalLM``'s class for ``config``) built on
    the meta device from a copy of ``config``; None if transformers cannot build it (logged)."""
    if config is None:
        return None
    try:
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cfg = copy.deepcopy(config)
            model = cls._from_config(cfg) if cls is not None else AutoModelForCausalLM.from_config(cfg)
        state = remove_tied_weights_from_state_dict(model.state_dict(), model)
        ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
        state = {k: v for k, v in state.items() if k not in ignore}
        state = revert_weight_conversion(model, state)
        storage: dict[str, tuple[int, int]] = {}
        for name, t in state.items():
            s = t.untyped_storage()
            # Views share one StorageImpl (``_cdata``); on a real model they share a data pointer,
            # which is what huggingface_hub's ``get_torch_storage_id`` groups by.
            storage[name] = (s._cdata, s.nbytes() // max(t.element_size(), 1))
        return SaveLayout(
            names=tuple(state),
            storage=storage,
            shapes={k: tuple(v.shape) for k, v in state.items()},
            num_parameters=int(model.num_parameters()),
            architecture=type(model).__name__,
            generation_config=model.generation_config if model.can_generate() else None,
        )
    except Exception as e:  # noqa: BLE001 - the plan falls back to metadata order, and says why
        logger.info("no transformers save layout for %s: %s: %s", getattr(cls, "__name__", config), type(e).__name__, e)
        return None


def _units(
    metadata: Sequence[ParamMeta], layout: SaveLayout | None, rank: int
) -> tuple[list[tuple[list[str], int]], str]:
    """Save-order units ``(names, bytes)``: one per storage (see the module docstring)."""
    by_name = {m.name: m for m in metadata}
    order, why = "metadata", "no transformers model class or config at hand"
    if layout is not None:
        missing = [n for n in layout.names if n not in by_name]
        extra = [n for n in by_name if n not in layout.storage]
        shapes = [n for n in layout.names if n in by_name and tuple(by_name[n].shape) != layout.shapes[n]]
        if not (missing or extra or shapes):
            order = "transformers"
        else:
            why = (
                f"the source's tensors are not what save_pretrained of {layout.architecture} writes "
                f"(missing {missing[:3]}, extra {extra[:3]}, other shapes {shapes[:3]})"
            )
    if order == "metadata":
        logger.info("checkpoint shards follow metadata order: %s", why)
        names = [m.name for m in metadata]
        keys = {n: (n, _numel(by_name[n].shape)) for n in names}
    else:
        names = list(layout.names)
        keys = layout.storage
    units: dict[Any, tuple[list[str], int]] = {}
    for n in names:
        m = by_name[n]
        key, numel = keys[n]
        if m.dtype.itemsize * _numel(m.shape) == 0:
            key, numel = "<empty>", 0  # an empty tensor's storage pointer is 0: hub groups them all
        if key in units:
            units[key][0].append(n)
        else:
            units[key] = ([n], numel * m.dtype.itemsize)
    return list(units.values()), order


def _split(units: list[tuple[list[str], int]], max_shard_bytes: int) -> tuple[list[list[str]], int]:
    """huggingface_hub's greedy split of save-order units; returns the shards and ``total_size``."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for names, size in units:
        total += size
        if size > max_shard_bytes:
            shards.append(list(names))
            continue
        if current_size + size > max_shard_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.extend(names)
        current_size += size
    if current:
        shards.append(current)
    return shards, total


def _header(
    names: Sequence[str], by_name: dict[str, ParamMeta], st_dtypes: dict[str, str], user: dict[str, str]
) -> tuple[bytes, list[str], dict[str, tuple[int, int]]]:
    """``(header with length prefix, names in data order, data offsets)`` as safetensors writes."""
    ordered = sorted(names, key=lambda n: (-_ST_RANK[st_dtypes[n]], n))
    head: dict[str, Any] = {"__metadata__": {"format": "pt", **user}}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for n in ordered:
        m = by_name[n]
        size = m.dtype.itemsize * _numel(m.shape)
        offsets[n] = (pos, pos + size)
        head[n] = {"dtype": st_dtypes[n], "shape": [int(d) for d in m.shape], "data_offsets": [pos, pos + size]}
        pos += size
    return serialise_header(head), ordered, offsets


def serialise_header(head: dict[str, Any]) -> bytes:
    """A safetensors header as ``safetensors`` writes it: its u64 little-endian length, then compact
    JSON (key order kept), space-padded to a multiple of 8 bytes. One function for every header
    weightsync writes (``save_safetensors``'s shards, ``save_delta``'s patch files,
    ``apply_delta``'s rewritten shards), so their bytes equal safetensors' own."""
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text


def plan_checkpoint(
    metadata: Sequence[ParamMeta],
    *,
    max_shard_bytes: int,
    user_metadata: dict[str, str] | None = None,
    layout: SaveLayout | None = None,
    rank: int = 0,
) -> CheckpointPlan:
    """The ``CheckpointPlan`` of ``metadata`` (see the module docstring).

    Raises ``CheckpointError`` (naming the tensor and ``rank``) for a duplicate or reserved name, a
    dtype safetensors cannot store, or a header above safetensors' 100 MB limit.
    """
    by_name: dict[str, ParamMeta] = {}
    st_dtypes: dict[str, str] = {}
    for m in metadata:
        if m.name in by_name:
            raise CheckpointError(f"rank {rank}: metadata declares tensor {m.name!r} twice")
        if m.name == "__metadata__":
            raise CheckpointError(f"rank {rank}: a tensor cannot be named '__metadata__' in safetensors")
        by_name[m.name] = m
        st_dtypes[m.name] = safetensors_dtype(m.dtype, name=m.name, rank=rank)
    if not by_name:
        raise CheckpointError(f"rank {rank}: the source declares no tensors: nothing to save")
    units, order = _units(metadata, layout, rank)
    shards, total = _split(units, max_shard_bytes)
    n = len(shards)
    files: list[PlannedFile] = []
    place: dict[str, tuple[int, int]] = {}
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards):
        fname = SINGLE_FILE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        header, ordered, offsets = _header(names, by_name, st_dtypes, user_metadata or {})
        if len(header) - 8 > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"rank {rank}: the header of {fname} would be {len(header) - 8} bytes, above "
                f"safetensors' limit of {MAX_HEADER_BYTES}: lower max_shard_bytes"
            )
        data = sum(b - a for a, b in offsets.values())
        files.append(PlannedFile(fname, header, len(header) + data, tuple(ordered)))
        for name in ordered:
            place[name] = (k, len(header) + offsets[name][0])
            weight_map[name] = fname
    tensors = tuple(
        PlannedTensor(m.name, m.dtype, tuple(m.shape), m.dtype.itemsize * _numel(m.shape), *place[m.name])
        for m in metadata
    )
    params = layout.num_parameters if order == "transformers" else sum(_numel(m.shape) for m in metadata)
    index = None
    if n > 1:
        index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    return CheckpointPlan(tensors, tuple(files), index, total, params, order, layout if order == "transformers" else None)
