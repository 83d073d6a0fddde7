"""How long a ``weightsync`` usage error takes, against a bare interpreter, in the same run.

``tests/test_demo_cli.py`` asserts *why* a usage error is quick (no torch / transformers /
megatron-core / vLLM module is imported before the arguments are validated, checked in the child);
this measures *how* quick: the wall time of ``weightsync check --layout megatron --tp 0`` (exit 2)
against ``python -c pass``, median and best of ``--reps`` fresh interpreters, interleaved.
Goal: a usage error costs at most 3x a bare interpreter (a torch import alone is ~40x here).
The ratio is compared with the last recorded run (``bench/_history.py``); ``--record`` appends it.

    python bench/bench_cli.py [--reps 15] [--record]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _history import Guard, ratio_noise  # noqa: E402

GOAL = 3.0


def _cli() -> list[str]:
    exe = shutil.which("weightsync", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "weightsync.plugins.cli"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {
        "bare": [sys.executable, "-c", "pass"],
        "usage error": [*_cli(), "check", "--layout", "megatron", "--tp", "0"],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.reps):
        for k, cmd in runs.items():
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
            times[k].append(time.perf_counter() - t0)
            if k == "usage error" and r.returncode != 2:
                raise SystemExit(f"expected exit 2, got {r.returncode}: {r.stderr[-500:]!r}")
    for k, v in times.items():
        print(f"{k:<12} median {statistics.median(v) * 1e3:7.1f} ms  best {min(v) * 1e3:7.1f} ms")
    ratio = statistics.median(times["usage error"]) / statistics.median(times["bare"])
    print(f"ratio usage error / bare interpreter: x{ratio:.2f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    guard = Guard("bench_cli", "check --tp 0", record=args.record)
    guard.check("usage error/bare interpreter median", ratio, ratio_noise(times["usage error"], times["bare"]))
    guard.finish()


if __name__ == "__main__":
    main()
