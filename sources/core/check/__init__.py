"""The contract's enforcement: the per-rank stream check and cross-rank metadata agreement
(``stream``), end-to-end integrity checksums (``integrity``). May import every other wing of ``core``."""
