"""The ground floor: errors, rank-aware logging, pass statistics, the wire-dtype policy, the overlap
switch and ``multi_rank()``. Imports nothing else of weightsync; everything else may import it."""
