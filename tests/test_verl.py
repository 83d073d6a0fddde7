"""weightsync inside verl 0.9.1, on CPU under real Ray (issue 54): verl's own ``CheckpointEngineManager``
drives a 2-rank FSDP2 gloo actor group (verl's ``update_weights``, verl's ``FSDPEngine`` class, tapped by
``weightsync.plugins.verl``) into two verl ``CheckpointEngineWorker``s whose server adapter records what
it loads (``tests/verl_world.py``).

One Ray session and one world for the whole file (a Ray start is 4-14 s): three syncs with a training
step between, each rollout worker's load compared with transformers' ``save_pretrained`` of the
trainer's model (the oracle, cast to the bf16 wire) -- names and bytes; the manager's call order and the
``global_steps`` the adapter saw; then a NaN in one rank's shard refused on every actor rank, naming
the tensor, with the rollout workers told why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (.ci/requirements.txt pins ray==2.56.1)")
pytest.importorskip("verl", reason="verl is not installed (.ci/env.sh installs verl==0.9.1 --no-deps)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))
    ray.init(num_cpus=16, num_gpus=0, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1"}})
    try:
        import verl_world

        manager, actor_wg, calls = verl_world.start(str(out))
        yield out, manager, actor_wg, calls
    finally:
        ray.shutdown()


def _loads(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_three_syncs_equal_save_pretrained_in_verl_order(world):
    out, manager, actor_wg, calls = world
    for step in (1, 2, 3):
        actor_wg.train_step(step)
        ref = out / f"ref{step}"
        actor_wg.save_pretrained(str(ref))
        metrics = manager.update_weights(global_steps=step)
        assert metrics["weightsync/tensors"] > 0
        oracle = load_file(str(ref / "model.safetensors"))
        for rank in (0, 1):
            got = load_file(str(out / f"rank{rank}-step{step}.safetensors"))
            assert sorted(got) == sorted(oracle), f"rollout rank {rank}: names differ from save_pretrained"
            for name, want in oracle.items():
                assert torch.equal(got[name], want.to(torch.bfloat16)), f"step {step}, rank {rank}: {name} differs"
    log = _loads(out)
    assert [(e["global_steps"], e["wire_format"]) for e in log] == [(s, "named_tensors") for s in (1, 1, 2, 2, 3, 3)]
    per_sync = ["abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"]
    assert calls == per_sync * 3


def test_nan_in_one_rank_shard_is_named_on_every_rank(world):
    out, manager, actor_wg, calls = world
    name = "model.layers.0.mlp.down_proj.weight"
    actor_wg.poison(name, 1)
    with pytest.raises(Exception) as info:
        manager.update_weights(global_steps=4)
    assert "NaN or Inf" in str(info.value) and name in str(info.value)
    per_rank = actor_wg.errors()
    assert len(per_rank) == 2
    for rank, logged in enumerate(per_rank):
        assert any(f"rank {rank}: weightsync refused the sync" in m and name in m for m in logged), (rank, logged)
    assert not (out / "rank0-step4.safetensors").exists(), "the rollout loaded an aborted sync"
