"""Planning one FSDP pass: which tensors gather together, in metadata order.

Invariant: the plan is a pure function of module structure, tensor metadata (types, placements,
meshes, global shapes) and the arguments -- never of tensor values or of the rank beyond mesh
membership -- so every rank builds the same sequence of collectives and they line up.

Units. ``fully_shard`` turns modules into ``FSDPModule`` subclasses, innermost first; each unit
owns the parameters of its subtree not owned by a nested unit, the root owns the leftovers. A
post-order walk (children before parents, first claim wins) reproduces that assignment from the
module tree alone. Parameters FSDP ignores are plain tensors and need no gather.

Grouping. Metadata order is checkpoint order, and the stream must follow it. Consecutive tensors
that share (unit, mesh, sharded mesh axis) form one gather; a group closes when the next tensor
belongs elsewhere or would push it past ``group_bytes`` of wire bytes. A unit whose tensors are not
contiguous in checkpoint order (the root unit of a transformers model holds the embeddings, which
come first, and the final norm / lm_head, which come last) is gathered once per contiguous run:
one extra collective, and the source never holds more than one group's full tensors. So
collectives per pass <= (FSDP units x meshes) + runs split by order + groups split by bytes +
one per tensor that takes the ``full_tensor()`` fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.comm.senders import split_contiguous
from .shards import batchable_axis, gather_device

__all__ = [
    "fsdp_units", "Step", "plan_steps", "is_dtensor", "is_member", "dtensor_layout", "hsdp_replicas", "item_replicas",
]


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_member(t: torch.Tensor) -> bool:
    mesh = getattr(t, "device_mesh", None)
    return mesh is None or mesh.get_coordinate() is not None


def dtensor_layout(t: torch.Tensor):
    """``(owners, mesh_shape, placements)`` in vLLM's terms, or None (owned by every rank,
    replicated: a plain tensor, or a DTensor on a mesh that does not span the world).

    Same rule as vLLM's ``ModuleSource`` otherwise: owners are the mesh's global ranks,
    placements are declared only when every one is a plain ``Shard``/``Replicate`` (else None:
    replicated, and ``iter_local`` gathers it).
    """
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return None
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from vllm.distributed.weight_transfer.base import Replicate, Shard

    grid = mesh.mesh
    owners = tuple(int(r) for r in grid.flatten().tolist())
    if _world_size() != len(owners):
        # A sub-mesh (FSDP over the data-parallel dim while TP replicates): its ranks differ from
        # rank to rank, so declaring them would make metadata differ across ranks. Every rank
        # holds a replica group of it, so it is declared owned by every rank, replicated.
        return None
    placements = []
    for p in t.placements:
        if type(p) is TShard:
            placements.append(Shard(p.dim))
        elif type(p) is TReplicate:
            placements.append(Replicate())
        else:
            return owners, tuple(grid.shape), None
    return owners, tuple(grid.shape), tuple(placements)


def hsdp_replicas(tensors: Sequence[torch.Tensor], *, rank: int) -> tuple[tuple[int, ...], ...]:
    """The replicas of an HSDP model, each its shard group's global ranks in shard order:
    ``replicas[r][0]`` is replica ``r``'s first rank (its sender under ``senders="owners"``).

    HSDP here: every DTensor lives on one 2-D mesh spanning the world, placed ``(Replicate(),
    Shard(d))``. Anything else -- plain FSDP (a 1-D mesh: every rank holds only a shard, and vLLM
    0.34's engine pulls a sender's pass only on its own turn, so gathers among all ranks would
    deadlock), FSDP+TP, per-parameter meshes, no DTensor at all -- raises ``ValueError`` naming
    what was found, on every rank alike (module structure only, no collective)."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    meshes: dict[int, object] = {}
    bad: list[str] = []
    for t in tensors:
        if not is_dtensor(t):
            continue
        meshes[id(t.device_mesh)] = t.device_mesh
        p = tuple(t.placements)
        if len(p) != 2 or type(p[0]) is not TReplicate or type(p[1]) is not TShard:
            bad.append(repr(p))
    grids = {tuple(tuple(int(r) for r in row) for row in m.mesh.tolist()) if m.mesh.dim() == 2 else
             (tuple(int(r) for r in m.mesh.flatten().tolist()),) for m in meshes.values()}
    grid = next(iter(grids)) if len(grids) == 1 else None
    if grid is None or bad or len(grid) < 2 or sum(len(row) for row in grid) != _world_size():
        found = ("no DTensor (not sharded)" if not meshes else
                 f"meshes {sorted(str(tuple(m.mesh.shape)) for m in meshes.values())}"
                 + (f", placements {sorted(set(bad))[:3]}" if bad else ""))
        raise ValueError(
            f"rank {rank}: FSDPSource(senders='owners') needs HSDP: every sharded tensor on one 2-D "
            "mesh (replicate x shard) spanning the world, placed (Replicate(), Shard(d)), so each "
            f"replica sends its share of the units; found {found}. Under plain FSDP every rank holds "
            "only a shard and vLLM 0.34's engine pulls a sender's pass only on its own turn, so the "
            "gathers would deadlock: use senders='rank0' there"
        )
    return grid


