"""The *items* an ``FSDPSource`` pass over a PEFT LoRA model gathers, and the merge on their way out.

A PEFT model exports its base checkpoint, merged (``lora.py`` says what is merged and why). The
tensors a pass gathers are then not just the checkpoint entries: each LoRA-merged base weight is
followed by its adapters' ``lora_A`` / ``lora_B``. ``LoraItems`` is that list and its bookkeeping.

Invariants:

* **Order**: items are in stream order: entry ``k`` is item ``entry_item[k]``, and a merged base's
  A, B per term follow it immediately -- same FSDP unit, hence the same batched gather in the usual
  layout (a separate one otherwise). A base and its A/B are contiguous items, so a replica that
  sends a run of items (``senders="owners"``) sends them together (``atoms``).
* **Dtypes**: a merged base and its A/B travel in their own dtype and are merged in fp32 or wider
  (``lora.merge_lora``), then cast to the entry's wire dtype; every other item travels in its
  entry's wire dtype, cast before it moves (``wire_dtypes``).
* **Structure only**: built from the checkpoint entries and the ``LoraPlan`` (module structure), no
  tensor data, no collective, so every rank builds the same items; LoRA on a tensor that also needs
  a transform raises ``UnsupportedAdapterError`` on every rank.
* **Merge on emit** (``merger``): a merged base and its A/B are held as they arrive and go out
  merged, in the base entry's place, once the last of them arrived; what is held is accounted in the
  pass's ``PassStats`` and released when the merged tensor is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..core.ground.errors import UnsupportedAdapterError
from ..core.ground.stats import PassStats
from ..core.hf.naming import CheckpointEntry
from .lora import LoraMerge, LoraPlan, merge_lora
from .plan import is_dtensor
from .shards import fallback_full, gather_device

__all__ = ["LoraItems", "MergedBase"]

#: ``emit(entry index, full tensor)``: what a pass yields for one checkpoint entry.
Emit = Callable[[int, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]


class MergedBase(NamedTuple):
    """A LoRA-merged base weight's item: its entry, its merge, and its ``(A item, B item)`` per term."""

    entry: int
    merge: LoraMerge
    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LoraItems:
    """The gathered items of a PEFT pass (module docstring).

    ``paths``: ``(in-memory path, is_buffer)`` of every item, in stream order. ``entry_item``: the
    item index of each checkpoint entry. ``merges``: base item -> its ``MergedBase``. ``aux_of``: an
    A/B item -> its base item.
    """

    paths: tuple[tuple[str, bool], ...]
    entry_item: tuple[int, ...]
    merges: Mapping[int, MergedBase]
    aux_of: Mapping[int, int]

    @classmethod
    def build(cls, entries: Sequence[CheckpointEntry], plan: LoraPlan, *, rank: int) -> "LoraItems":
        """The items of ``entries`` under ``plan``; ``rank`` names this rank in errors."""
        items: list[tuple[str, bool]] = []
        entry_item: list[int] = []
        merges: dict[int, MergedBase] = {}
        aux_of: dict[int, int] = {}
        for k, e in enumerate(entries):
            j = len(items)
            entry_item.append(j)
            items.append((e.path, e.is_buffer))
            m = None if e.is_buffer else plan.merges.get(e.path)
            if m is None:
                continue
            if e.transform is not None:
                raise UnsupportedAdapterError(
                    f"rank {rank}: PEFT module {m.module!r}: LoRA on a tensor that also needs a "
                    f"transform ({e.name}) is not supported"
                )
            pairs = []
            for term in m.terms:
                pairs.append((len(items), len(items) + 1))
                items += [(term.a_path, False), (term.b_path, False)]
                aux_of[len(items) - 2] = aux_of[len(items) - 1] = j
            merges[j] = MergedBase(k, m, tuple(pairs))
        return cls(tuple(items), tuple(entry_item), merges, aux_of)

    # ---- structure -----------------------------------------------------------------------------

    def keys(self, entries: Sequence[CheckpointEntry]) -> list[str]:
        """Each item's name in gather messages: its checkpoint name (an A/B: its in-memory path)."""
        keys = [path for path, _ in self.paths]
        for k, j in enumerate(self.entry_item):
            keys[j] = entries[k].name
        return keys

    def entry_tensors(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The checkpoint entries' tensors among the items' ``tensors``."""
        return [tensors[j] for j in self.entry_item]

    def wire_dtypes(self, tensors: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype]) -> list[torch.dtype]:
        """Dtype each item is gathered in: its entry's wire dtype (``out_dtypes``, cast before the
        gather), except a merged base weight and its A/B, which travel in their own dtype."""
        out = [t.dtype for t in tensors]
        for k, j in enumerate(self.entry_item):
            if j not in self.merges:
                out[j] = out_dtypes[k]
        return out

    def atoms(self) -> list[int]:
        """Per item, the item it travels with: its base for an A/B, itself otherwise."""
        base = list(range(len(self.paths)))
        for i, b in self.aux_of.items():
            base[i] = b
        return base

    @property
    def merged_entries(self) -> frozenset[int]:
        """Entries whose tensor goes out LoRA-merged (it exists in full only after the merge)."""
        return frozenset(mb.entry for mb in self.merges.values())

    def merged_item(self, k: int) -> int | None:
        """The item of entry ``k`` when it is a merged base weight, else None."""
        j = self.entry_item[k]
        return j if j in self.merges else None

    # ---- passes --------------------------------------------------------------------------------

    def merged_full(
        self, j: int, tensors: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype], stats: PassStats
    ) -> torch.Tensor:
        """Merged base item ``j`` in full, in its entry's wire dtype: base and A/B gathered one by
        one in their own dtype (``full_tensor()``: collective on every member of each mesh), then
        merged. What ``iter_local`` and ``iter_pieces`` send for it."""
        k, m, pairs = self.merges[j]

        def full(x: int) -> torch.Tensor:
            t = tensors[x]
            if not is_dtensor(t):
                return t.detach()
            return fallback_full(t, t.dtype, gather_device(t.device_mesh), stats)

        base = full(j)
        terms = [(full(a), full(b), s) for (a, b), s in zip(pairs, m.scalings())]
        return merge_lora(base, terms, fan_in_fan_out=bool(m.layer.fan_in_fan_out), out_dtype=out_dtypes[k])

    def merger(self, emit: Emit, out_dtypes: Sequence[torch.dtype], stats: PassStats) -> Callable[
            [int, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]:
        """``emit(item, full)`` for a gathered pass: an item that is an entry passes through to
        ``emit`` (by entry index); a merged base weight waits for its A/B (the items right after it)
        and goes out merged, in its entry's place."""
        merges, aux_of = self.merges, self.aux_of
        entry_of = {j: k for k, j in enumerate(self.entry_item)}
        held: dict[int, torch.Tensor] = {}

        def emit_item(i: int, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
            base = aux_of.get(i, i)
            if base not in merges:
                yield from emit(entry_of[i], full)
                return
            held[i] = full
            stats.hold(full.numel() * full.element_size())
            k, m, pairs = merges[base]
            if base not in held or any(a not in held or b not in held for a, b in pairs):
                return
            scalings = m.scalings()
            parts = [held.pop(base)] + [held.pop(x) for pair in pairs for x in pair]
            terms = [(parts[1 + 2 * n], parts[2 + 2 * n], s) for n, s in enumerate(scalings)]
            merged = merge_lora(
                parts[0], terms, fan_in_fan_out=bool(m.layer.fan_in_fan_out), out_dtype=out_dtypes[k]
            )
            stats.hold(-sum(p.numel() * p.element_size() for p in parts))
            del parts, terms
            yield from emit(k, merged)

        return emit_item
