"""``python -m weightsync.plugins.cli``: how the CLI re-runs itself under torchrun.

A rank exits as soon as its verdict is written: ``exit_now`` skips the interpreter's teardown of
torch, transformers and megatron-core (1-2 s of CPU per rank after ``PASS``, 7.6 s of idle wait for
a four-rank check on 2 cores), which holds nothing a command needs: the verdict file is written and
closed by ``launch.finish``, the process group destroyed, the checkpoint writer's thread joined.
"""

import sys

from .entry import exit_now, main

exit_now(main())
