"""The sync driver: ``WeightSync`` (one per trainer rank: pause, send, commit a version, resume),
the vLLM HTTP control-plane client it talks through (and ``RayDraftWeightSyncClient``: vLLM's Ray
client with the draft model's start), the transport preflight it runs before the
first byte moves, and the per-sync report it returns.

Importing this package imports vLLM (the driver and the HTTP client subclass vLLM's types).
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
