"""A checkpoint folder that appears whole or not at all: staged next to its target, renamed into place.

``StagedFolder`` is the writer rank's side of ``save_safetensors``. Invariants:

* **Nothing under the target until commit.** Every byte goes to a fresh temporary folder created
  next to the target (``.<name>.weightsync-XXXX.tmp``, same parent, hence the same filesystem, so
  the final ``rename`` is atomic). ``discard()`` removes it; ``commit()`` renames it onto the target.
  A crash (SIGKILL, power loss) can leave that temporary folder behind but never a partial target.
* **Overwrite keeps the old checkpoint until the new one is complete.** An existing non-empty target
  is swapped with the staged folder in one ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15), then the
  old one is deleted; where the filesystem cannot exchange, it is renamed aside, the new one renamed
  in (the old one renamed back if that fails), then the old one deleted. A failed export with
  ``overwrite=True`` leaves the old checkpoint as it was.
* **Disk space is reserved before any collective byte moves.** Each shard file gets its header and
  ``posix_fallocate`` of its final size at creation, so a disk that cannot hold the checkpoint fails
  there (``ENOSPC``/``EFBIG``) instead of mid-stream; filesystems without ``fallocate`` skip the
  reservation and a full disk then fails at the write, with the same cleanup.
* **Each tensor is written once, at its planned offset** (``pwrite``), straight from the tensor's
  own memory when it is a contiguous CPU tensor; otherwise from one host copy of that tensor only
  (``write`` returns the bytes it had to copy, which is what ``peak_extra_bytes`` reports).
  A file is ``fsync``-ed and closed as soon as its last tensor is written; the folder is ``fsync``-ed
  before the rename and the parent after it.
* **Permissions as ``save_pretrained`` leaves them.** The folder is created with mode ``0o777`` and
  every file with ``0o666``, both minus the process umask (what ``os.makedirs`` and ``open`` do for
  ``save_pretrained``: ``0755`` / ``0644`` under umask 022), never ``mkdtemp``'s ``0700``, so a vLLM
  server running as another user can read the checkpoint. A target folder that already exists keeps
  its own mode (``save_pretrained`` writes into it). Shards follow the umask too, as every other
  file of ``save_pretrained`` does; safetensors >= 0.8's own ``save_file`` creates them ``0600``
  whatever the umask (a temp-file regression, safetensors#782), which is not copied here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
import sys
import tempfile
from typing import Any

import torch

from weightsync.sources import CheckpointError
from weightsync.sources.toolkit import get_logger

from .plan import CheckpointPlan, PlannedTensor

__all__ = ["StagedFolder", "check_target", "replace_folder", "mkdir_unique", "fsync_dir"]

logger = get_logger(__name__)

#: ``fallocate`` errors that mean "this filesystem cannot reserve": skip the reservation.
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def mkdir_unique(parent: str, prefix: str, suffix: str = "") -> str:
    """A new folder ``parent/<prefix>XXXXXXXX<suffix>`` created with ``os.mkdir(0o777)`` (the umask
    applies, as for ``os.makedirs``), unlike ``tempfile.mkdtemp``'s ``0700``."""
    for _ in range(100):
        path = os.path.join(parent, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free staging folder name {prefix}*{suffix} in {parent}")


def check_target(path: str, *, overwrite: bool, rank: int) -> None:
    """Raise ``CheckpointError`` unless ``path`` may receive a checkpoint folder: absent, an empty
    folder, or (``overwrite=True``) a non-empty folder. A file is never replaced."""
    if os.path.islink(path) and not os.path.exists(path):
        raise CheckpointError(f"rank {rank}: checkpoint target {path} is a dangling symlink")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise CheckpointError(f"rank {rank}: checkpoint target {path} exists and is not a folder")
    entries = sorted(os.listdir(path))
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise CheckpointError(
            f"rank {rank}: checkpoint target {path} exists and is not empty ({shown}); pass "
            "overwrite=True (CLI: --overwrite) to replace it"
        )


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _host_bytes(tensor: torch.Tensor) -> tuple[memoryview, int]:
    """The tensor's bytes as a memoryview, and how many bytes had to be copied to get them."""
    t = tensor.detach()
    copied = 0
    if t.device.type != "cpu":
        t = t.to("cpu")
        copied = t.numel() * t.element_size()
    if not t.is_contiguous():
        t = t.contiguous()
        copied = t.numel() * t.element_size()
    if t.numel() == 0:
        return memoryview(b""), copied
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()), copied


