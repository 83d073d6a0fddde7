"""The CPU loopback transport, both ends: a test and demo transport that speaks vLLM's four-phase
weight-transfer protocol over gloo, not a replacement for vLLM's NCCL / IPC engines.

* ``trainer/``  -- the trainer end: the ``"loopback"`` and ``"loopback_sparse"`` (delta rounds) engines
  for vLLM's ``WeightTransferTrainerFactory``. Imports vLLM; importing it registers both engines.
* ``receiver/`` -- the receiving end: ``LoopbackReceiver`` (a module that loads strictly and checks
  checksums), its HTTP server, client and process, ``TensorsModel``, and the transport both ends
  agree on. **Never imports vLLM** (an import-linter contract): a receiver process starts without
  paying vLLM's import.
* ``worker/``   -- the worker engine a real vLLM server runs, and weightsync's vLLM plugin entry
  point that registers it.

May import: ``weightsync.sources`` and ``weightsync.sources.toolkit``, and the plugins' layers below it
(``sync``: the trainer end declares its engines' capabilities in ``sync.capabilities``;
``lora_adapter``, ``testbed``). Inside, ``trainer/`` and ``worker/`` build on ``receiver/``, never the
reverse (a ``layers`` contract).

This package imports nothing heavy at import time, so the receiver process (which must import it) stays
light. A trainer-end name (``LoopbackTrainerInitInfo``, ...) or ``register`` imports ``trainer/``,
which registers the engines in vLLM -- the info a ``trainer_init`` call needs therefore brings its
engine with it. Receiver names come from ``receiver/``.
"""

from __future__ import annotations

from weightsync.sources.toolkit import lazy_exports

_LAZY: dict[str, str] = {
    # trainer end (imports vLLM; registers "loopback" and "loopback_sparse" when first imported)
    "BACKEND": ".trainer",
    "SPARSE_BACKEND": ".trainer",
    "LoopbackTrainerInitInfo": ".trainer",
    "LoopbackTrainerWeightTransferEngine": ".trainer",
    "LoopbackSparseTrainerInitInfo": ".trainer",
    "LoopbackSparseTrainerWeightTransferEngine": ".trainer",
    "register": ".trainer",
    # receiving end (no vLLM)
    "LoopbackReceiver": ".receiver",
    "ChecksumMismatchError": ".receiver",
    "ReceiverServer": ".receiver",
    "ReceiverClient": ".receiver",
    "ReceiverHandle": ".receiver",
    "start_receiver_process": ".receiver",
    "TensorsModel": ".receiver",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
