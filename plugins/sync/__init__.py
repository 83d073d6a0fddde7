"""The sync driver and what it talks through. One idea per module:

* ``driver``       -- ``WeightSync`` (one per trainer rank): the lifecycle -- build the engine, pause,
  send, commit a version, resume, agree on every outcome, report -- and ``LateSync``;
* ``dense_pass``   -- the dense send phase (``send_weights``, many senders' turns, the draft round,
  finishing a failed pass for the peers);
* ``delta_rounds`` -- the delta send phase (a ``DeltaSource``'s rounds through a sparse engine);
* ``capabilities`` -- every capability flag and optional hook the driver reads from an engine or its
  init info, declared once, with the accessors the driver uses;
* ``clients``      -- the client an engine sees (the commit's ``weight_version`` added; the draft's start);
* ``outcomes``     -- running a phase and agreeing its outcome across ranks;
* ``http_client``  -- ``VLLMHTTPClient``, vLLM's HTTP control plane fanned out to every server;
  ``versions``: which payload fields each server's vLLM parses;
* ``ray_client``   -- ``RayDraftWeightSyncClient``: vLLM's Ray client plus the draft model's start;
* ``preflight``    -- the transport preflight run before the first byte moves;
* ``report``       -- ``SyncReport``, what one sync did.

May import: ``weightsync.sources`` and ``weightsync.sources.toolkit``, vLLM, and ``plugins.testbed``
(the layer below); never ``lora_adapter`` (its sibling layer) nor anything above (``hooks``,
``loopback``, ``checkpoint``, ``planner``, ``cli``), which build on it. Importing this package imports
vLLM (the driver and the HTTP client subclass vLLM's types).
"""

from __future__ import annotations

from .driver import PAUSE_MODES, LateSync, WeightSync
from .http_client import ControlPlaneError, InsecureTransportError, ServerVersionError, VLLMHTTPClient
from .preflight import PreflightError, PreflightReport, check_engine, check_weights_changed
from .ray_client import RayDraftWeightSyncClient
from .report import SyncReport

__all__ = [
    "PAUSE_MODES",
    "ControlPlaneError",
    "InsecureTransportError",
    "LateSync",
    "PreflightError",
    "PreflightReport",
    "RayDraftWeightSyncClient",
    "ServerVersionError",
    "SyncReport",
    "VLLMHTTPClient",
    "WeightSync",
    "check_engine",
    "check_weights_changed",
]
