"""torch's ``torchrun``, run by the launcher, with a failed rank written down instead of raised.

``python -m weightsync.plugins.cli.torchrun ARGS`` is ``python -m torch.distributed.run ARGS``,
except that when a rank ends abnormally (killed by a signal, or an exit code other than 0 -- the
ranks of a weightsync command exit 0 and report their verdict through the launcher's result file)
torchrun's ``ChildFailedError`` becomes one JSON record in ``$WEIGHTSYNC_RANK_FAILURE_FILE``
(``rank``, ``pid``, ``exitcode``, ``signal``: the first rank that failed) and this process exits 1
without a traceback. torchrun's own log lines (the elastic agent's "Sending process ... closing
signal", "failed (exitcode ...)") are silenced: the launcher says what happened in one line
(``launch.launch``).

Invariant: a rank's abnormal end always reaches the launcher as a record or as the exit code of
this process, never only as text on the terminal.
"""

from __future__ import annotations

import json
import logging
import os
import sys

__all__ = ["FAILURE_ENV", "main"]

#: Where the first failed rank is written (set by the launcher).
FAILURE_ENV = "WEIGHTSYNC_RANK_FAILURE_FILE"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        record = {
            "rank": int(rank), "pid": int(failure.pid), "exitcode": int(failure.exitcode),
            "signal": failure.signal_name() if failure.exitcode < 0 else None,
        }
        path = os.environ.get(FAILURE_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(record, f)
        else:
            print(f"torchrun: rank {rank} failed: {record}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
