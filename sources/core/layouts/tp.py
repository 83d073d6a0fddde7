"""Megatron's TP layout kinds: how one Megatron parameter's TP shards hold the Hugging Face tensors it fuses.

One invariant makes every Megatron TP export a concatenation: **after the local split, TP shard
``r`` of a Megatron parameter is a plain ``torch.chunk`` piece ``r`` of each Hugging Face tensor it
fuses** (dim 0 for column-parallel, dim 1 for row-parallel). So a full HF tensor is
``torch.cat([split(shard_r)[i] for r in range(tp)], dim)``, and ``iter_local`` can declare the
pieces as ``Shard(dim)`` without gathering. The fused layouts:

* ``linear_qkv`` (column-parallel) rows are grouped per query group:
  ``[q_0 .. q_{H/G-1}, k, v] x G``, each block ``head_dim`` rows. TP rank ``r`` holds groups
  ``r*G/tp .. (r+1)*G/tp - 1`` whole, so its q rows are chunk ``r`` of ``q_proj``, and likewise for
  k and v. Splitting the *full* tensor with the same function gives the same answer (G groups).
* ``linear_fc1`` with a gated linear unit: the full tensor is ``[gate; up]`` but TP rank ``r`` holds
  ``[gate_r; up_r]``: each shard must be split in two before concatenating. Concatenating the
  shards and then chunking is wrong for tp > 1.
* Stacked rows (``stack``, ``stack_column``): one Megatron weight whose rows are several HF tensors
  of *different* sizes, e.g. megatron-core 0.19's fused MLA ``linear_qkv_down_proj`` =
  ``[q_a_proj; kv_a_proj_with_mqa]``. Duplicated over TP (``stack``: every rank holds the whole
  ``[A; B]``) or column-parallel (``stack_column``: TP rank ``r`` holds ``[A_r; B_r]``, each HF
  tensor chunked separately, which is how megatron's own ``sharded_state_dict`` cuts it) -- the
  GLU rule with unequal parts, so again a per-shard split before concatenating.
* Gated attention (``attention_output_gate``, Qwen3-Next / Qwen3.5 full-attention layers):
  ``linear_qkv`` rows per query group are ``[q x hpg, gate x hpg, k, v]``; HF's ``q_proj`` holds
  ``[q_h; gate_h]`` per head. TP ranks hold whole groups, so each shard splits into chunk ``r`` of
  ``q_proj`` / ``k_proj`` / ``v_proj`` (``qkv_gated``, ``split_gated_qkv``).
* Gated delta net (``gdn_*``, one class): megatron-core's ``GatedDeltaNet.in_proj`` holds, per TP
  rank, ``[q_r | k_r | v_r | z_r | beta_r | alpha_r]`` (rank ``r``'s key heads for q/k, its value heads
  for v/z/beta/alpha, each block in head order), and ``conv1d`` ``[q_r | k_r | v_r]`` channels. Both
  are tagged ``partition_dim=0`` yet neither is a row chunk of anything when tp > 1: each block is
  chunked separately. Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` group rows per key head, so
  their TP pieces *are* chunks (``gdn_qkvz_ba``); Qwen3.5's flat ``in_proj_qkv = [q; k; v]`` and the
  conv1d channels are not (``gdn_qkv_z_b_a``, ``gdn_conv``: ``chunked = False``, gathered whole).
* Norms whose stored weight differs from HF's by a constant (``shifted``: ``hf = megatron + shift``,
  e.g. the gated-delta-net output norm of a ``layernorm_zero_centered_gamma`` model): applied by
  ``to_wire`` in fp32 before the one cast to the wire dtype, never after it.
* DSA indexer rows (``indexer_rope_*``, DeepSeek-V3.2 / GLM-5): megatron-core 0.16-0.18's
  ``DSAIndexer`` ropes the *last* ``r = qk_pos_emb_head_dim`` channels of each ``d = index_head_dim``
  head in interleaved pairs ``(2i, 2i+1)`` (MLA rope); 0.19 ropes the *first* ``r``, in half-split
  pairs ``(i, i + r/2)`` or, with ``dsa_indexer_rope_interleaved``, interleaved ones (``megatron_rope``
  below); transformers ropes the *first* ``r`` in half-split pairs (DeepSeek-V3.2) or interleaved
  pairs (GLM-5). Same scores need the same pairs at the same frequencies, so each head's rows
  (``wq_b``; ``wk`` and the ``k_norm`` weight and bias for the one key head) are permuted
  (``indexer_rope_rows``; the identity where both sides agree). Duplicated over TP.
* Vocabulary-parallel embedding / output layer: rows are padded to ``padded_vocab`` (a multiple of
  ``make_vocab_size_divisible_by * tp``) and split evenly; HF keeps ``vocab_size`` rows. Shard ``r``
  holds HF rows ``[r*padded/tp, (r+1)*padded/tp) & [0, vocab_size)``; whether that is a
  ``torch.chunk`` piece depends on the numbers (``vocab_is_chunked``).

* Boxes (``Layout.boxes``): where TP shard ``r``'s split sits inside the full HF tensors, for
  consumers that work where the shard lives (``core/layouts/pieces.py``, delta sync). For every chunked kind
  the split's piece ``i`` is ``torch.chunk`` piece ``r`` of HF tensor ``i`` along ``dim``
  (``chunk_rows``); replicated kinds give whole tensors; the vocabulary's trimmed rows start at
  ``vocab_rows``; the non-chunked gated-delta-net kinds give one box per block (``[q_r; k_r; v_r]``
  is three boxes of ``[q; k; v]``).

A kind is a ``Layout`` (the instance is its name, the class its behaviour: ``split``, ``concat``,
``boxes``, ``shard_shape``, ``to_wire``); the row arithmetic the kinds dispatch to (``split_qkv``,
``vocab_rows``, ``indexer_rope_rows``, the ``torch.chunk`` rule ...) is ``rows.py``'s. A new kind is a
class here and one entry of ``KINDS``; family tables name it.

Nothing here communicates or mutates its input; outputs are contiguous (box values may be views).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .rows import (
    chunk_rows,
    indexer_rope_rows,
    split_gated_qkv,
    split_glu,
    split_qkv,
    split_stack,
    vocab_rows,
)

__all__ = [
    "Box",
    "Layout",
    "KINDS",
    "layout",
    "REPLICATED",
    "COLUMN",
    "ROW",
    "QKV_LAYOUT",
    "GLU_LAYOUT",
    "STACK",
    "STACK_COLUMN",
    "VOCAB",
    "QKV_GATED",
    "GDN_QKVZ_BA",
    "GDN_QKV_Z_B_A",
    "GDN_CONV",
    "SHIFTED_PLUS_ONE",
    "INDEXER_ROPE_HALF",
    "INDEXER_ROPE_INTERLEAVED",
    "IndexerRope",
    "GatedDeltaNet",
]


class Box(NamedTuple):
    """One box of a TP shard's values inside HF tensor ``index`` (the position in the unit's HF
    tensors, HF order): it starts at ``offsets`` of the full tensor and spans ``tensor.shape``."""

    index: int
    offsets: tuple[int, ...]
    tensor: torch.Tensor


class Layout(str):
    """A TP layout kind: how one Megatron parameter's TP shards hold the HF tensors it fuses.

    The instance *is* its name (``"qkv"``, ``"glu"``...: what tables, digests and errors show);
    the behaviour is the class's: ``dim`` (the tensor dim along which TP shards are ``torch.chunk``
    pieces of the HF tensors; None: every TP rank holds all of it), ``split`` (one shard, or the
    tp=1 tensor, into its piece of each HF tensor), ``concat`` (every shard into the full HF
    tensors), ``boxes`` (where one shard's split sits inside the full HF tensors), ``shard_shape``
    and ``split_copies`` (whether ``split`` copies its input). The collective plumbing stays out of
    them.
    """

    dim: int | None = None
    #: ``split`` writes new memory (as many bytes as its input) rather than returning views.
    split_copies: bool = False
    #: TP shard ``r``'s split is chunk ``r`` of each HF tensor (``torch.chunk`` along ``dim``), so
    #: ``mode="local"`` can declare it ``Shard(dim)``; False: only ``concat`` of every shard is.
    chunked: bool = True
    #: ``to_wire`` changes values (not only the dtype): never batched into a plain cast.
    shifts_values: bool = False
    #: ``boxes`` places any TP shard's values in the HF tensors; False: a consumer must gather the
    #: shards and ``concat`` them (every kind here can; a new kind opts out until it can).
    boxed: bool = True

    def __new__(cls, name: str) -> "Layout":
        return super().__new__(cls, name)

    def to_wire(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The parameter (or its shard) as it travels: cast to the wire ``dtype`` (before any split)."""
        return t if t.dtype == dtype else t.to(dtype)

    def split(self, shard: torch.Tensor, **geometry: Any) -> tuple[torch.Tensor, ...]:
        """This shard's piece of each HF tensor, in HF order (contiguous)."""
        return (shard.contiguous(),)

    def concat(self, shards: list[torch.Tensor], **geometry: Any) -> tuple[torch.Tensor, ...]:
        """Full HF tensors from every TP shard, in TP order (one shard for a replicated kind).
        Vocabulary shards must already be trimmed to their HF rows (``vocab_rows``)."""
        if self.dim is None and len(shards) != 1:
            raise ValueError(f"a replicated parameter takes one shard, got {len(shards)}")
        if len(shards) == 1:
            # tp=1: the local split is already the HF tensors (views where the layout allows, e.g.
            # gate/up halves): a torch.cat of one tensor would copy every byte for nothing.
            return tuple(self.split(shards[0], **geometry))
        pieces = [self.split(s, **geometry) for s in shards]
        return tuple(torch.cat([p[i] for p in pieces], dim=self.dim) for i in range(len(pieces[0])))

    def boxes(
        self, shard: torch.Tensor, *, full: tuple[tuple[int, ...], ...], tp: int, tp_rank: int, **geometry: Any
    ) -> tuple[Box, ...]:
        """TP shard ``tp_rank`` of ``tp`` (already ``to_wire``; vocabulary shards trimmed or not) as
        boxes of the HF tensors of shapes ``full``, grouped by HF tensor in HF order.

        Invariant: over ``tp_rank = 0 .. tp-1`` the boxes tile every HF tensor exactly once -- for a
        kind with ``dim is None`` every TP rank holds all of it, so the boxes of *any one* rank tile
        it (the caller picks which rank answers). The values are the bytes ``concat`` puts there:
        the split of one shard is chunk ``tp_rank`` of each HF tensor along ``dim`` (the module
        invariant), so its start is ``chunk_rows``'. A piece that is not that chunk raises naming
        the kind, rank and HF tensor, instead of placing values where ``concat`` would not."""
        if self.dim is not None and not self.chunked and tp > 1:
            raise NotImplementedError(f"{self}: TP shards are not chunks of the HF tensors; override boxes()")
        outs = self.split(shard, **geometry)
        if len(outs) != len(full):
            raise ValueError(f"{self}: the split of TP shard {tp_rank} gives {len(outs)} tensors, HF has {len(full)}")
        out = []
        for i, (t, shape) in enumerate(zip(outs, full)):
            offsets = [0] * len(shape)
            want = list(shape)
            if self.dim is not None:
                offsets[self.dim], want[self.dim] = chunk_rows(shape[self.dim], tp, tp_rank)
            if list(t.shape) != want:
                raise ValueError(
                    f"{self}: TP shard {tp_rank} of {tp} splits into a {tuple(t.shape)} piece of HF tensor {i} "
                    f"{tuple(shape)}; its torch.chunk piece is {tuple(want)} at {tuple(offsets)}"
                )
            out.append(Box(i, tuple(offsets), t))
        return tuple(out)

    def shard_shape(self, full: tuple[tuple[int, ...], ...], tp: int) -> tuple[int, ...]:
        """The Megatron parameter's shape on one TP rank, from the full HF shapes it fuses (HF order):
        the fused tensor stacks them along dim 0; dim-0 kinds hold ``1/tp`` of its rows."""
        rows = sum(s[0] for s in full)
        rest = tuple(full[0][1:])
        return (rows, *rest) if self.dim is None else (rows // tp, *rest)


class Replicated(Layout):
    """Every TP rank holds the whole tensor (norms, row-parallel biases, duplicated linears)."""


class Column(Layout):
    """Column-parallel: TP shard ``r`` is rows chunk ``r``."""

    dim = 0


class Row(Layout):
    """Row-parallel: TP shard ``r`` is columns chunk ``r`` of its one HF tensor."""

    dim = 1

    def shard_shape(self, full: tuple[tuple[int, ...], ...], tp: int) -> tuple[int, ...]:
        if len(full) != 1:
            raise ValueError(f"a row-parallel ({self}) parameter holds one HF tensor, got {len(full)}")
        rows, cols, *rest = full[0]
        return (rows, cols // tp, *rest)


class QKV(Column):
    """``linear_qkv``: rows ``[q x heads_per_group, k, v] x groups`` (``split_qkv``)."""

    split_copies = True

    def split(self, shard: torch.Tensor, *, heads_per_group: int = 0, head_dim: int = 0, **_: Any):
        return split_qkv(shard, heads_per_group=heads_per_group, head_dim=head_dim)

    def concat(self, shards: list[torch.Tensor], *, heads_per_group: int = 0, head_dim: int = 0, **_: Any):
        # Shards hold whole query groups in order: their concatenation is the full fused tensor,
        # and one split of it (one gather) replaces a split per shard plus a cat per output.
        whole = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        return split_qkv(whole, heads_per_group=heads_per_group, head_dim=head_dim)


class GLU(Column):
    """Gated ``linear_fc1``: each shard is ``[gate_r; up_r]`` (``split_glu``)."""

    def split(self, shard: torch.Tensor, **_: Any):
        return split_glu(shard)


class Stack(Layout):
    """Stacked rows of HF tensors of different sizes, duplicated over TP (``split_stack``)."""

    def split(self, shard: torch.Tensor, *, stack_rows: tuple[int, ...] = (), **_: Any):
        return split_stack(shard, rows=stack_rows)


class StackColumn(Stack):
    """Stacked rows, column-parallel: TP shard ``r`` is ``[A_r; B_r]``."""

    dim = 0


class QKVGated(QKV):
    """Gated-attention ``linear_qkv``: rows ``[q x hpg, gate x hpg, k, v] x groups`` (``split_gated_qkv``)."""

    def split(self, shard: torch.Tensor, *, heads_per_group: int = 0, head_dim: int = 0, **_: Any):
        return split_gated_qkv(shard, heads_per_group=heads_per_group, head_dim=head_dim)

    def concat(self, shards: list[torch.Tensor], *, heads_per_group: int = 0, head_dim: int = 0, **_: Any):
        whole = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        return split_gated_qkv(whole, heads_per_group=heads_per_group, head_dim=head_dim)


class GatedDeltaNet(Column):
    """megatron-core ``GatedDeltaNet``'s column-parallel tensors whose TP shards are *blocks*, each
    block chunked over TP separately: ``in_proj`` = ``[q_r | k_r | v_r | z_r | beta_r | alpha_r]``,
    ``conv1d`` = ``[q_r | k_r | v_r]`` (``gdn_heads = (key heads, key head dim, value heads, value
    head dim)``, from the layer's ``forward`` split and its ``sharded_state_dict``). ``fmt`` names the
    HF tensors they become:

    * ``"qkvz_ba"`` (Qwen3-Next): ``in_proj_qkvz`` rows per key head ``g`` = ``[q_g, k_g, v_g*, z_g*]``
      (``*``: the ``nv/nk`` value heads of key head ``g``), ``in_proj_ba`` per key head
      ``[b_g*, a_g*]`` (``fix_query_key_value_ordering``). Key heads are whole per TP rank, so a
      shard's split is chunk ``r`` of both.
    * ``"qkv_z_b_a"`` (Qwen3.5): ``in_proj_qkv`` = ``[q; k; v]`` over *all* heads, ``in_proj_z``,
      ``in_proj_b`` (beta), ``in_proj_a`` (alpha). ``in_proj_qkv``'s rows of rank ``r`` are three
      separate chunks: not chunked, ``concat`` regroups every shard.
    * ``"conv"``: ``conv1d.weight`` ``[q; k; v]`` channels (both families), likewise regrouped.
    """

    split_copies = True

    def __new__(cls, name: str, fmt: str) -> "GatedDeltaNet":
        obj = super().__new__(cls, name)
        obj.fmt = fmt
        obj.chunked = fmt == "qkvz_ba"
        return obj

    def _blocks(self, shard: torch.Tensor, heads: tuple[int, int, int, int], full_rows: int):
        nk, dk, nv, dv = heads
        whole = 2 * nk * dk + nv * dv + (nv * dv + 2 * nv if self.fmt != "conv" else 0)
        if whole != full_rows or shard.shape[0] == 0 or whole % shard.shape[0]:
            raise ValueError(
                f"{self}: a shard of {shard.shape[0]} rows is not a TP share of the gated delta net's "
                f"{whole} rows (key heads {nk} x {dk}, value heads {nv} x {dv}); HF shapes give {full_rows}"
            )
        tp = whole // shard.shape[0]
        sizes = [nk * dk // tp, nk * dk // tp, nv * dv // tp]
        if self.fmt != "conv":
            sizes += [nv * dv // tp, nv // tp, nv // tp]
        return torch.split(shard, sizes, dim=0), tp

    def _grouped(self, b: tuple[torch.Tensor, ...], heads: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
        nk, dk, nv, dv = heads
        q, k, v, z, beta, alpha = b
        g = q.shape[0] // dk  # this shard's key heads
        r = nv // nk
        rest = q.shape[1:]
        qkvz = torch.cat([q.reshape(g, dk, *rest), k.reshape(g, dk, *rest), v.reshape(g, r * dv, *rest),
                          z.reshape(g, r * dv, *rest)], 1).reshape(-1, *rest)
        ba = torch.cat([beta.reshape(g, r, *rest), alpha.reshape(g, r, *rest)], 1).reshape(-1, *rest)
        return qkvz, ba

    def split(self, shard: torch.Tensor, *, gdn_heads: tuple[int, int, int, int] = (0, 0, 0, 0),
              stack_rows: tuple[int, ...] = (), **_: Any):
        b, tp = self._blocks(shard, gdn_heads, sum(stack_rows))
        if self.fmt == "qkvz_ba":
            return self._grouped(b, gdn_heads)
        if tp != 1:  # rank r's [q_r; k_r; v_r] is no chunk of HF's [q; k; v]
            raise ValueError(f"{self}: one TP shard of {tp} is not a piece of any HF tensor; concat every shard")
        if self.fmt == "conv":
            return (shard.contiguous(),)
        q, k, v, z, beta, alpha = b
        return torch.cat([q, k, v]), z.contiguous(), beta.contiguous(), alpha.contiguous()

    def concat(self, shards: list[torch.Tensor], *, gdn_heads: tuple[int, int, int, int] = (0, 0, 0, 0),
               stack_rows: tuple[int, ...] = (), **geometry: Any):
        if self.fmt == "qkvz_ba" or len(shards) == 1:
            return super().concat(shards, gdn_heads=gdn_heads, stack_rows=stack_rows, **geometry)
        blocks = [self._blocks(s, gdn_heads, sum(stack_rows))[0] for s in shards]
        full = [torch.cat([b[i] for b in blocks]) for i in range(len(blocks[0]))]  # q, k, v (, z, beta, alpha)
        if self.fmt == "conv":
            return (torch.cat(full),)
        return (torch.cat(full[:3]), *full[3:])

    def boxes(self, shard: torch.Tensor, *, full: tuple[tuple[int, ...], ...], tp: int, tp_rank: int,
              gdn_heads: tuple[int, int, int, int] = (0, 0, 0, 0), stack_rows: tuple[int, ...] = (),
              **geometry: Any) -> tuple[Box, ...]:
        """Chunked (``qkvz_ba``) or tp=1: ``Layout.boxes``. Otherwise one box per block: rank ``r``'s
        q, k and v blocks are chunk ``r`` of the q, k and v parts of the flat ``[q; k; v]`` (HF
        tensor 0: ``in_proj_qkv`` or ``conv1d``), at those parts' starts; z, beta and alpha are chunk
        ``r`` of ``in_proj_z`` / ``_b`` / ``_a`` -- where ``concat`` puts them."""
        if self.chunked or tp == 1:
            return super().boxes(shard, full=full, tp=tp, tp_rank=tp_rank, gdn_heads=gdn_heads,
                                 stack_rows=stack_rows, **geometry)
        blocks, n = self._blocks(shard, gdn_heads, sum(stack_rows))
        if n != tp:
            raise ValueError(f"{self}: a shard of {shard.shape[0]} rows is 1/{n} of the gated delta net, not 1/{tp}")
        nk, dk, nv, dv = gdn_heads
        rest = (0,) * (shard.dim() - 1)
        parts = [(0, 0, nk * dk), (0, nk * dk, nk * dk), (0, 2 * nk * dk, nv * dv)]  # (HF tensor, start, size)
        if self.fmt != "conv":
            parts += [(1, 0, nv * dv), (2, 0, nv), (3, 0, nv)]
        if len(full) != len({i for i, _, _ in parts}):
            raise ValueError(f"{self}: {len(full)} HF tensors, the layout has {len({i for i, _, _ in parts})}")
        return tuple(Box(i, (base + chunk_rows(size, tp, tp_rank)[0], *rest), b)
                     for (i, base, size), b in zip(parts, blocks))

    def shard_shape(self, full: tuple[tuple[int, ...], ...], tp: int) -> tuple[int, ...]:
        return (sum(s[0] for s in full) // tp, *full[0][1:])


class Shifted(Replicated):
    """A replicated norm weight stored as ``hf - shift``: ``to_wire`` adds ``shift`` in fp32, then
    casts once (the gated-delta-net output norm of a zero-centered-gamma model: HF ``x * w``,
    megatron ``x * (1 + w)``)."""

    shifts_values = True

    def __new__(cls, name: str, shift: float) -> "Shifted":
        obj = super().__new__(cls, name)
        obj.shift = shift
        return obj

    def to_wire(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (t.to(torch.float32) + self.shift).to(dtype)


class IndexerRope(Replicated):
    """DSA indexer rows, duplicated over TP: each ``head_dim``-row block permuted from megatron's
    rope channel placement to transformers' (``indexer_rope_rows``; ``indexer_rope = (index_head_dim,
    qk_rope_head_dim, megatron_rope)`` from the family's ``layout_kw``, which reads the placement off
    the Megatron config)."""

    split_copies = True

    def __new__(cls, name: str, pairing: str) -> "IndexerRope":
        obj = super().__new__(cls, name)
        obj.pairing = pairing
        return obj

    def __reduce__(self) -> tuple:
        return layout, (str(self),)  # unpickles to the registered kind

    def split(self, shard: torch.Tensor, *, indexer_rope: tuple = (0, 0), **_: Any):
        d, r, *where = indexer_rope
        if not d or shard.shape[0] % d:
            raise ValueError(f"{self}: {shard.shape[0]} rows are not whole indexer heads of {d} channels")
        per = indexer_rope_rows(d, r, self.pairing, *where)
        idx = (torch.arange(shard.shape[0] // d)[:, None] * d + per[None]).reshape(-1)
        return (shard.index_select(0, idx.to(shard.device)),)


class Vocab(Column):
    """Vocabulary-parallel embedding / output layer: rows padded, then split evenly over TP."""

    def shard_shape(self, full: tuple[tuple[int, ...], ...], tp: int) -> tuple[int, ...]:
        raise ValueError("vocabulary shards depend on the padded vocabulary, not on the HF shapes")

    def boxes(self, shard: torch.Tensor, *, full: tuple[tuple[int, ...], ...], tp: int, tp_rank: int,
              padded_vocab: int = 0, **_: Any) -> tuple[Box, ...]:
        """The HF rows ``[start, stop)`` this shard holds (``vocab_rows``) as one box at row
        ``start``; none for a shard of padding only. ``shard``: trimmed to those rows or not."""
        start, stop = vocab_rows(full[0][0], padded_vocab, tp, tp_rank)
        if shard.shape[0] not in (stop - start, padded_vocab // tp) or tuple(shard.shape[1:]) != tuple(full[0][1:]):
            raise ValueError(
                f"{self}: TP shard {tp_rank} of {tp} has shape {tuple(shard.shape)}; the padded vocabulary "
                f"{padded_vocab} gives {padded_vocab // tp} rows, {stop - start} of them HF rows of {tuple(full[0])}"
            )
        if stop == start:
            return ()
        return (Box(0, (start, *(0 for _ in full[0][1:])), shard[: stop - start]),)


REPLICATED, COLUMN, ROW = Replicated("replicated"), Column("column"), Row("row")
QKV_LAYOUT, GLU_LAYOUT = QKV("qkv"), GLU("glu")
STACK, STACK_COLUMN, VOCAB = Stack("stack"), StackColumn("stack_column"), Vocab("vocab")
QKV_GATED = QKVGated("qkv_gated")
GDN_QKVZ_BA = GatedDeltaNet("gdn_qkvz_ba", "qkvz_ba")
GDN_QKV_Z_B_A = GatedDeltaNet("gdn_qkv_z_b_a", "qkv_z_b_a")
GDN_CONV = GatedDeltaNet("gdn_conv", "conv")
SHIFTED_PLUS_ONE = Shifted("replicated_plus_one", 1.0)
INDEXER_ROPE_HALF = IndexerRope("indexer_rope_half", "half")
INDEXER_ROPE_INTERLEAVED = IndexerRope("indexer_rope_interleaved", "interleaved")
#: every kind by the name family tables use.
KINDS: dict[str, Layout] = {k: k for k in (
    REPLICATED, COLUMN, ROW, QKV_LAYOUT, GLU_LAYOUT, STACK, STACK_COLUMN, VOCAB,
    QKV_GATED, GDN_QKVZ_BA, GDN_QKV_Z_B_A, GDN_CONV, SHIFTED_PLUS_ONE,
    INDEXER_ROPE_HALF, INDEXER_ROPE_INTERLEAVED,
)}


def layout(name: str) -> Layout:
    """The kind a table names; ``ValueError`` for a name no class owns."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown layout kind {name!r}; known: {sorted(KINDS)}") from None
