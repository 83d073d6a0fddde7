"""The benchmarks' regression guard (bench/_history.py): what a record says and when a ratio is flagged.

A GPU run's copy of the tree carries a stale ``.git``; its records must name the commit the run was
started from (``WEIGHTSYNC_COMMIT``), or the history misleads whoever compares runs later.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture()
def history():
    spec = importlib.util.spec_from_file_location("ws_bench_history", ROOT / "bench" / "_history.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_record_names_the_commit_it_was_given_else_git(history, tmp_path, monkeypatch):
    path = tmp_path / "h.jsonl"
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setenv("WEIGHTSYNC_COMMIT", "abc1234")
    g = history.Guard("bench_x", "shape", record=True, path=str(path), printer=lambda *_: None)
    g.check("r", 1.0, 0.01)
    g.finish()
    monkeypatch.delenv("WEIGHTSYNC_COMMIT")
    g = history.Guard("bench_x", "shape", record=True, path=str(path), printer=lambda *_: None)
    g.check("r", 1.0, 0.01)
    g.finish()
    first, second = (json.loads(x) for x in path.read_text().splitlines())
    assert first["commit"] == "abc1234"
    assert second["commit"] not in ("abc1234", "?") and second["commit"][:7].isalnum(), second


def test_a_ratio_worse_than_the_last_beyond_its_noise_is_flagged(history, tmp_path):
    path = tmp_path / "h.jsonl"
    g = history.Guard("bench_x", "shape", record=True, path=str(path), printer=lambda *_: None)
    g.check("r", 1.0, 0.02)
    g.finish()
    g = history.Guard("bench_x", "shape", path=str(path), printer=lambda *_: None)
    assert g.check("r", 1.04, 0.02) is None          # within the 5% floor
    assert g.check("r", 1.10, 0.02).startswith("REGRESSION")
    assert g.check("r", 0.5, 0.02) is None           # better
