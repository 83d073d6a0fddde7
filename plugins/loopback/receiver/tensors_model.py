"""``TensorsModel``: a module holding named tensors and nothing else -- what a loopback receiver
holds where no ``transformers`` model has those names, e.g. the speculative-decoding draft's MTP
tensors (``model.layers.{N}.enorm.weight``, ... as ``MegatronSource(part="mtp")`` declares them)::

    draft = TensorsModel.from_metadata(MegatronSource(model, hf_config=cfg, part="mtp").metadata)
    LoopbackReceiver(hf_model, draft=draft)

Invariant: ``state_dict()`` keys are exactly the given names, in their order, each a parameter of
the given shape and dtype (dotted names become nested submodules); a name that is also another
name's prefix (``a.weight`` and ``a.weight.b``) is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["TensorsModel"]


class TensorsModel(torch.nn.Module):
    """``name -> tensor`` as a ``torch.nn.Module`` (module docstring); the tensors are copied."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            if not leaf or not all(path):
                raise ValueError(f"TensorsModel: empty component in tensor name {name!r}")
            mod: torch.nn.Module = self
            for i, part in enumerate(path):
                if part in mod._parameters:
                    raise ValueError(f"TensorsModel: {'.'.join(path[: i + 1])!r} is a tensor and a prefix of {name!r}")
                child = mod._modules.get(part)
                if child is None:
                    child = torch.nn.Module()
                    mod.add_module(part, child)
                mod = child
            if leaf in mod._modules:
                raise ValueError(f"TensorsModel: {name!r} is a tensor and a prefix of other names")
            if leaf in mod._parameters:
                raise ValueError(f"TensorsModel: {name!r} given twice")
            mod.register_parameter(leaf, torch.nn.Parameter(tensor.detach().clone(), requires_grad=False))

    @classmethod
    def from_metadata(cls, metadata: Iterable[Any]) -> "TensorsModel":
        """Zeros of each entry's ``name`` / ``shape`` / ``dtype`` (vLLM's ``ParamMeta``, e.g. a source's
        ``metadata``)."""
        return cls({m.name: torch.zeros(tuple(m.shape), dtype=m.dtype) for m in metadata})
