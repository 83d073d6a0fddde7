"""What every source shares, in wings by concern. Nothing here knows a trainer framework.

* ``ground/``  -- errors, rank-aware logging, pass statistics, the wire-dtype policy, the overlap switch,
  ``multi_rank()``. Imports nothing else of weightsync.
* ``comm/``    -- collectives that never wait forever: bounded waits and the failure board, the
  point-to-point "gather to one rank" mover, who sends (one sender or many). On ``ground``.
* ``hf/``      -- Hugging Face knowledge: checkpoint names of a wrapped module, transformers' save-time
  conversions, routed-expert layouts, tensors a vLLM loader writes into. On ``ground``.
* ``layouts/`` -- where values sit: Megatron's TP layout kinds (``tp``) and the pieces protocol
  (``pieces``: a rank's boxes of the checkpoint tensors, what delta diffs). On ``ground``.
* ``protocols`` -- what a source or transform declares it can do (``checks_stream``, ``senders``, the
  delta round API) and one accessor per capability, read from the object, never forwarded. On
  ``layouts``.
* ``check/``   -- the contract's enforcement: the per-rank stream check, cross-rank metadata
  agreement, integrity checksums. On all of the above.

The layering (``check`` > ``protocols`` > ``comm | hf | layouts`` > ``ground``) is an import-linter contract in
``pyproject.toml``: no back arrows, no cycles.
"""
