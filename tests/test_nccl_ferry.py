"""The NCCL ferry (``.ci/nccl_ferry.py``, issue 51) on a synthetic wheel: what the device side does when
parts arrive over several calls, out of order, damaged or not at all.

Oracle: the library's bytes as written into the wheel and the sha256 its RECORD lists (computed here
with hashlib, not by the ferry); the joined library must be those bytes exactly.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

FERRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".ci", "nccl_ferry.py")
MEMBER = "nvidia/nccl/lib/libnccl.so.2"


def _ferry():
    spec = importlib.util.spec_from_file_location("nccl_ferry", FERRY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(path: str, lib: bytes, *, record_bytes: bytes | None = None) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_bytes or lib).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, lib)
        z.writestr("nvidia_nccl_cu13-9.9.9.dist-info/RECORD", f"{MEMBER},sha256={digest},{len(lib)}\n")
    return path


def _cli(cmd: str, kit: str, stash: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WS_NCCL_KIT=kit, WS_NCCL_STASH=stash)
    return subprocess.run([sys.executable, FERRY, cmd], env=env, capture_output=True, text=True, timeout=120)


def test_parts_over_several_calls_join_to_the_wheels_library(tmp_path):
    if shutil.which("xz") is None:
        pytest.skip("xz is not installed (the ferry's packing side needs it)")
    ferry = _ferry()
    # 3 MiB that compress only partly: random blocks between runs of zeros
    lib = b"".join(os.urandom(64 << 10) + bytes(64 << 10) for _ in range(24))
    packed = str(tmp_path / "packed")
    doc = ferry.pack_wheel(_wheel(str(tmp_path / "w.whl"), lib), packed, first_mib=0.5, part_mib=0.75, level="-1")
    names = [p["name"] for p in doc["parts"]]
    assert len(names) >= 3 and doc["library_sha256"] == hashlib.sha256(lib).hexdigest()
    tree, stash = str(tmp_path / "tree"), str(tmp_path / "stash")

    def carry(*parts: str, damage: bool = False) -> None:  # what one device call brings along
        shutil.rmtree(tree, ignore_errors=True)
        os.makedirs(tree)
        for name in ("MANIFEST.json", *parts):
            shutil.copy(os.path.join(packed, name), os.path.join(tree, name))
        if damage:
            with open(os.path.join(tree, parts[0]), "r+b") as f:
                f.seek(10)
                b = f.read(1)
                f.seek(10)
                f.write(bytes([b[0] ^ 1]))

    carry(names[0])
    out = _cli("stash", tree, stash)
    assert out.returncode == 0 and f"missing: {', '.join(names[1:])}" in out.stdout, out.stdout
    out = _cli("join", tree, stash)
    assert out.returncode == 3 and "cannot join: missing" in out.stdout and names[1] in out.stdout, out.stdout
    carry(names[1], damage=True)
    out = _cli("stash", tree, stash)
    assert "arrived damaged" in out.stdout and names[1] in out.stdout.split("missing:")[1], out.stdout
    carry(*reversed(names[1:]))  # the rest, in another order, in one call
    out = _cli("stash", tree, stash)
    assert "all there" in out.stdout, out.stdout
    out = _cli("join", tree, stash)
    assert out.returncode == 0 and "== w.whl's RECORD" in out.stdout, out.stdout + out.stderr
    with open(os.path.join(stash, "libnccl.so.2"), "rb") as f:
        assert f.read() == lib
    assert sorted(os.listdir(stash)) == ["MANIFEST.json", "libnccl.so.2"]  # the parts are gone
    env = _cli("env", tree, stash)
    assert f"export VLLM_NCCL_SO_PATH={stash}/libnccl.so.2" in env.stdout and "NCCL_MULTI_RANK_GPU_ENABLE=1" in env.stdout


def test_a_wheel_whose_library_disagrees_with_its_record_is_refused(tmp_path):
    ferry = _ferry()
    wheel = _wheel(str(tmp_path / "w.whl"), b"the library", record_bytes=b"another library")
    with pytest.raises(SystemExit, match="!= RECORD's"):
        ferry.pack_wheel(wheel, str(tmp_path / "kit"), level="-1")
