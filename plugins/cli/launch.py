"""Running a command on N ranks: the torchrun re-launch, the verdict file, and Ctrl-C.

Asked for N > 1 ranks and not already under ``torchrun``, a command re-runs itself under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (``launch``). The ranks report
their verdict through a small result file (``finish``: rank 0 writes it, every rank exits 0), so a
failed check or demo exits 1 with its own words and not with torchrun's traceback.

Invariant: Ctrl-C leaves nothing behind. SIGINT / SIGTERM unwind every process through its
``finally`` blocks (``interrupts_as_keyboard_interrupt``: receivers and servers are stopped, rank 0
writes the verdict with the syncs done); whatever has not ended within ``STOP_GRACE_S`` -- torchrun,
each rank's process group, any helper's group -- is killed, and the launcher exits 130 with one line.

Invariant: a dead or stopped rank is a failure, and nothing weightsync started outlives the job. A
rank killed by a signal reaches the launcher as a record (``torchrun``: torch's torchrun with its
``ChildFailedError`` written down) and is said in one line naming the rank and the signal, exit 1;
a rank stopped (SIGSTOP) while its peers gave up is found by the launcher's watch (``_watch``), exit
1. Either way the launcher stops every process group the launch ever held (``tree.ProcessTree``:
ranks, the demo's vLLM server, receivers, orphans re-parented to the launcher).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from .tree import ProcessTree, descendants

__all__ = [
    "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE", "EXIT_INTERRUPTED", "STOP_GRACE_S", "ARGV_ENV", "under_torchrun", "launch",
    "ranks_up", "finish", "interrupts_as_keyboard_interrupt", "descendants",
]

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: After Ctrl-C, how long the ranks get to unwind (stop their receiver / server, write the verdict)
#: before they, their helpers and torchrun are killed. A rank blocked in a gloo collective whose peer
#: already unwound does not see the signal until the collective times out: this bounds that wait.
STOP_GRACE_S = 15.0
#: The ranks get their arguments through this variable (torchrun's own parser would otherwise read
#: options such as --nproc as abbreviations of its own).
ARGV_ENV = "WEIGHTSYNC_ARGV"
_RESULT_ENV = "WEIGHTSYNC_RESULT_FILE"
_T0_ENV = "WEIGHTSYNC_LAUNCH_T0"
_UP_FILE = "ranks-up"


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (then it runs the command, never re-launches)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def launch(nproc: int, argv: Sequence[str], command: str) -> int:
    """Re-run ``weightsync argv`` under torchrun with ``nproc`` ranks; return the verdict.

    Ctrl-C (or SIGTERM) here: torchrun runs in its own session, so the terminal's SIGINT reaches
    this process only; it forwards SIGINT to every rank (each unwinds: stops its receiver or vLLM
    server, rank 0 writes the verdict with the syncs done), waits up to ``STOP_GRACE_S`` for torchrun
    to end (a second Ctrl-C cuts the wait), then kills whatever of the tree is left (torchrun, each
    rank's process group, any helper's group) and prints one line. Exit 130.

    A rank that dies (a signal, or an exit code other than 0) is a failure, never an interruption:
    torchrun stops the other ranks (SIGTERM: they unwind as for Ctrl-C), the launcher stops what is
    left of the tree (``tree.ProcessTree``: helpers orphaned by the dead rank included) and prints one
    line naming the rank and its signal. Exit 1. A rank that is stopped (SIGSTOP) while its peers
    gave up (they raise once the process group's timeout passes, ``common.init_cpu_process_group``)
    ends the job the same way: ``_watch`` notices it and the launcher kills the tree. Exit 1."""
    from .torchrun import FAILURE_ENV  # here: the torchrun module runs as __main__ in its own process

    with tempfile.TemporaryDirectory(prefix="weightsync-") as tmp:
        result = os.path.join(tmp, "result.json")
        failure_file = os.path.join(tmp, "rank-failure.json")
        # The ranks get their arguments through the environment: torchrun's own parser would
        # otherwise read options such as --nproc as abbreviations of its own.
        env = dict(os.environ, **{_RESULT_ENV: result, ARGV_ENV: json.dumps(list(argv)), FAILURE_ENV: failure_file})
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"  # each rank's lines as they happen, in order with the launcher's
        env[_T0_ENV] = repr(time.time())
        cmd = [
            sys.executable, "-m", "weightsync.plugins.cli.torchrun", "--standalone",
            "--log-dir", os.path.join(tmp, "torchrun"),  # else torchrun leaves a torchelastic_* folder in /tmp
            "--nproc-per-node", str(nproc), "-m", "weightsync.plugins.cli",
        ]
        print(f"weightsync {command}: starting {nproc} ranks (torchrun) ...", file=sys.stderr, flush=True)
        interrupted = False
        stuck: str | None = None
        tree = ProcessTree()
        try:
            with interrupts_as_keyboard_interrupt():
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
                tree.watch(proc)
                try:
                    stuck = _watch(proc, tree, os.path.join(tmp, _UP_FILE), result, command)
                except KeyboardInterrupt:
                    interrupted = True
                    _stop_tree(proc, tree, nproc)
        finally:
            tree.stop(grace_s=0.0 if interrupted else 5.0 if stuck else STOP_GRACE_S)
        verdict = None
        if os.path.exists(result):
            with open(result) as f:
                verdict = json.load(f)
        if interrupted:
            line = (verdict or {}).get("interrupted") or f"weightsync {command}: interrupted"
            print(line, file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        dead = None
        if os.path.exists(failure_file):
            with open(failure_file) as f:
                dead = json.load(f)
        if dead is not None:
            how = f"was killed by {dead['signal']}" if dead.get("signal") else f"exited with code {dead['exitcode']}"
            print(f"weightsync {command}: FAIL: rank {dead['rank']} (pid {dead['pid']}) {how}; the other ranks "
                  "and everything weightsync started were stopped", file=sys.stderr, flush=True)
            return EXIT_FAIL
        if stuck is not None:
            print(f"weightsync {command}: FAIL: {stuck}", file=sys.stderr, flush=True)
            return EXIT_FAIL
        if verdict is None:
            print(
                f"weightsync: the {nproc} ranks ended without a verdict (torchrun exit code "
                f"{proc.returncode}); see the output above",
                file=sys.stderr,
            )
            return EXIT_FAIL
        if verdict.get("interrupted"):
            # the ranks unwound on a signal the launcher never sent (a rank signalled by hand, a
            # scheduler): not the user's Ctrl-C here, so a failure of the job
            print(f"weightsync {command}: FAIL: a signal reached the ranks, not from this launcher "
                  f"({verdict['interrupted']})", file=sys.stderr, flush=True)
            return EXIT_FAIL
        return int(verdict["exit"])


#: Once a rank ended or rank 0 wrote the verdict, how long the other ranks get to end before the
#: launcher ends the job itself (torchrun stops the rest of a failed job within its own 30 s).
ENDING_GRACE_S = 45.0


def _watch(proc: subprocess.Popen, tree: ProcessTree, up_file: str, result: str, command: str,
           every_s: float = 5.0) -> str | None:
    """Until torchrun ends: record the tree (``tree.snapshot``); until rank 0 says the ranks are up
    (``up_file``), a line every ``every_s`` saying what is awaited and for how long (each rank
    imports torch, then they rendezvous). Once a rank ended or the verdict is written, the rest must
    follow: a rank that is stopped (SIGSTOP) never will, nor do ranks still running after
    ``ENDING_GRACE_S``. Returns None when torchrun ended by itself, else what held the job (the
    caller kills the tree)."""
    t0 = time.monotonic()
    next_note = t0 + every_s
    up = False
    ending_since: float | None = None
    while proc.poll() is None:
        tree.snapshot()
        if not up:
            up = os.path.exists(up_file)
            if not up and time.monotonic() >= next_note:
                print(f"  ... waiting for the ranks to start (imports, rendezvous): {time.monotonic() - t0:.0f} s",
                      file=sys.stderr, flush=True)
                next_note += every_s
        if ending_since is None and (os.path.exists(result) or tree.gone()):
            ending_since = time.monotonic()
        if ending_since is not None:
            stopped = tree.stopped()
            waited = time.monotonic() - ending_since
            if stopped and waited > 1.0:
                gone = tree.gone()
                held = "; ".join(f"rank {r} (pid {pid}) is stopped (SIGSTOP)" for r, pid in stopped)
                peers = f" while rank(s) {gone} gave up waiting for it" if gone else ""
                return f"{held}{peers}; every rank and everything weightsync started were killed"
            if waited > ENDING_GRACE_S:
                return (f"rank(s) {sorted(set(tree.ranks.values()) - set(tree.gone()))} still running "
                        f"{ENDING_GRACE_S:.0f} s after the others ended; every rank and everything weightsync "
                        "started were killed")
        time.sleep(0.2)
    return None


def ranks_up(what: str) -> None:
    """In a launched rank, once the process group is up: rank 0 tells the launcher (which stops its
    waiting lines) and prints how long the start took."""
    path = os.environ.get(_RESULT_ENV)
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    open(os.path.join(os.path.dirname(path), _UP_FILE), "w").close()
    t0 = float(os.environ.get(_T0_ENV, "0") or 0)
    took = f" in {time.time() - t0:.1f} s" if t0 else ""
    print(f"weightsync {what}: {os.environ.get('WORLD_SIZE', '?')} ranks up{took}", file=sys.stderr, flush=True)


class interrupts_as_keyboard_interrupt:  # noqa: N801 - used as a context manager, like contextlib's
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` inside the block (the launcher's and each rank's
    way of unwinding through ``finally``); the previous handlers come back at the end."""

    def __enter__(self) -> "interrupts_as_keyboard_interrupt":
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, _raise_interrupt)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


