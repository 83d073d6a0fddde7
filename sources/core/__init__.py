"""The contract every source shares: errors, the per-rank stream check and cross-rank agreement,
bounded waits, the wire-dtype policy, layout kinds, checkpoint naming, expert transforms, the p2p mover
and pass statistics. Nothing here knows a trainer framework."""
