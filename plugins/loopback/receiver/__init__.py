"""The loopback's receiving end: what stands in for a vLLM server in tests and the demo.

* ``receiver.LoopbackReceiver`` -- a ``torch.nn.Module`` that receives weights like a vLLM worker
  (vLLM's four-phase protocol, strict names / dtypes / shapes, optional wire checksums);
* ``server`` -- vLLM's dev-mode HTTP routes in front of a receiver (``ReceiverServer``), a client for
  them (``ReceiverClient``) and ``start_receiver_process`` (a receiver in its own process);
* ``tensors_model.TensorsModel`` -- a module holding named tensors only (e.g. a draft model's MTP
  tensors, ``LoopbackReceiver(model, draft=...)``);
* ``transport`` -- what the trainer end (``loopback.trainer``), the worker (``loopback.worker``) and
  the receiver agree on: the private gloo group, the chunk plan, the wire fields;
* ``receiving`` -- the receiving end of a dense chunk (validation, go/no-go handshake, chunk plan,
  checksums): the one implementation this receiver and the vLLM worker engine use.

Invariant: nothing here imports vLLM (an import-linter ``forbidden`` contract in ``pyproject.toml``),
so a receiver process does not pay its import.
"""

from __future__ import annotations

from .receiver import ChecksumMismatchError, LoopbackReceiver
from .server import ReceiverClient, ReceiverHandle, ReceiverServer, start_receiver_process
from .tensors_model import TensorsModel

__all__ = [
    "ChecksumMismatchError",
    "LoopbackReceiver",
    "ReceiverClient",
    "ReceiverHandle",
    "ReceiverServer",
    "start_receiver_process",
    "TensorsModel",
]
