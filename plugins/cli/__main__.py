"""``python -m weightsync.plugins.cli``: how the CLI re-runs itself under torchrun."""

import sys

from .entry import main

sys.exit(main())
