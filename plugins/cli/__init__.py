"""The ``weightsync`` command line: ``demo``, ``check``, ``export``, ``plan`` (console script
``weightsync = weightsync.plugins.cli:main``; also ``python -m weightsync.plugins.cli``).

* ``entry`` -- parse, validate, re-launch under torchrun for N ranks, dispatch, exit codes;
* ``validate`` -- the usage errors, checked before torch is imported;
* ``demo`` / ``check`` / ``export`` -- each command's rank code;
* ``build`` -- the model and source ``check`` and ``export`` run (FSDP2 or Megatron layout);
* ``plan`` -- ``weightsync plan``: one process, no ranks (``weightsync.plugins.planner``).

Importing this package is cheap (argparse only); each command imports what it needs when it runs.
"""

from __future__ import annotations

from .entry import main

__all__ = ["main"]
