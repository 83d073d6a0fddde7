"""The CPU loopback transport, trainer end: the ``"loopback"`` engine for vLLM's
``WeightTransferTrainerFactory``. Importing this package registers it::

    import weightsync.plugins.loopback  # registers backends "loopback" and "loopback_sparse"

The receiving end (the receiver, its HTTP server and process, and the transport both ends share)
is ``weightsync.plugins.loopback_server``, a separate package because it must not import vLLM: a
receiver process imports in ~2 s instead of ~9 s (measured on a busy 2-core box). A test and demo transport, not a replacement for
vLLM's NCCL / IPC engines.
"""

from __future__ import annotations

from . import sparse as _sparse
from .engine import BACKEND, LoopbackTrainerInitInfo, LoopbackTrainerWeightTransferEngine, register
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

register()
_sparse.register()
