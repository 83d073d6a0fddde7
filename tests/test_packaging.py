"""What ``pip install .`` (not editable) ships: every module of the tree, and the vLLM plugin entry point.

The editable install that the suite and the CI use finds modules by path, so a package missing from
pyproject's explicit ``[tool.setuptools] packages`` list goes unnoticed there and breaks only a user's
plain install. The oracle is setuptools itself: build the wheel and read what it holds.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOPS = {"sources": "weightsync/sources", "plugins": "weightsync/plugins"}


def _tree_modules() -> set[str]:
    """Every tracked .py file of sources/ and plugins/, as its path inside the installed wheel."""
    out = subprocess.run(["git", "ls-files", "sources", "plugins"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = {f for f in out.stdout.split() if f.endswith(".py")}
    return {TOPS[f.split("/", 1)[0]] + "/" + f.split("/", 1)[1] for f in files}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the list of tracked files)")
    out = tmp_path_factory.mktemp("wheel")
    # a clean copy of the tree (tracked and untracked, not ignored): building in the checkout would
    # reuse its build/ folder, which may hold modules the package list no longer names
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    for rel in listed:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("weightsync-*.whl")
    return zipfile.ZipFile(whl)


def test_plain_install_ships_every_module(wheel: zipfile.ZipFile) -> None:
    shipped = {n for n in wheel.namelist() if n.endswith(".py")}
    missing = sorted(_tree_modules() - shipped)
    assert not missing, f"pyproject's [tool.setuptools] packages leaves out: {missing}"


def test_plain_install_registers_the_vllm_plugin_and_the_cli(wheel: zipfile.ZipFile) -> None:
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "weightsync = weightsync.plugins.loopback.worker.plugin:register" in text, text
    assert "weightsync = weightsync.plugins.cli:run" in text, text
    # the entry points name modules the wheel holds
    assert "weightsync/plugins/loopback/worker/plugin.py" in wheel.namelist()
    assert "weightsync/plugins/cli/__init__.py" in wheel.namelist()
