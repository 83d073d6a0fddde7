"""The ``weightsync`` command line: ``demo``, ``check``, ``export``, ``plan`` (console script
``weightsync = weightsync.plugins.cli:run``: ``main`` then ``entry.exit_now``, so the process ends
right after the verdict instead of tearing torch down for seconds; also ``python -m weightsync.plugins.cli``).

* ``entry``    -- parse, validate, dispatch each command's rank code, exit codes;
* ``launch``   -- re-launch under torchrun for N ranks, the ranks' verdict file, Ctrl-C;
* ``validate`` -- the usage errors, checked before torch is imported;
* ``common``   -- what the commands share: the CPU process group, ``share`` (rank 0's value on every
  rank), rank 0's printer, bytes and layouts in words;
* ``loop``     -- the train-and-sync loop the three demos share (through ``WeightSync``) and their tally;
* ``demo`` / ``vllm_demo`` / ``delta`` -- the demos (loopback receiver, real vLLM server, delta rounds;
  ``delta`` also holds ``check --delta``);
* ``check`` / ``oracle`` -- ``check``'s rank code and report; the checkpoint indexes it judges against;
* ``export``   -- ``export``'s rank code (``save_safetensors``, or a PEFT adapter folder);
* ``build``    -- the model and source ``check`` and ``export`` run (FSDP2 or Megatron layout);
* ``plan``     -- ``weightsync plan``: one process, no ranks (``weightsync.plugins.planner``);
* ``progress`` -- rank 0's heartbeat: a line at least every few seconds while a command works.

A new command: its rank code in a module of its own, its parser in ``entry``, its usage errors in
``validate``. The top layer of ``weightsync.plugins``: may import every other plugins package and
``weightsync.sources`` (public names and ``toolkit``). Importing this package is cheap (argparse
only); each command imports what it needs when it runs.
"""

from __future__ import annotations

from .entry import main


def run() -> None:
    """The console script: ``main()``, then end the process at once with its exit code."""
    from .entry import exit_now

    exit_now(main())


__all__ = ["main", "run"]
