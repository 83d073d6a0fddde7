"""``WriteQueue``: the checkpoint writer's bytes go to disk on a thread while the source gathers on.

``save_safetensors``'s writer rank hands each checked tensor to ``put``; one writer thread takes them
in order and does what the calling thread used to do between two yields -- the host copy (a device
tensor, a non-contiguous one) and the ``pwrite`` at the tensor's planned offset, plus the ``fsync``
of a file whose last tensor it wrote (``StagedFolder.write``). So the source's next gathers (and its
collectives with the other ranks) run while the previous tensors are written.

Invariants:

* **Bounded bytes.** At most ``limit`` bytes of tensors are queued (accepted by ``put`` and not yet
  written, the one being written included); ``put`` blocks until a tensor fits. A tensor larger
  than ``limit`` is accepted alone, into an empty queue, so the bound is ``max(limit, largest
  tensor)`` of tensors held beyond the moment the calling thread would have dropped them, plus one
  tensor's host copy inside the thread (what the synchronous writer held too). ``peak_queued_bytes``
  and ``peak_copy_bytes`` are the measured figures.
* **Same bytes, same order.** One thread, FIFO: tensors are written in the order they were put, each
  exactly as ``StagedFolder.write`` writes it synchronously. A CUDA tensor is copied to host on the
  stream that was current in the calling thread at ``put`` (where the source made it), so the copy is
  ordered after the kernels that produced it, as it was synchronously.
* **Errors surface in the calling thread.** The thread stops at its first error; the next ``put``
  (or ``finish``) raises that very exception, so ``save_safetensors``'s error path (board, cleanup)
  runs in the calling thread as before. ``abort`` stops the thread after the write in progress and
  joins it: the staging folder is never removed while a write is running.
* **Holding tensors.** A queued tensor is kept (by reference) until written, so a source must not
  overwrite a tensor it yielded before its pass ends; weightsync's sources and vLLM's ``ModuleSource``
  never do. ``limit=0`` writes synchronously in the calling thread (no thread, nothing held).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from weightsync.sources.toolkit import get_logger

from .files import StagedFolder
from .plan import PlannedTensor

__all__ = ["WriteQueue", "DEFAULT_WRITE_QUEUE_BYTES"]

logger = get_logger(__name__)

#: Default bound of the write queue: 256 MiB of tensors (on the tensors' device: GPU memory for a
#: source that yields GPU tensors).
DEFAULT_WRITE_QUEUE_BYTES = 256 * 2**20


class WriteQueue:
    """Writes ``(entry, tensor)`` pairs into ``staged`` on a thread, at most ``limit`` bytes queued."""

    def __init__(self, staged: StagedFolder, limit: int) -> None:
        self.staged = staged
        self.limit = limit
        self.peak_queued_bytes = 0
        self.peak_copy_bytes = 0
        self.written = 0
        self._items: collections.deque = collections.deque()
        self._queued = 0
        self._error: BaseException | None = None
        self._closing = False
        self._abort = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        if limit > 0:
            self._thread = threading.Thread(target=self._run, name="weightsync-checkpoint-writer", daemon=True)
            self._thread.start()

    def put(self, entry: PlannedTensor, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` for ``entry``'s place (blocks while the queue is full); raises the writer
        thread's error if it failed."""
        if self._thread is None:
            self.peak_copy_bytes = max(self.peak_copy_bytes, self.staged.write(entry, tensor))
            self.written += 1
            return
        nbytes = tensor.numel() * tensor.element_size()
        stream = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None
        with self._cv:
            while self._items and self._queued + nbytes > self.limit and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            self._items.append((entry, tensor, stream, nbytes))
            self._queued += nbytes
            self.peak_queued_bytes = max(self.peak_queued_bytes, self._queued)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closing:
                    self._cv.wait()
                if self._abort or not self._items:
                    return
                entry, tensor, stream, nbytes = self._items[0]
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        copied = self.staged.write(entry, tensor)
                else:
                    copied = self.staged.write(entry, tensor)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread as it is
                with self._cv:
                    self._error = e
                    self._items.clear()
                    self._queued = 0
                    self._cv.notify_all()
                return
            del tensor
            with self._cv:
                if self._abort:
                    return
                self._items.popleft()
                self._queued -= nbytes
                self.written += 1
                self.peak_copy_bytes = max(self.peak_copy_bytes, copied)
                self._cv.notify_all()

    def finish(self) -> None:
        """Wait until every queued tensor is written; raise the writer thread's error if any."""
        if self._thread is not None:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Drop what is queued, let the write in progress end, join the thread (never raises)."""
        if self._thread is None:
            return
        with self._cv:
            self._abort = self._closing = True
            self._items.clear()
            self._queued = 0
            self._cv.notify_all()
        self._thread.join()
        self._thread = None

    def stats(self) -> dict[str, Any]:
        return {
            "write_queue_bytes": self.limit,
            "peak_queued_bytes": self.peak_queued_bytes,
            "peak_copy_bytes": self.peak_copy_bytes,
        }
