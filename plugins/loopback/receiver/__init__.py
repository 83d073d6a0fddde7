"""The loopback's receiving end: what stands in for a vLLM server in tests and the demo.

* ``receiver.LoopbackReceiver`` -- a ``torch.nn.Module`` that receives weights like a vLLM worker
  (vLLM's four-phase protocol, strict names / dtypes / shapes, optional wire checksums);
* ``server`` -- vLLM's dev-mode HTTP routes in front of a receiver (``ReceiverServer``);
* ``client`` -- a client for them (``ReceiverClient``), stdlib only;
* ``process`` -- ``start_receiver_process`` (a receiver in its own process) and its ``ReceiverHandle``;
* ``tensors_model.TensorsModel`` -- a module holding named tensors only (e.g. a draft model's MTP
  tensors, ``LoopbackReceiver(model, draft=...)``);
* ``transport`` -- what the trainer end (``loopback.trainer``), the worker (``loopback.worker``) and
  the receiver agree on: the private gloo group, the chunk plan, the wire fields;
* ``receiving`` -- the receiving end of a dense chunk (validation, go/no-go handshake, chunk plan,
  checksums): the one implementation this receiver and the vLLM worker engine use.

May import: torch, ``weightsync.sources`` and its ``toolkit``; never ``trainer/`` or ``worker/`` (they
build on it), and never vLLM at import time (an import-linter ``forbidden`` contract in
``pyproject.toml``), so a receiver process does not pay its import. Two uses of vLLM's own code as
the oracle (the sparse apply of a delta round, the dev-mode ``/weight_checker`` route) import it
inside the function, on first use.
"""

from __future__ import annotations

from .receiver import ChecksumMismatchError, LoopbackReceiver
from .client import ReceiverClient
from .process import ReceiverHandle, start_receiver_process
from .server import ReceiverServer
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
