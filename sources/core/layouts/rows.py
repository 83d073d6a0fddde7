"""Row arithmetic of Megatron's fused tensors: which rows of a fused tensor, or of one TP shard of it,
belong to which Hugging Face tensor. Pure functions on sizes and tensors; the layout kinds that
dispatch to them, and the fused layouts they decode, are ``tp.py``'s.

* ``chunk_rows``: the ``torch.chunk`` rule -- the one place it lives (FSDP2's dim-0 shards, vLLM's
  ``Shard`` placement and the vocabulary rule below all mean it).
* ``split_qkv`` / ``split_gated_qkv`` / ``split_glu`` / ``split_stack``: one fused tensor (whole, or
  one TP shard) into its rows of each HF tensor.
* ``indexer_rope_rows``: a DSA indexer head's channels, megatron's rope
  placement to transformers'.
* ``vocab_rows`` / ``vocab_is_chunked`` / ``trim_vocab``: Megatron's padded vocabulary against HF's
  ``vocab_size`` rows.

Nothing here communicates or mutates its input; outputs are contiguous.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "chunk_rows",
    "split_qkv",
    "split_gated_qkv",
    "split_glu",
    "split_stack",
    "INDEXER_MEGATRON_ROPE",
    "indexer_rope_rows",
    "vocab_rows",
    "vocab_is_chunked",
    "trim_vocab",
]


def chunk_rows(size: int, n: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``size`` split ``n`` ways like ``torch.chunk``.

    The one place the ``torch.chunk`` rule lives: ``ceil(size / n)`` per piece, trailing pieces
    shorter or empty. FSDP2 shards dim 0 this way, vLLM's ``Shard`` placement means this, and the
    vocabulary rule (``vocab_is_chunked``) compares Megatron's padding against it.
    """
    c = -(-size // n) if n else 0
    start = min(index * c, size)
    return start, max(0, min(c, size - start))


#: ``_qkv_row_order`` per (geometry, device): built once, a few KB each.
_QKV_ORDER: dict[tuple, torch.Tensor] = {}


def _qkv_row_order(groups: int, heads_per_group: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Row indices that reorder a Megatron ``linear_qkv`` of ``groups`` query groups into ``[q; k; v]``."""
    key = (groups, heads_per_group, head_dim, device.type, device.index)
    idx = _QKV_ORDER.get(key)
    if idx is None:
        rows = torch.arange(groups * (heads_per_group + 2) * head_dim).view(groups, heads_per_group + 2, head_dim)
        order = torch.cat([
            rows[:, :heads_per_group].reshape(-1),
            rows[:, heads_per_group].reshape(-1),
            rows[:, heads_per_group + 1].reshape(-1),
        ])
        idx = _QKV_ORDER[key] = order.to(device)
    return idx


def split_qkv(
    qkv: torch.Tensor, *, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a Megatron ``linear_qkv`` weight or bias (full, or one TP shard) into ``(q, k, v)``.

    Rows are ``[q x heads_per_group, k, v]`` blocks of ``head_dim`` rows, repeated once per query
    group held. Works for any number of whole groups, which is what a TP shard holds -- and, since
    TP shards hold whole groups in order, for the ``torch.cat`` of every shard.

    One gather (``index_select`` of rows) writes ``[q; k; v]`` into one new buffer; the three
    results are contiguous views of it. One kernel instead of three strided copies matters when the
    export is bound by launches (TP1 on a GPU: 28 layers of Qwen3-1.7B are 84 copies otherwise).
    """
    block = (heads_per_group + 2) * head_dim
    if qkv.shape[0] % block:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} rows, not a whole number of query groups of "
            f"({heads_per_group} q heads + k + v) x head_dim {head_dim} = {block} rows"
        )
    groups = qkv.shape[0] // block
    out = qkv.index_select(0, _qkv_row_order(groups, heads_per_group, head_dim, qkv.device))
    nq, nk = groups * heads_per_group * head_dim, groups * head_dim
    return out[:nq], out[nq : nq + nk], out[nq + nk :]


_GATED_ORDER: dict[tuple, torch.Tensor] = {}


