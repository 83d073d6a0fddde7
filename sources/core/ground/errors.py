"""The errors weightsync raises.

Every error that can come from a multi-rank pass names the rank that raised it; errors about one
parameter name that parameter. They subclass ``ValueError``/``RuntimeError`` so callers that already
catch vLLM's own errors (which are ``ValueError`` for metadata disagreements) keep working.
"""

from __future__ import annotations

__all__ = [
    "WeightSyncError",
    "MetadataMismatchError",
    "CrossRankMismatchError",
    "SyncTimeoutError",
    "UnmappedParameterError",
    "SilentTransportError",
    "PeerFailedError",
    "IntegrityError",
    "PreflightError",
    "UnsupportedAdapterError",
    "AdapterStateError",
    "CheckpointError",
    "ExchangeError",
    "FP8ConfigError",
]


class WeightSyncError(RuntimeError):
    """Base class of weightsync's own errors."""


class MetadataMismatchError(WeightSyncError, ValueError):
    """A source yielded something its ``metadata`` did not declare (name, order, dtype, shape, count,
    contiguity)."""


class CrossRankMismatchError(WeightSyncError, ValueError):
    """Trainer ranks disagree about ``metadata`` (another config, another wrapping order)."""


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A weightsync collective did not complete in time; the message names the late rank(s)."""


class UnmappedParameterError(WeightSyncError, ValueError):
    """A trainer parameter has no Hugging Face checkpoint name under the chosen family/mapping."""


class SilentTransportError(WeightSyncError):
    """The transport would report success without moving bytes (e.g. vLLM's NCCL communicator
    disabled itself because the NCCL library is too old)."""


class PeerFailedError(WeightSyncError):
    """Another rank failed during this pass; the message quotes that rank's own error."""


class IntegrityError(WeightSyncError):
    """What a receiver holds differs from what the trainer sent (names the first parameter)."""


class PreflightError(WeightSyncError, ValueError):
    """The engine cannot work as configured (no CUDA for IPC, a rank that does not own every
    parameter, a world size that cannot match the inference side)."""


class UnsupportedAdapterError(WeightSyncError, ValueError):
    """A PEFT model holds an adapter whose merged weights weightsync cannot compute exactly (DoRA,
    LoRA on embeddings, other tuners...): raised at construction, naming the module."""


class AdapterStateError(WeightSyncError, ValueError):
    """The adapter state (active adapters, disabled flags) changed after the source was built."""


class CheckpointError(WeightSyncError, ValueError):
    """A checkpoint folder cannot be read or written as asked (a missing or empty path, a truncated
    shard, a header that disagrees with the index, an unsupported dtype, a target that exists): the
    message names the file, the tensor and the rank."""


class ExchangeError(WeightSyncError, ValueError):
    """A value another rank posted in a cross-rank exchange on the store cannot be read (a store that
    returned garbage, a peer running another weightsync): the message names the exchange, the rank
    whose value it was and what was read."""


class FP8ConfigError(WeightSyncError, ValueError):
    """A quantization config weightsync cannot honour (not block-wise FP8 e4m3), or one the trainer's
    model disagrees with (a module the FP8 checkpoint quantizes that the model does not send, another
    scale shape), or a piecewise (``iter_local``) quantization that cannot be exact: names the
    parameter and the rank, raised on every rank before bytes move."""
