"""Lay a Hugging Face checkpoint's tensors into this rank's megatron-core ``GPTModel`` chunks.

Invariant: after ``load_hf_weights`` the chunks hold the checkpoint's values exactly where Megatron
holds them -- TP shards, QKV groups, GLU halves, PP stages, expert-parallel experts, vocabulary
padding (zeros), the tied output copy -- and the layout is never written a second time: it is read
off ``MegatronSource``'s own export (an id probe, ``load_hf_weights``), so the builder and the
source cannot disagree about it. Any id exported twice, or a non-padding element never exported,
raises on every rank (``fill_values``).
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.sources.toolkit import get_logger

__all__ = ["load_hf_weights", "fill_values"]

logger = get_logger(__name__)


#: float32 holds every integer up to 2**24 exactly: the probe's ids per round.
_IDS_PER_ROUND = 2**24 - 1


def load_hf_weights(chunks: list[torch.nn.Module], hf: Any, state: dict[str, torch.Tensor] | None) -> None:
    """Collective (every rank of the default group): set this rank's ``GPTModel`` chunks to the Hugging
    Face checkpoint tensors ``state`` (checkpoint names, as ``save_pretrained`` writes them; needed on
    rank 0 only), laid out as Megatron holds them -- TP shards, QKV groups, GLU halves, PP stages,
    expert-parallel experts, vocabulary padding (zeros), the tied output copy.

    How: the layout is read off ``MegatronSource``'s own export instead of being written a second
    time. Every distinct Megatron element gets an id (copies of one tensor -- TP-replicated norms,
    data-parallel replicas, a last-stage tied output layer -- share their id); the chunks are filled
    with the ids and exported once (float32 holds ids below 2**24 exactly; larger models take more
    passes); where each id lands in the export is where its value comes from. It is checked: an id
    exported twice, or a non-padding element never exported, raises ``ValueError`` on every rank.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from weightsync.sources import MegatronSource

    targets = _probe_targets(chunks, hf)
    sizes = {key: t.numel() for key, _, t in targets}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sizes)
    offsets: dict[tuple, int] = {}
    total = 0
    for key in sorted({k for s in everyone for k in s}, key=repr):
        offsets[key] = total
        total += max(s[key] for s in everyone if key in s)
    rank0 = dist.get_rank() == 0
    where: dict[str, torch.Tensor] = {}  # rank 0: HF name -> id of each element (-1: none)
    saved = [t.detach().clone() for _, _, t in targets]
    shift: dict[str, float] = {}
    try:
        for base in range(0, max(total, 1), _IDS_PER_ROUND):
            with torch.no_grad():
                for key, _, t in targets:
                    ids = torch.arange(offsets[key], offsets[key] + t.numel(), dtype=torch.int64)
                    inside = (ids >= base) & (ids < base + _IDS_PER_ROUND)
                    t.copy_(torch.where(inside, ids - base + 1, 0).to(t.dtype).view(t.shape))
            source = MegatronSource(chunks if len(chunks) > 1 else chunks[0], hf_config=hf, mode="full")
            # kinds whose export adds a constant (a zero-centered norm HF stores uncentered)
            shift = {n: float(u.kind.shift) for u in source.plan if u.kind.shifts_values for n in u.names}
            for name, got in source.iter_full():
                if rank0:
                    v = (got.detach().reshape(-1) - shift.get(name, 0.0)).to(torch.int64)
                    found = torch.where(v > 0, v - 1 + base, -1)
                    where[name] = torch.maximum(where[name], found) if name in where else found
    finally:
        with torch.no_grad():
            for (_, _, t), before in zip(targets, saved):
                t.copy_(before)
    values = torch.full((total,), float("nan"), dtype=torch.float32)
    problem = ""
    if rank0:
        problem = fill_values(values, where, state or {}, offsets, total, shift)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ValueError(f"rank {dist.get_rank()}: load_hf_weights: {box[0]}")
    dist.broadcast(values, src=0)
    with torch.no_grad():
        for key, vocab_rows, t in targets:
            v = values[offsets[key] : offsets[key] + t.numel()].view(t.shape)
            if vocab_rows:  # padding rows past the HF vocabulary: never exported
                v = torch.nan_to_num(v, nan=0.0)
            t.copy_(v.to(t.dtype))
    logger.info("laid out %d HF elements into %d local Megatron tensors (tp rank %d)", total, len(targets),
                ps.get_tensor_model_parallel_rank())


