"""The loopback's trainer end: the ``"loopback"`` engine and the ``"loopback_sparse"`` engine (delta
rounds) for vLLM's ``WeightTransferTrainerFactory``. Importing this package registers both
(``weightsync.plugins.loopback``'s trainer names import it)::

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo  # registers the engines

* ``engine`` -- the dense engine (``LoopbackTrainerInitInfo``, ``LoopbackTrainerWeightTransferEngine``);
* ``sparse`` -- the sparse engine (``LoopbackSparseTrainerInitInfo``, ...), vLLM ``sparse_nccl``'s protocol;
* ``sender`` -- what both engines' sender shares: opening the transport, the update RPC beside it.

May import: vLLM, ``weightsync.sources`` and its ``toolkit``, ``..receiver`` (the transport both ends
agree on), and ``weightsync.plugins.sync.capabilities`` (the flags its init infos declare). The
receiving end is ``weightsync.plugins.loopback.receiver`` (no vLLM: a receiver process starts
without paying its import).
"""

from __future__ import annotations

from . import sparse as _sparse
from .engine import BACKEND, LoopbackTrainerInitInfo, LoopbackTrainerWeightTransferEngine
from .engine import register as _register_dense
from .sparse import SPARSE_BACKEND, LoopbackSparseTrainerInitInfo, LoopbackSparseTrainerWeightTransferEngine

__all__ = [
    "BACKEND",
    "SPARSE_BACKEND",
    "LoopbackTrainerInitInfo",
    "LoopbackTrainerWeightTransferEngine",
    "LoopbackSparseTrainerInitInfo",
    "LoopbackSparseTrainerWeightTransferEngine",
    "register",
]



def register() -> None:
    """Register ``"loopback"`` and ``"loopback_sparse"`` in vLLM's ``WeightTransferTrainerFactory``
    (idempotent; importing this package already did)."""
    _register_dense()
    _sparse.register()


register()
