"""No silent wait (issue 56): a command prints a line at least every ``progress.EVERY_S`` seconds
while it works, and ends as soon as its verdict is out.

The heartbeat itself (``plugins/cli/progress.py``) is checked in-process: a silent block gets lines
naming its phase, a chatty one none. A real command (``python -m weightsync.plugins.cli export``,
the module the launcher runs on every rank) is then watched line by line as a user sees it: no gap
longer than the heartbeat's period plus slack for a busy host, and the process gone soon after
``PASS`` (the interpreter's teardown of torch and transformers took 2-3 s per rank after it, 7.6 s
for a four-rank check on 2 cores).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

from weightsync.plugins.cli import progress

#: what a busy host may add to the heartbeat's period before a gap counts as silence
SLACK_S = 3.5


def test_a_silent_phase_gets_lines_naming_it_and_a_chatty_one_none():
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        with progress.heartbeat("demo", every_s=0.3):
            progress.phase("building the model")
            time.sleep(1.5)
    lines = err.getvalue().splitlines()
    assert lines and all(line.startswith("weightsync demo: ... building the model (") for line in lines), lines
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        with progress.heartbeat("demo", every_s=3.0):
            for i in range(20):
                print(f"step {i}")  # a command that speaks often needs no heartbeat
                time.sleep(0.05)
    assert err.getvalue() == ""
    progress.phase("after")  # outside a heartbeat: a no-op that must not raise


@pytest.mark.slow
def test_a_command_is_never_silent_and_exits_right_after_its_verdict(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.plugins.cli", "export", "--model", "tiny-qwen3", "--out",
         str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            seen.append((time.monotonic(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait(timeout=300)
    ended = time.monotonic()
    reader.join(10)
    assert proc.returncode == 0, seen
    times = [t0] + [t for t, _ in seen]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) <= progress.EVERY_S + SLACK_S, list(zip(gaps, [line for _, line in seen]))
    passed = next(t for t, line in seen if line == "PASS")
    assert ended - passed <= 1.5, (ended - passed, seen)
