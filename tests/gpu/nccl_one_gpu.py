"""Where the members of an NCCL transfer group run: one GPU each, or -- with NCCL 2.30+'s
``NCCL_MULTI_RANK_GPU_ENABLE=1`` and the ferried library (``.ci/nccl_ferry.py``) -- all on GPU 0.

Invariant: a part gets devices only when NCCL will really accept the placement. Several members on
one GPU need the multi-rank mode *and* an NCCL that has it (the device image's 2.28.9 refuses with
"Duplicate GPU detected"), loaded by vLLM (``VLLM_NCCL_SO_PATH``) and by torch's own process groups
(``LD_PRELOAD``: torch links ``libnccl.so.2`` by soname, so without it a trainer process would hold
two NCCLs). ``.ci/gpu`` sets all of these for the ``nccl_*`` parts only (``run_all.NCCL_ENV``).
"""

from __future__ import annotations

import os
from typing import Any

#: NCCL's own advice for several ranks per GPU: few CTAs each (docs/gpu.md has the measured effect)
DEFAULT_MAX_CTAS = "32"


def ferried_library() -> str | None:
    """The NCCL the one-GPU parts run on (``WS_NCCL_SO``), if it is there."""
    path = os.environ.get("WS_NCCL_SO")
    return path if path and os.path.exists(path) else None


def multi_rank() -> bool:
    """True when this process runs under the one-GPU NCCL environment (see the module docstring)."""
    return os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and ferried_library() is not None


def place(members: int) -> list[str] | None:
    """``members`` CUDA devices for one NCCL group: distinct GPUs while there are enough, else all on
    ``cuda:0`` under the multi-rank mode; None when neither is possible (``why_not`` says why)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= members:
        return [f"cuda:{i}" for i in range(members)]
    if n >= 1 and multi_rank():
        return ["cuda:0"] * members
    return None


def why_not(members: int) -> str:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"needs {members} NCCL members: {members} GPUs, or one GPU with NCCL >= 2.30's "
            f"NCCL_MULTI_RANK_GPU_ENABLE=1 and the ferried library (WS_NCCL_SO; docs/gpu.md 'NCCL on one GPU'); "
            f"this machine has {n} GPU(s), multi-rank {'on' if multi_rank() else 'off'}")


def patch_vllm_stream() -> None:
    """The device kit's vLLM has no compiled platform, so ``vllm.utils.torch_utils.current_stream``
    cannot pick CUDA's stream and ``PyNcclCommunicator`` fails with "Fail to set current stream";
    where that is so, its stream lookup becomes torch's (the stream every caller here runs on).
    A full vLLM install is left as it is."""
    import torch

    from vllm.platforms import current_platform

    if current_platform.is_cuda() or not torch.cuda.is_available():
        return
    import vllm.distributed.device_communicators.pynccl as pynccl

    pynccl.current_stream = torch.cuda.current_stream  # type: ignore[attr-defined]


def loaded_nccl(comm: object) -> str:
    """What a vLLM communicator says it loaded: version and library path (for the parts' numbers)."""
    from vllm.utils.nccl import find_nccl_library

    version = getattr(comm, "nccl_version", None)
    if isinstance(version, int):
        version = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"NCCL {version} from {find_nccl_library()} (disabled={getattr(comm, 'disabled', None)})"


def run_processes(procs: list[Any], queue: Any, timeout_s: float, what: str) -> dict[int, Any]:
    """Start ``procs`` (spawned; each puts one ``(rank, "ok" | "error", value)`` on ``queue``), collect
    every rank's value within ``timeout_s``, then join them, killing any left; raises naming the ranks
    that hung and every rank's error."""
    import queue as queue_mod
    import time

    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(procs) and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(len(procs)) if r not in out]
    errors = {r: v for r, (st, v) in out.items() if st != "ok"}
    if missing or errors:
        raise RuntimeError(f"{what}: ranks {missing} hung (> {timeout_s:g}s); errors: "
                           + "; ".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
    return {r: v for r, (_, v) in out.items()}
