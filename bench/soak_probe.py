"""What the soak counts to find leaks, read from ``/proc`` and the file system, never from logs.

* ``descendants(pid)``: every live process below the soak's own (ranks, forkserver, the vLLM server
  and its EngineCore / worker): a process weightsync or vLLM leaves behind shows up here;
* ``dir_count(path)``: entries of ``/dev/shm`` and ``/tmp`` (shared with whatever else runs on the
  machine: growth there is only a hint, the report says so);
* ``rank RSS / open fds``: each rank reports its own after every sync (``soak_rank``).

Growth per 100 syncs is a least-squares slope over the samples of one job's life (a relaunch starts
a new process: its RSS restarts), so a steady creep shows as a slope and one-off warm-up does not
dominate once the run is long.
"""

from __future__ import annotations

import os

__all__ = ["descendants", "dir_count", "slope_per_100"]


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def dir_count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return -1


def slope_per_100(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares growth of ``ys`` per 100 units of ``xs`` (None with fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
