"""Timing pieces the GPU benchmarks share: a device sync, timed repetitions, the copy floor.

A timing is wall time between two device synchronizations, so it covers what the host issued and
what the device ran; the first ``warmup`` repetitions (allocator, lazy init) are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def sync(device: str) -> None:
    """Wait for the device (no-op on CPU)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], *, device: str, reps: int, warmup: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def interleaved(fns: dict[str, Callable[[], object]], *, device: str, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` per repetition, called in a rotating order (rep ``k`` starts with the
    ``k``-th): a slow drift of the machine lands on every function alike. ``warmup`` reps dropped."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(warmup + reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            fns[name]()
            sync(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def copy_floor(nbytes: int, *, device: str, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of a device-to-device copy of ``nbytes`` (one flat buffer), per repetition."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = timed(lambda: dst.copy_(src), device=device, reps=reps, warmup=warmup)
    del src, dst
    if str(device).startswith("cuda"):
        # hand the two model-sized buffers back to the driver: a receiver process started after
        # this (bench_gpu_sizes --ipc) cannot use memory held by this process's caching allocator
        torch.cuda.empty_cache()
    return out
