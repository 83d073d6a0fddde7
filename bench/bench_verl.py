"""weightsync's source vs verl's own ``get_per_tensor_param()`` feeding the same verl backend (issue 54).

One Ray session, verl's real ``CheckpointEngineManager``, a 2-rank FSDP2 gloo actor group and 2 rollout
workers (``tests/verl_world.py``), the ``weightsync`` backend carrying both streams. Per sync: the
actor rank 0's send time (the source pass + the transfer, the backend's ``weightsync/sync_s``), the
manager's whole ``update_weights`` wall time, and the c10d collectives each actor rank dispatched.

    python bench/bench_verl.py [--hidden 1024 --layers 8 --syncs 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("bench_verl")
TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--syncs", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["WS_VERL_SHAPE"] = f"{args.hidden},{args.layers}"
    sys.path.insert(0, str(TESTS))
    import ray

    ray.init(num_cpus=16, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1",
                                       "WS_VERL_SHAPE": os.environ["WS_VERL_SHAPE"]}})
    try:
        import verl_world

        manager, actor_wg, _ = verl_world.start(tempfile.mkdtemp(), bucket_mb=64)
        step = 0
        for which in ("verl", "weightsync", "verl", "weightsync"):
            actor_wg.export_with(which)
            for _ in range(args.syncs):
                step += 1
                before = actor_wg.collectives()
                t0 = time.perf_counter()
                metrics = manager.update_weights(global_steps=step)
                wall = time.perf_counter() - t0
                counts = [a - b for a, b in zip(actor_wg.collectives(), before)]
                logger.info("%-10s sync %d: send %.3f s, update_weights %.3f s, %.1f MiB, %d tensors, "
                            "collectives per actor rank %s", which, step, metrics["weightsync/sync_s"], wall,
                            metrics["weightsync/bytes"] / 2**20, metrics["weightsync/tensors"], counts)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
