"""``weightsync.plugins.verl``: verl 0.9.1's actors feed weightsync's sources into its checkpoint engines.

A verl user names this module in ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``
and sets ``backend: weightsync`` (README "verl"). verl imports the module on the actor ranks, the
rollout workers and the manager; importing it

1. checks verl's layout (``layout.require_verl``: any verl but 0.9.1 raises ``ImportError`` naming it),
2. registers the ``weightsync`` checkpoint-engine backend (``backend.WeightSyncCheckpointEngine``),
3. installs the actor-side tap (``tap.install``): verl's ``actor.engine.get_per_tensor_param()``
   hands the engine to the backend, which streams ``FSDPSource`` / ``MegatronSource`` of it
   (``stream.engine_stream``) on every actor rank instead of verl's per-parameter export.

Options come from ``checkpoint_engine.engine_kwargs.weightsync`` (``options.VerlOptions``).
"""

from __future__ import annotations

from .layout import VERL_VERSION, require_verl

require_verl()

from .backend import WeightSyncCheckpointEngine  # noqa: E402  (registers "weightsync" with verl)
from .options import VerlOptions  # noqa: E402
from .stream import BadTensorError, engine_source, engine_stream  # noqa: E402
from .tap import EngineWeights, install  # noqa: E402

install()

__all__ = ["VERL_VERSION", "BadTensorError", "EngineWeights", "VerlOptions", "WeightSyncCheckpointEngine",
           "engine_source", "engine_stream", "install"]
