"""Every example in ``examples/`` runs as its docstring says (``torchrun --nproc-per-node 2`` on CPU,
loopback receiver) and reaches the end with the syncs it promises: an example that rots is a user's
first failure. Each assertion is on what the example prints about its own syncs. One example goes
through torchrun itself; the rest run the same script on two forked ranks with torchrun's
environment (the rendezvous is torchrun's only part they skip)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

CASES = {
    # script and arguments -> patterns its stdout must contain
    "accelerate_fsdp2": (["--steps", "2"], [r"step 1: loss [\d.]+, synced", r"step 2: loss [\d.]+, synced"]),
    # every=1: the Trainer's own loss line for each step survives the sync at that step (issue 16)
    "hf_trainer": (["--steps", "2", "--every", "1"], [r"synced at steps \[0, 1, 2\]", r"weight_version: \{'http[^']+': '2'\}",
                                                     r"(?s)\{'loss': '[\d.]+'.*\{'loss': '[\d.]+'"]),
    "megatron_loop": (["--pp", "2", "--vpp", "2", "--steps", "2"], [r"weight_version: \{'http[^']+': '2'\}"]),
    "async_loop": (["--steps", "4", "--every", "2"], [r"rollouts saw policy versions \['0', '2', '4'\]"]),
    # the merged LoRA weights must reproduce the trainer's LoRA forward on a plain receiver model
    # delta sync: the first sync whole, then only changed elements, each verified against a dense pass
    "delta_fsdp2": (["--steps", "2"], [r"step 0: anchor, \d+ elements",
                                       r"step 1: loss [\d.]+, delta, [\d.]+% of \d+ elements changed, \d+ bytes sent vs \d+ dense, weight_version 1",
                                       r"step 2: loss [\d.]+, delta, .* weight_version 2"]),
    "lora_fsdp2": (["--steps", "2"], [r"step 1: .*synced \d+ merged tensors .* rel err \S+ \(ok\)",
                                      r"step 2: .*synced \d+ merged tensors .* rel err \S+ \(ok\)"]),
}


#: Launched by torchrun itself, as a user types it; the others run the same script on 2 forked
#: ranks with torchrun's environment (worlds.run_script), which skips two fresh interpreters' imports.
UNDER_TORCHRUN = {"hf_trainer"}


def _check(name: str, returncode: int, stdout: str, stderr: str) -> None:
    # the error lines first: a traceback tail alone hides which rank raised what
    errors = [line for line in stderr.splitlines() if re.search(r"\w+(Error|Exception)\b", line)]
    assert returncode == 0, (name, errors[-20:], stdout[-2000:], stderr[-3000:])
    for pat in CASES[name][1]:
        assert re.search(pat, stdout), (pat, stdout[-3000:])


@pytest.mark.parametrize("name", sorted(UNDER_TORCHRUN))
def test_example_runs_under_torchrun(name):
    # --standalone: torchrun's rendezvous binds port 0 itself (its default 29500 collides with any
    # other torchrun on the host; a port picked here and bound there would be a race)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", f"{name}.py"), *CASES[name][0]]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    _check(name, r.returncode, r.stdout, r.stderr)


@pytest.mark.parametrize("name", sorted(set(CASES) - UNDER_TORCHRUN))
def test_example_runs_on_two_ranks(name):
    from worlds import run_script

    r = run_script(os.path.join(ROOT, "examples", f"{name}.py"), *CASES[name][0], nproc=2, timeout=500)
    _check(name, r.returncode, r.stdout, r.stderr + r.per_rank[1][2])


def test_every_example_is_covered():
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py") and f != "common.py"}
    assert scripts == set(CASES), scripts ^ set(CASES)
