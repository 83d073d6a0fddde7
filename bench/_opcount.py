"""Count the work of a pass without timing it: aten ops dispatched and bytes they write.

``count_ops(fn)`` runs ``fn`` under a ``TorchDispatchMode`` that sees every aten op below autograd
(views included) and counts, per op name, how many ran and how many bytes they wrote: the outputs
of an op that does not alias its inputs (a new tensor: a copy, a cast, an ``index_select``) and the
written arguments of an in-place / ``out=`` op (``copy_``, ``_foreach_copy_``). A view writes
nothing. Host speed does not enter: the same code gives the same counts on any machine, so a diff
of two commits' counts shows an added copy or kernel where timings only show noise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpCount", "count_ops"]


@dataclass
class OpCount:
    ops: int = 0
    bytes_written: int = 0
    by_name: Counter = field(default_factory=Counter)
    bytes_by_name: Counter = field(default_factory=Counter)

    def summary(self, top: int = 12) -> str:
        rows = ", ".join(f"{n} x{c} ({self.bytes_by_name[n] / 2**20:.1f} MiB)" for n, c in self.by_name.most_common(top))
        return f"{self.ops} aten ops, {self.bytes_written / 2**20:.1f} MiB written: {rows}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Counter(TorchDispatchMode):
    def __init__(self, out: OpCount) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        written = 0
        schema = func._schema
        mutated = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if name.startswith("empty"):
            pass  # an allocation writes nothing
        elif mutated:
            for a in mutated:
                v = kwargs.get(a.name)
                if v is None:
                    idx = [x.name for x in schema.arguments].index(a.name)
                    v = args[idx] if idx < len(args) else None
                written += sum(_nbytes(t) for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
        else:
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                    written += _nbytes(t)
        self.out.ops += 1
        self.out.by_name[name] += 1
        self.out.bytes_written += written
        self.out.bytes_by_name[name] += written
        return result


def count_ops(fn) -> OpCount:
    """Run ``fn()`` once and return what it dispatched."""
    out = OpCount()
    with _Counter(out):
        fn()
    return out
