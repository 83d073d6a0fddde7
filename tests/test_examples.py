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


def test_megatron_loop_refuses_a_layout_before_anything_starts():
    """A layout the world size (torchrun's ``WORLD_SIZE``) or the model does not divide: one line on
    rank 0 (nothing on the others), exit 2, and neither torch nor vLLM imported, no process group, no
    receiver -- megatron-core used to refuse it after ~40 s with a traceback per rank."""
    path = os.path.join(ROOT, "examples", "megatron_loop.py")
    probe = (
        "import os, runpy, sys\n"
        f"sys.path.insert(0, {os.path.dirname(path)!r}); sys.argv = [{path!r}, *sys.argv[1:]]\n"
        "try:\n"
        f"    runpy.run_path({path!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    heavy = sorted(m for m in ('torch', 'vllm', 'megatron', 'transformers') if m in sys.modules)\n"
        "    print('exit', e.code, 'heavy', heavy)\n"
    )
    cases = [  # (WORLD_SIZE, RANK, argv, what the line names)
        ("2", "0", ["--tp", "2", "--pp", "2"], "--tp 2 x --pp 2 = 4 ranks per model replica does not divide the world size 2"),
        ("3", "0", ["--pp", "2"], "does not divide the world size 3"),
        ("4", "0", ["--tp", "4"], "--tp 4 does not divide the model's 4 attention heads / 2 KV heads"),
        ("2", "0", ["--pp", "2", "--vpp", "3"], "--pp 2 x --vpp 3 = 6 model chunks do not divide the model's 4 layers"),
        ("2", "1", ["--tp", "2", "--pp", "2"], None),  # other ranks: silent, same exit code
    ]
    for world, rank, argv, needle in cases:
        env = dict(os.environ, WORLD_SIZE=world, RANK=rank, LOCAL_RANK=rank)
        r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert r.stdout.strip() == "exit 2 heavy []", (argv, r.stdout, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        if needle is None:
            assert lines == [], (argv, lines)
        else:
            assert len(lines) == 1 and lines[0].startswith("megatron_loop.py: ") and needle in lines[0], (argv, lines)


def test_a_script_without_the_main_guard_is_told_what_to_add(tmp_path):
    """A user's script that starts the loopback receiver from its top level, not under ``if __name__
    == "__main__":``: the spawned receiver would import the script again and die while
    bootstrapping ("loopback receiver process failed to start" was all the user saw). Refused
    before any process starts, naming the line and the guard to add."""
    import runpy

    from weightsync.sources import WeightSyncError

    script = tmp_path / "train.py"
    script.write_text(
        "import functools\n"
        "import torch\n"
        "from weightsync.plugins.loopback.receiver import start_receiver_process\n"
        "\n"
        "client, handle = start_receiver_process(functools.partial(torch.nn.Linear, 2, 2))\n"
    )
    with pytest.raises(WeightSyncError) as e:
        runpy.run_path(str(script), run_name="__main__")
    msg = str(e.value)
    assert f"line 5 of {script}" in msg and 'if __name__ == "__main__":' in msg and "'spawn'" in msg, msg