def item_replicas(sizes: Sequence[int], atoms: Sequence[int], replicas: int) -> list[int]:
    """``senders="owners"``: the replica that gathers and sends each item (``sizes``: its wire bytes)
    -- contiguous runs of items in stream order balanced by wire bytes
    (``core.comm.senders.split_contiguous``: a replica sends at most total / replicas + the largest
    tensor). Items with the same ``atoms`` entry (a LoRA base and its A/B, contiguous) go together."""
    order = list(dict.fromkeys(atoms))
    atom_bytes = dict.fromkeys(order, 0)
    for i, a in enumerate(atoms):
        atom_bytes[a] += sizes[i]
    bins = dict(zip(order, split_contiguous([atom_bytes[a] for a in order], replicas)))
    return [bins[a] for a in atoms]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fsdp_units(module: nn.Module) -> dict[int, int]:
    """``id(parameter) -> unit index`` for every parameter under an ``FSDPModule``.

    Units are numbered in post-order (innermost first), which is also the order ``fully_shard``
    must have been applied in.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return {}
    owner: dict[int, int] = {}
    unit = 0

    def visit(mod: nn.Module, seen: set[int]) -> None:
        nonlocal unit
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child in mod.children():
            visit(child, seen)
        if isinstance(mod, FSDPModule):
            for p in mod.parameters():
                owner.setdefault(id(p), unit)
            unit += 1

    visit(module, set())
    return owner


@dataclass
class Step:
    """One piece of work in a pass: ``kind`` is ``plain`` (no gather), ``batched`` (one
    ``BatchedGather`` over ``indices``) or ``full`` (``full_tensor()`` fallback, one index)."""

    kind: str
    indices: list[int] = field(default_factory=list)
    axis: int | None = None
    mesh: object = None
    device: torch.device | None = None
    wire_bytes: int = 0


def plan_steps(
    tensors: Sequence[torch.Tensor | None],
    wire_dtypes: Sequence[torch.dtype],
    units: dict[int, int],
    group_bytes: int | None,
) -> list[Step]:
    """Steps in metadata order for ``tensors`` (None: not owned by this rank, skipped)."""
    steps: list[Step] = []
    last_key = None
    for i, (t, wd) in enumerate(zip(tensors, wire_dtypes)):
        if t is None:
            last_key = None
            continue
        if not is_dtensor(t):
            steps.append(Step("plain", [i]))
            last_key = None
            continue
        axis = batchable_axis(t)
        if axis is None:
            steps.append(Step("full", [i], mesh=t.device_mesh, device=gather_device(t.device_mesh)))
            last_key = None
            continue
        nbytes = t.numel() * wd.itemsize
        # the mesh by value: a unit's DTensors may hold distinct but equal DeviceMesh objects
        # (after other meshes of the same ranks were built in the process), and a gather over
        # either's group is the same collective; keyed by id they split a unit into many gathers
        key = (units.get(id(t), -1), t.device_mesh, axis)
        cur = steps[-1] if steps else None
        if (
            key == last_key
            and cur is not None
            and (group_bytes is None or cur.wire_bytes + nbytes <= group_bytes)
        ):
            cur.indices.append(i)
            cur.wire_bytes += nbytes
            continue
        steps.append(
            Step(
                "batched",
                [i],
                axis=axis,
                mesh=t.device_mesh,
                device=gather_device(t.device_mesh),
                wire_bytes=nbytes,
            )
        )
        last_key = key
    return steps