def _probe_targets(chunks: list[torch.nn.Module], hf: Any) -> list[tuple[tuple, bool, torch.Tensor]]:
    """``(key, is_vocab, tensor)`` for every local parameter and router expert-bias buffer; ``key`` is
    equal on every rank holding a copy of the same elements (the ranks it is split over are in it,
    the ranks it is replicated over are not)."""
    from megatron.core import parallel_state as ps

    from weightsync.sources.toolkit import tp_split_dim

    pp = ps.get_pipeline_model_parallel_rank()
    out: list[tuple[tuple, bool, torch.Tensor]] = []
    for v, chunk in enumerate(chunks):
        owner: dict[int, tuple[torch.nn.Module, str]] = {}
        for _, mod in chunk.named_modules():
            for attr, p in mod.named_parameters(recurse=False):
                owner.setdefault(id(p), (mod, attr))
        tied_copy = bool(getattr(chunk, "share_embeddings_and_output_weights", False)) and not chunk.pre_process
        for name, p in chunk.named_parameters():
            if name.startswith("mtp."):  # the MTP block (the draft) is no part of the policy checkpoint
                continue
            mod, attr = owner[id(p)]
            split = tp_split_dim(mod, attr, p) is not None
            expert = ".experts." in f".{name}"
            if expert:
                tp = ps.get_expert_tensor_parallel_rank() if split else None
                key: tuple = (pp, v, name, tp, ps.get_expert_model_parallel_rank())
            else:
                key = (pp, v, name, ps.get_tensor_model_parallel_rank() if split else None)
            if (tied_copy and name == "output_layer.weight") or (
                not chunk.pre_process and name == "embedding.word_embeddings.weight"
            ):  # the last stage's copy of the tied embedding, or an MTP stage's embedding copy
                # (megatron keeps them equal to the first stage's)
                key = (0, 0, "embedding.word_embeddings.weight", ps.get_tensor_model_parallel_rank())
            vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            out.append((key, vocab, p))
        for name, b in chunk.named_buffers():
            if name.endswith("router.expert_bias") and not name.startswith("mtp."):
                out.append(((pp, v, name), False, b))
    return out


def fill_values(
    values: torch.Tensor, where: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
    offsets: dict[tuple, int], total: int, shift: dict[str, float] | None = None,
) -> str:
    """Rank 0: ``values[id] = state[name].flat[i]`` for every exported element; the first problem in
    words ('' when none)."""
    seen = torch.zeros(total, dtype=torch.int32)
    for name, ids in where.items():
        if name not in state:
            return f"the export has {name!r}, the HF checkpoint does not"
        flat = state[name].detach().reshape(-1).to(torch.float32) - (shift or {}).get(name, 0.0)
        if flat.numel() != ids.numel():
            return f"{name!r}: the export has {ids.numel()} elements, the HF checkpoint {flat.numel()}"
        ok = ids >= 0
        if not bool(ok.all()):
            return f"{name!r}: {int((~ok).sum())} exported elements carry no Megatron id"
        values[ids] = flat
        seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    missing = sorted(set(state) - set(where))
    if missing:
        return f"HF checkpoint tensors the export does not have: {missing[:5]}"
    ends = sorted(offsets.items(), key=lambda kv: kv[1])
    for j, (key, start) in enumerate(ends):
        stop = ends[j + 1][1] if j + 1 < len(ends) else total
        counts = seen[start:stop]
        if bool((counts > 1).any()):
            return f"Megatron tensor {key} has elements exported twice (a split tensor taken for a copy)"
        vocab = "word_embeddings" in key[2] or "output_layer" in key[2]  # padding rows are never exported
        if not vocab and bool((counts == 0).any()):
            return f"Megatron tensor {key} has {int((counts == 0).sum())} elements never exported"
    return ""
