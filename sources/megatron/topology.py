"""Where every model-parallel rank of Megatron's first replica lives, computed without a collective.

Invariant: every trainer rank -- including ranks of other data-parallel / context-parallel replicas --
computes the same ``grid``: ``grid[pp_rank][tp_rank]`` is the global rank that holds TP shard
``tp_rank`` of pipeline stage ``pp_rank`` in the replica that contains global rank 0 (the vLLM
sender). The grid is derived from Megatron's own ``RankGenerator`` (the function ``parallel_state``
used to build its groups) and cross-checked against this rank's real TP and PP groups, so a trainer
that initialised Megatron with another rank order raises here, at construction, instead of sending
shards to the wrong rank.

Why no collective: ``metadata`` must be identical on every rank and must not communicate (vLLM reads
it before any rank has entered a pass), and ``owners`` in ``iter_local`` mode name these ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Topology", "megatron_topology"]

# Orders megatron-core accepts for the dense (non-expert) rank generator; the default comes first.
_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp")


@dataclass(frozen=True)
class Topology:
    """This rank's coordinates and the global ranks of the sender's model-parallel replica."""

    rank: int
    world_size: int
    tp: int
    pp: int
    vpp: int  # 1 without virtual pipeline
    tp_rank: int
    pp_rank: int
    grid: tuple[tuple[int, ...], ...]  # grid[pp_rank][tp_rank] -> global rank, replica of rank 0
    #: every model-parallel replica's grid (data- / context-parallel copies of the weights), ordered
    #: by lowest rank: ``replicas[0] == grid``. ``senders="owners"`` spreads dense units over them.
    replicas: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def in_sender_replica(self) -> bool:
        """True iff this rank holds shards the sender needs (rank 0's model-parallel group)."""
        return any(self.rank in row for row in self.grid)

    def stage_ranks(self, stage: int, replica: int = 0) -> tuple[int, ...]:
        """Global ranks of ``stage``'s TP shards in ``replica`` (0: the sender's), in TP order."""
        return (self.replicas or (self.grid,))[replica][stage]


def _group_ranks(group) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def megatron_topology() -> Topology:
    """Read Megatron's ``parallel_state`` (no communication) and build the ``Topology``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "MegatronSource needs megatron.core.parallel_state.initialize_model_parallel() to have "
            "run on every rank before the source is built"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    dp = world // (tp * pp * cp)
    if tp * pp * cp * dp != world:
        raise RuntimeError(
            f"rank {rank}: world size {world} is not tp({tp}) x pp({pp}) x cp({cp}) x dp; "
            "MegatronSource expects Megatron's groups to cover the default process group"
        )
    my_tp = _group_ranks(ps.get_tensor_model_parallel_group())
    my_pp = _group_ranks(ps.get_pipeline_model_parallel_group())
    for order in _ORDERS:
        try:
            gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            tp_groups = gen.get_ranks("tp")
            pp_groups = gen.get_ranks("pp")
            mp_groups = gen.get_ranks("tp-pp")
        except Exception:  # an order this megatron-core does not accept
            continue
        if my_tp not in tp_groups or my_pp not in pp_groups:
            continue
        tp_of = {r: g.index(r) for g in tp_groups for r in g}
        pp_of = {r: g.index(r) for g in pp_groups for r in g}
        grids = []
        for group in sorted(mp_groups, key=min):
            g = [[-1] * tp for _ in range(pp)]
            for r in group:
                g[pp_of[r]][tp_of[r]] = r
            grids.append(tuple(tuple(row) for row in g))
        grid = grids[0]
        if grid[0][0] != 0 or any(r < 0 for g in grids for row in g for r in row):
            continue
        return Topology(
            rank=rank,
            world_size=world,
            tp=tp,
            pp=pp,
            vpp=vpp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            grid=grid,
            replicas=tuple(grids),
        )
    raise RuntimeError(
        f"rank {rank}: could not reproduce Megatron's rank layout (tp={tp}, pp={pp}, cp={cp}, "
        f"dp={dp}; this rank's TP group {my_tp}, PP group {my_pp}) with any of the orders "
        f"{_ORDERS}; MegatronSource cannot tell which ranks hold the sender's shards"
    )
