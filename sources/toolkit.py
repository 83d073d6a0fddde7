"""weightsync.sources.toolkit: what ``weightsync.plugins`` builds on, besides the sources themselves.

``weightsync.sources`` holds what a user imports (the sources, the stream transforms, the check and the
errors); this module holds the plumbing a driver, a transport, the checkpoint writer or the CLI needs
from the sources' side and that a training loop never touches: bounded cross-rank waits and the
failure board, integrity checksums, Hugging Face naming, the safetensors format, the model families'
lookup, the transfer group of many senders, the "is this a multi-rank run?" test, and ``lazy_exports``
(how this module and the plugins' packages export their names lazily).

The import contracts (``pyproject.toml``) let plugins import ``weightsync.sources`` and this module,
never the sub-packages behind them. Names load lazily (PEP 562): importing the toolkit costs nothing
until a name is used. To export another name, add one line to ``_LAZY``.
"""

from __future__ import annotations

from .core.ground.lazy import lazy_exports

_LAZY: dict[str, str] = {
    # ranks, logging, bounded waits and the failure board (sources/core/ground, sources/core/comm)
    "multi_rank": "weightsync.sources.core.ground.ranks",
    "get_logger": "weightsync.sources.core.ground.logs",
    "DEFAULT_TIMEOUT_S": "weightsync.sources.core.comm.waits",
    "Board": "weightsync.sources.core.comm.waits",
    "active_board": "weightsync.sources.core.comm.waits",
    "group_ranks": "weightsync.sources.core.comm.waits",
    "next_tag": "weightsync.sources.core.comm.waits",
    "control_group": "weightsync.sources.core.check.stream",
    # many senders (vLLM 0.34's NCCL engine): who is in the transfer group
    "broadcast_ranks": "weightsync.sources.core.comm.senders",
    # what a source declares it can do (sources/core/protocols.py): read from the object, never forwarded
    "checks_stream": "weightsync.sources.core.protocols",
    "senders_of": "weightsync.sources.core.protocols",
    "is_round_source": "weightsync.sources.core.protocols",
    # integrity checksums (sources/core/check/integrity.py)
    "checksum": "weightsync.sources.core.check.integrity",
    "checksum_tensor": "weightsync.sources.core.check.integrity",
    # Hugging Face naming, the safetensors format, the model families
    "hf_root": "weightsync.sources.core.hf.naming",
    "INDEX_FILE": "weightsync.sources.checkpoint.format",
    "SINGLE_FILE": "weightsync.sources.checkpoint.format",
    "MAX_HEADER_BYTES": "weightsync.sources.checkpoint.format",
    "SAFETENSORS_DTYPES": "weightsync.sources.checkpoint.format",
    "read_checkpoint": "weightsync.sources.checkpoint.format",
    "family_for": "weightsync.sources.families",
    "model_types": "weightsync.sources.families",
    "tp_split_dim": "weightsync.sources.megatron.walk",
}

__all__ = sorted([*_LAZY, "lazy_exports"])

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
