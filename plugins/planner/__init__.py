"""``weightsync plan``: what a refit of a model moves and costs, predicted on CPU in seconds.

* ``refit`` -- ``plan(model, layout=..., backend=...)`` -> ``RefitPlan``: the model on the meta
  device, the sources' own metadata, per-rank counts, a time split into parts;
* ``counts`` -- per-rank ``PassStats`` of FSDP2 / HSDP / Megatron passes, from metadata and layout;
* ``constants`` -- every rate and per-tensor cost the time estimate uses, each with its bench run
  (or marked as an assumption): the only place the estimate's numbers live;
* ``render`` -- the CLI's table.

May import: ``weightsync.sources`` (public names and ``toolkit``) and ``plugins.testbed`` (the
presets a model name may be); counts come from the sources' metadata and plans, never from a run.
Never ``cli`` (which renders it), nor ``hooks``, ``checkpoint``, ``loopback`` beside it.
"""

from __future__ import annotations

from .constants import CONSTANTS, Constant
from .counts import RankCounts
from .refit import BACKENDS, DEFAULT_WIRE_GBPS, RefitPlan, SourcePlan, plan
from .render import render

__all__ = ["plan", "RefitPlan", "SourcePlan", "RankCounts", "Constant", "CONSTANTS", "BACKENDS",
           "DEFAULT_WIRE_GBPS", "render"]
