import os
import sys

import pytest

# worlds.py and the test modules are imported by name in spawned children.
sys.path.insert(0, os.path.dirname(__file__))
# the family modules' shared checks report like a test module's own asserts (pytest's diffs)
pytest.register_assert_rewrite("family_worlds")
os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- the vLLM-facing tests (`-m vllm`): .ci/test runs them again on vLLM 0.33 -----------------------
#: Whole files that run vLLM's own code where 0.33 and 0.34 differ or meet (trainer / worker engines,
#: the RL router and GET /version, PyNccl, reload, sparse patches, the version checks, a real vLLM
#: server) and are quick enough for the 0.33 pass (<= 3 minutes on 2 cores in all). A new test file
#: can join by listing itself here or with ``pytestmark = pytest.mark.vllm``.
VLLM_FACING_FILES = {
    "tests/test_check.py",
    "tests/test_driver.py",
    "tests/test_http.py",
    "tests/test_loopback.py",
    "tests/test_loopback_worker.py",
    "tests/test_many_senders.py",
    "tests/test_versions.py",
    "tests/test_vllm_server.py",
}
#: Single tests of files whose other tests (or module worlds) are too slow for the 0.33 pass.
VLLM_FACING_TESTS = {
    "tests/test_bad_input.py::test_preflight_disabled_nccl_raises_on_every_rank",
    "tests/test_delta.py::test_vllm_apply_path",
    "tests/test_delta_sync.py::test_sparse_nccl_engine_and_patch_files",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, rest = item.nodeid.partition("::")
        name = rest.split("[", 1)[0]
        if path in VLLM_FACING_FILES or f"{path}::{name}" in VLLM_FACING_TESTS:
            item.add_marker(pytest.mark.vllm)


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
