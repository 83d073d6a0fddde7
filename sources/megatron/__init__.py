"""``MegatronSource``: a megatron-core ``GPTModel`` (TP / PP / VPP / EP, dense, MoE, MLA) as Hugging
Face checkpoint tensors.

* ``source``      -- ``MegatronSource`` itself: metadata, the passes, the checks.
* ``plan``        -- the export plan: every HF tensor, its stage, its TP layout (from the family table).
* ``walk``        -- this rank's Megatron parameters by (layer, local-spec name), wrappers removed.
* ``topology``    -- this rank's parallel coordinates and its stage's TP ranks.
* ``whole_units`` -- rank 0's communication-free export of the units it holds whole (tp=1 stages,
  replicated norms); unrelated to ``mode="local"``.
* ``moe``         -- MoE layers: router, expert bias, routed and shared experts, bounded batches.
* ``mla``         -- multi-head latent attention as DeepSeek-V3 attention: geometry checks, TP kinds.

Family facts (names, config mapping, refusals) live in ``sources/families/``, layout kinds in
``sources/core/layouts/tp.py``, the point-to-point mover in ``sources/core/comm/p2p.py``.
"""

from .source import MegatronSource

__all__ = ["MegatronSource"]