def fsync_dir(path: str) -> None:
    """``fsync`` the folder ``path`` itself: makes the creations, renames and removals of its entries
    durable (a file's own ``fsync`` does not cover its name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_folder(tmp: str, path: str) -> None:
    """Put the complete folder ``tmp`` at ``path`` in place of the existing one, keeping the old one
    until the new one is in: one ``renameat2(RENAME_EXCHANGE)``, else rename aside, rename in (the
    old one renamed back if that fails); then the old one is deleted."""
    if _exchange(tmp, path):
        old = tmp  # the exchange put the old folder at the staging name
    else:
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.weightsync-old-", dir=os.path.dirname(path))
        os.rename(path, old)  # onto the empty folder just made
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    shutil.rmtree(old, ignore_errors=True)


class StagedFolder:
    """The writer's temporary folder for ``plan``, next to ``path`` (see the module docstring)."""

    def __init__(self, path: str, plan: CheckpointPlan, *, overwrite: bool, rank: int) -> None:
        self.path = path
        self.plan = plan
        self.overwrite = overwrite
        self.rank = rank
        self._fds: dict[int, int] = {}
        self._left = [len(f.names) for f in plan.files]
        check_target(path, overwrite=overwrite, rank=rank)
        parent = os.path.dirname(path) or "."
        try:
            os.makedirs(parent, exist_ok=True)
            self.tmp = mkdir_unique(parent, f".{os.path.basename(path)}.weightsync-", ".tmp")
        except OSError as e:
            raise CheckpointError(f"rank {rank}: cannot create a staging folder next to {path}: {e}") from e
        try:
            for k, f in enumerate(plan.files):
                self._create(k)
        except BaseException:
            self.discard()
            raise

    def _file(self, k: int) -> str:
        return os.path.join(self.tmp, self.plan.files[k].name)

    def _create(self, k: int) -> None:
        f = self.plan.files[k]
        fd = os.open(self._file(k), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._fds[k] = fd
        try:
            os.posix_fallocate(fd, 0, f.size)
        except OSError as e:
            if e.errno not in _NO_FALLOCATE:
                raise CheckpointError(
                    f"rank {self.rank}: cannot reserve {f.size} bytes for {f.name} next to {self.path} "
                    f"({os.strerror(e.errno) if e.errno else e}); nothing was written"
                ) from e
        _pwrite_all(fd, memoryview(f.header), 0)
        if not f.names:
            self._close(k)

    def _close(self, k: int) -> None:
        fd = self._fds.pop(k)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, entry: PlannedTensor, tensor: torch.Tensor) -> int:
        """Write ``tensor`` at ``entry``'s place; return the bytes copied to host to do it."""
        data, copied = _host_bytes(tensor)
        if len(data) != entry.nbytes:
            raise CheckpointError(
                f"rank {self.rank}: tensor {entry.name!r} has {len(data)} bytes, the plan of "
                f"{self.plan.files[entry.file].name} reserves {entry.nbytes}"
            )
        try:
            _pwrite_all(self._fds[entry.file], data, entry.offset)
            self._left[entry.file] -= 1
            if self._left[entry.file] == 0:
                self._close(entry.file)
        except OSError as e:
            raise CheckpointError(
                f"rank {self.rank}: writing tensor {entry.name!r} to "
                f"{self.plan.files[entry.file].name} (staged in {self.tmp}) failed: {e}"
            ) from e
        return copied

    def write_text(self, name: str, text: str) -> None:
        """A small metadata file (index, config): written, fsync-ed, closed."""
        fd = os.open(os.path.join(self.tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _pwrite_all(fd, memoryview(text.encode("utf-8")), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def save_with(self, obj: Any, filename: str) -> None:
        """``obj.save_pretrained(staging folder)`` (a transformers config / generation config), then
        fsync what it wrote (``filename``)."""
        obj.save_pretrained(self.tmp)
        fd = os.open(os.path.join(self.tmp, filename), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        """Rename the staged folder onto the target (see the module docstring)."""
        open_files = [self.plan.files[k].name for k in self._fds]
        if open_files:
            raise CheckpointError(
                f"rank {self.rank}: {len(open_files)} file(s) still miss tensors at commit "
                f"(first {open_files[0]}); refusing to publish {self.path}"
            )
        fsync_dir(self.tmp)
        parent = os.path.dirname(self.path) or "."
        if os.path.isdir(self.path):  # save_pretrained writes into it: the folder keeps its mode
            os.chmod(self.tmp, stat.S_IMODE(os.stat(self.path).st_mode))
        if os.path.isdir(self.path) and os.listdir(self.path):
            check_target(self.path, overwrite=self.overwrite, rank=self.rank)  # appeared meanwhile
            self._replace()
        else:
            os.rename(self.tmp, self.path)  # onto nothing, or onto an empty folder
        self.tmp = None
        fsync_dir(parent)

    def _replace(self) -> None:
        replace_folder(self.tmp, self.path)

    def discard(self) -> None:
        """Close everything and remove the staging folder (idempotent; never raises)."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        if getattr(self, "tmp", None):
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