#: the signal that interrupted this process (inside ``interrupts_as_keyboard_interrupt``), if any
_SIGNALLED: list[str] = []


def interrupted_by_signal() -> bool:
    """Whether SIGINT / SIGTERM reached this process inside ``interrupts_as_keyboard_interrupt``. A
    rank stopped by Ctrl-C often fails as an echo first -- a peer stopped mid-collective, so the
    sync raises ``PeerFailedError`` -- and that is an interruption, not a failure to report."""
    return bool(_SIGNALLED)


def failed(command: str, error: BaseException, *, rank: int) -> int:
    """The verdict of ``command`` after ``error`` on this rank: ``EXIT_FAIL``, said in one line by rank 0
    -- unless Ctrl-C reached this rank, when the error is its peers' stop echoed (they left a
    collective) and the command ends as interrupted (``KeyboardInterrupt``)."""
    if interrupted_by_signal():
        raise KeyboardInterrupt("SIGINT") from error
    if rank == 0:
        print(f"weightsync {command}: FAIL: {type(error).__name__}: {error}", file=sys.stderr)
    return EXIT_FAIL


def _raise_interrupt(signum: int, frame: object) -> None:
    if not _SIGNALLED:
        # From here on this process unwinds on purpose, and so do its peers (the launcher signals
        # every rank): their failures reach this rank as echoes (a peer left a collective), which
        # weightsync logs as warnings. The user asked for the stop; the one line they get says it.
        logging.getLogger("weightsync").setLevel(logging.ERROR)
    _SIGNALLED.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _stop_tree(proc: subprocess.Popen, tree: ProcessTree, nproc: int) -> None:
    """Ctrl-C in the launcher: SIGINT to each rank, a bounded wait (a second Ctrl-C cuts it); what is
    left is killed by the caller's ``tree.stop``."""
    tree.snapshot()
    print(f"weightsync: Ctrl-C: stopping the {nproc} ranks (up to {STOP_GRACE_S:.0f} s; Ctrl-C again to kill now)",
          file=sys.stderr, flush=True)
    tree.signal_ranks(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            tree.snapshot()
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass


def finish(code: int, interrupted: str | None = None) -> int:
    """In a launched rank: rank 0 writes the verdict (and, after Ctrl-C, the line the launcher
    prints); every rank exits 0 so torchrun stays quiet."""
    path = os.environ.get(_RESULT_ENV)
    if not path:
        if interrupted:
            print(interrupted, file=sys.stderr, flush=True)
        return code
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump({"exit": code, "interrupted": interrupted}, f)
    return EXIT_OK