def split_gated_qkv(
    qkv: torch.Tensor, *, heads_per_group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a gated-attention ``linear_qkv`` (full, or one TP shard: whole query groups) into HF's
    ``(q_proj, k_proj, v_proj)``: megatron rows per group ``[q x hpg, gate x hpg, k, v]``
    (``Attention.get_query_key_value_tensors(output_gate=True)``), HF ``q_proj`` rows per head
    ``[q_h; gate_h]`` (Qwen3-Next ``Qwen3NextAttention``: ``view(..., -1, head_dim * 2).chunk(2)``)."""
    hpg, d = heads_per_group, head_dim
    block = (2 * hpg + 2) * d
    if qkv.shape[0] % block:
        raise ValueError(
            f"gated linear_qkv has {qkv.shape[0]} rows, not a whole number of query groups of "
            f"(2 x {hpg} q/gate heads + k + v) x head_dim {d} = {block} rows"
        )
    groups = qkv.shape[0] // block
    key = (groups, hpg, d, qkv.device.type, qkv.device.index)
    idx = _GATED_ORDER.get(key)
    if idx is None:
        rows = torch.arange(groups * block).view(groups, 2 * hpg + 2, d)
        q = torch.stack([rows[:, :hpg], rows[:, hpg : 2 * hpg]], 2).reshape(-1)  # [g, head, q|gate, d]
        idx = _GATED_ORDER[key] = torch.cat([q, rows[:, 2 * hpg].reshape(-1), rows[:, 2 * hpg + 1].reshape(-1)]).to(qkv.device)
    out = qkv.index_select(0, idx)
    nq, nk = groups * 2 * hpg * d, groups * d
    return out[:nq], out[nq : nq + nk], out[nq + nk :]


def split_glu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one ``linear_fc1`` shard (or the tp=1 tensor) of a gated MLP into ``(gate, up)``.

    Megatron stores ``[gate_r; up_r]`` per TP shard (gate first, as in ``glu``'s
    ``torch.chunk(x, 2, -1)``), so the split is per shard.
    """
    if fc1.shape[0] % 2:
        raise ValueError(f"gated linear_fc1 has an odd number of rows ({fc1.shape[0]})")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def split_stack(t: torch.Tensor, *, rows: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Split a stacked weight (whole, or one ``stack_column`` TP shard) into its HF tensors.

    ``rows`` are the HF tensors' *full* row counts. A shard holding ``1/n`` of the rows holds
    ``rows[i] / n`` rows of each, in order (``[A_r; B_r]``); ``n`` is read off the shard, so one
    function serves the whole tensor (n = 1) and every TP shard. Outputs are contiguous row views.
    """
    total, n = sum(rows), t.shape[0]
    if not total or any(r * n % total for r in rows):
        raise ValueError(
            f"stacked weight has {t.shape[0]} rows, not a whole 1/n share of each of the stacked "
            f"tensors' rows {list(rows)}"
        )
    return tuple(p.contiguous() for p in torch.split(t, [r * n // total for r in rows], dim=0))


#: where a megatron-core ``DSAIndexer`` keeps each head's rope channels (``megatron_rope``):
#: 0.16-0.18 ``[nope | pe]`` with MLA-interleaved pairs (no ``dsa_indexer_rope_interleaved`` field);
#: 0.19 ``[pe | nope]``, half-split pairs, or interleaved ones with ``dsa_indexer_rope_interleaved``.
INDEXER_MEGATRON_ROPE = ("last_interleaved", "first_half", "first_interleaved")


def indexer_rope_rows(head_dim: int, rope_dim: int, pairing: str, megatron_rope: str = "last_interleaved") -> torch.Tensor:
    """For one DSA indexer head: HF channel ``j`` is megatron channel ``rows[j]``.

    HF ``[pe | nope]`` with pe pairs ``(pe[i], pe[i + r/2])`` (``pairing="half"``) or ``(pe[2i],
    pe[2i+1])`` (``"interleaved"``) at frequency ``i``; megatron as ``megatron_rope`` says
    (``INDEXER_MEGATRON_ROPE``). Pair ``i`` of one side is pair ``i`` of the other, in the same order
    (the cos and sin halves of a rotation), so the scores are the same."""
    d, r = head_dim, rope_dim
    if not 0 < r <= d or r % 2:
        raise ValueError(f"indexer rope dims {r} do not fit an indexer head of {d} channels as even pairs")
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"unknown indexer rope pairing {pairing!r}")
    if megatron_rope not in INDEXER_MEGATRON_ROPE:
        raise ValueError(f"unknown megatron indexer rope placement {megatron_rope!r}")
    pe_at, _, m_pairing = megatron_rope.partition("_")
    base = d - r if pe_at == "last" else 0
    nope = list(range(d - r)) if pe_at == "last" else list(range(r, d))
    # megatron's pair i: (first, second) channel
    if m_pairing == "interleaved":
        pairs = [(base + 2 * i, base + 2 * i + 1) for i in range(r // 2)]
    else:
        pairs = [(base + i, base + i + r // 2) for i in range(r // 2)]
    if pairing == "half":
        pe = [a for a, _ in pairs] + [b for _, b in pairs]
    else:
        pe = [c for pair in pairs for c in pair]
    return torch.tensor(pe + nope, dtype=torch.long)


def vocab_rows(vocab_size: int, padded_vocab: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the HF vocabulary rows that TP shard ``tp_rank`` holds.

    The shard's local rows ``[0, stop - start)`` are those rows; the rest is padding. A shard made
    only of padding gets ``start == stop``.
    """
    if padded_vocab % tp:
        raise ValueError(f"padded vocabulary {padded_vocab} is not divisible by tp={tp}")
    if padded_vocab < vocab_size:
        raise ValueError(f"padded vocabulary {padded_vocab} is smaller than vocab_size {vocab_size}")
    per = padded_vocab // tp
    start = min(tp_rank * per, vocab_size)
    stop = min((tp_rank + 1) * per, vocab_size)
    return start, stop


def vocab_is_chunked(vocab_size: int, padded_vocab: int, tp: int) -> bool:
    """True iff the trimmed vocabulary shards are exactly ``torch.chunk(vocab_size rows, tp)``.

    ``torch.chunk`` gives ``ceil(V/tp)`` rows per piece (the last ones shorter or empty); Megatron
    gives ``padded/tp`` per shard before trimming. They agree iff ``padded/tp == ceil(V/tp)``
    (then only the last non-empty shard carries padding) -- e.g. V=255, padded=256, tp=2 -- and
    disagree when padding spans more than a chunk -- e.g. V=250, padded=256, tp=2 (125 vs 128).
    """
    c = -(-vocab_size // tp)
    for r in range(tp):
        start, stop = vocab_rows(vocab_size, padded_vocab, tp, r)
        chunk = max(0, min(c, vocab_size - r * c))
        if stop - start != chunk:
            return False
    return True


def trim_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first ``vocab_size`` rows of a (padded) vocabulary tensor, contiguous."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"vocabulary tensor has {weight.shape[0]} rows, fewer than {vocab_size}")
    return weight[:vocab_size].contiguous()
