"""Writing an adapter version as a PEFT adapter folder a vLLM server loads (``write_adapter``).

Invariant: a half-written adapter is never visible under a name the server could read -- both files
are written into a hidden temporary folder beside the target, each fsynced, the folder fsynced, then
renamed into place (one atomic rename) and the parent fsynced.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from typing import Any

import torch

__all__ = ["write_adapter"]


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_adapter(folder: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
    """Write ``adapter_model.safetensors`` (PEFT's metadata ``{"format": "pt"}``) and
    ``adapter_config.json`` as the folder ``folder``, atomically: into a hidden temporary folder
    beside it, each file and the folder fsynced, one rename, the parent fsynced. ``folder`` must not
    exist. Both files get ``0o666`` minus the umask (``0644`` under umask 022; safetensors >= 0.8
    alone leaves the weights ``0600``), so a server running as another user reads them. Returns the
    files' bytes."""
    from safetensors.torch import save_file

    parent, leaf = os.path.split(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(folder):
        raise FileExistsError(f"{folder} exists; each adapter version is written to a fresh folder")
    tmp = os.path.join(parent, f".{leaf}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        cj = os.path.join(tmp, "adapter_config.json")
        with open(cj, "w") as f:  # 0o666 minus the umask, as PEFT's save_pretrained leaves it
            f.write(json.dumps(config, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        st = os.path.join(tmp, "adapter_model.safetensors")
        save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, st, metadata={"format": "pt"})
        # safetensors >= 0.8 creates the file 0600 whatever the umask (safetensors#782): a server
        # running as another user could not read it. Give it the mode open() gave the config.
        os.chmod(st, stat.S_IMODE(os.stat(cj).st_mode))
        _fsync(st)
        _fsync(tmp)
        os.rename(tmp, folder)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.getsize(os.path.join(folder, "adapter_model.safetensors")) + os.path.getsize(
        os.path.join(folder, "adapter_config.json"))
