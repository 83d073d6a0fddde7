"""``MegatronSource``: a megatron-core ``GPTModel`` (TP / PP / VPP / EP, dense, MoE, MLA, MTP) as Hugging
Face checkpoint tensors.

* ``source``      -- ``MegatronSource`` itself: construction, metadata, the passes (``iter_full``,
  ``iter_local``, ``iter_pieces``) as loops over the plan's steps.
* ``checks``      -- the construction checks: arguments, topology, the model against ``hf_config``
  and its family, parameter binding; raised on every rank before any byte moves.
* ``plan``        -- the export plan: every HF tensor, its stage, its TP layout (from the family table).
* ``walk``        -- this rank's Megatron parameters by (layer, local-spec name), wrappers removed, and
  which of them each part (policy, MTP draft) exports.
* ``topology``    -- this rank's parallel coordinates and every replica's stage TP ranks.
* ``units``       -- this rank's dense units: shards, wire dtypes, vocabulary rows, senders, and the
  point-to-point gather of a unit's TP shards to its sender.
* ``whole_units`` -- rank 0's communication-free export of the units it holds whole (tp=1 stages,
  replicated norms); unrelated to ``mode="local"``.
* ``gathered``    -- one full pass's units that move: posted, looked ahead (overlap), concatenated.
* ``ahead``       -- the lookahead's byte budget and the helper thread that concatenates ahead (CPU).
* ``moe``         -- ``MegatronMoEExporter``: MoE layers (router, expert bias, routed and shared
  experts) gathered to their sender in bounded batches; ``moe_storage`` -- where megatron-core keeps
  a rank's expert tensors; ``moe_placement`` -- which rank holds and which sends each MoE tensor;
  ``moe_names`` -- the layers' HF names (transformers' own reversal).
* ``mla``         -- multi-head latent attention as DeepSeek-V3 attention: geometry checks, TP kinds.
* ``pieces``      -- the pieces protocol (delta sync): each rank's shards as boxes of the checkpoint
  tensors, fed by the source's explicit ``MegatronPiecesView``.

What it may import (``pyproject.toml``'s import contracts, ``bash .ci/layers``): ``sources/families``
and ``sources/core`` only -- never another source (fsdp, checkpoint), a stream transform (quant,
delta) or the plugins; megatron-core itself only inside the functions that read ``parallel_state``.
Family facts (names, config mapping, refusals) live in ``sources/families/``, layout kinds in
``sources/core/layouts/tp.py``, the point-to-point mover in ``sources/core/comm/p2p.py``.
"""

from .source import MegatronSource

__all__ = ["MegatronSource"]
