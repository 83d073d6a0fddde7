import os
import sys

import pytest

# worlds.py and the test modules are imported by name in spawned children.
sys.path.insert(0, os.path.dirname(__file__))
# the family modules' shared checks report like a test module's own asserts (pytest's diffs)
pytest.register_assert_rewrite("family_worlds")
os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- where the suite's time goes: one line per test file at the end of every run ------------------
import collections  # noqa: E402

_FILE_SECONDS: dict[str, float] = collections.defaultdict(float)
_FILE_TESTS: dict[str, int] = collections.defaultdict(int)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] += report.duration  # setup + call + teardown (module fixtures' worlds too)
    if report.when == "call":
        _FILE_TESTS[path] += 1


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    tr = terminalreporter
    tr.section("time per test file (setup + call + teardown)")
    for path, secs in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{secs:8.1f}s  {_FILE_TESTS[path]:3d} tests  {path}")
    tr.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s  in tests (the rest is collection and start-up)")
