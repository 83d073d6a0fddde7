"""One DTensor shard as the gathers see it: its local tensor, the device its mesh gathers on,
whether the batched gather can take it, and the ``full_tensor()`` fallback for what it cannot.

The batched gather (``gather.BatchedGather``) covers FSDP2's ``Shard(0)`` and HSDP's
``(Replicate, Shard(0))`` (``batchable_axis``). Anything else -- ``_StridedShard`` (FSDP+TP),
``Partial``, ``Shard(d>0)``, two sharded mesh dims -- goes through ``DTensor.full_tensor()``
(``fallback_full``), which is correct there where a hand-rolled concat is not; the local shard is
cast (and staged) first, without ``redistribute``. Nothing here writes to the module's shards.
"""

from __future__ import annotations

import torch

from ..core.ground.stats import PassStats
from .gather import after_default_stream

__all__ = ["local_of", "gather_device", "batchable_axis", "fallback_full"]


def local_of(dt) -> torch.Tensor:
    """A DTensor's local shard, detached (read only). ``_local_tensor`` skips the autograd
    function ``to_local()`` runs, a per-parameter cost that a pass pays for every parameter."""
    local = getattr(dt, "_local_tensor", None)
    if local is None:
        local = dt.to_local()
    return local.detach()


def gather_device(mesh) -> torch.device:
    """The device collectives of ``mesh`` run on: cpu for gloo meshes, the current accelerator
    device otherwise (what FSDP2 itself gathers on, also under ``CPUOffloadPolicy``)."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    mod = torch.get_device_module(kind)
    return torch.device(kind, mod.current_device())


def batchable_axis(dt) -> int | None:
    """The mesh axis of a DTensor's single ``Shard(0)`` placement when every other axis is
    ``Replicate`` (FSDP2, HSDP), else None. Subclasses (``_StridedShard``) do not qualify."""
    from torch.distributed.tensor import Replicate, Shard

    axis = None
    for i, p in enumerate(dt.placements):
        if type(p) is Shard and p.dim == 0 and axis is None:
            axis = i
        elif type(p) is Replicate:
            continue
        else:
            return None
    if axis is None or dt.ndim == 0:
        return None
    return axis


def fallback_full(dt, wire_dtype: torch.dtype, device: torch.device, stats: PassStats) -> torch.Tensor:
    """``dt.full_tensor()`` in ``wire_dtype``, casting (and staging) the local shard first.

    Counts one collective per non-Replicate mesh axis (what DTensor's redistribution issues).
    The result is contiguous; for a Replicate-only DTensor already in the wire dtype on the gather
    device it aliases the module's storage (nothing was gathered).
    """
    from torch.distributed.tensor import DTensor, Replicate

    after_default_stream(device)
    local = local_of(dt)
    staged = local.to(device=device, dtype=wire_dtype)
    src = DTensor.from_local(
        staged, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
    full = src.full_tensor()
    wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: materialize it
    if callable(wait):
        full = wait()
    n_coll = sum(1 for p in dt.placements if not isinstance(p, Replicate))
    stats.collectives += n_coll
    if n_coll:
        stats.bytes_received += full.numel() * full.element_size() - staged.numel() * staged.element_size()
    return full.contiguous()
