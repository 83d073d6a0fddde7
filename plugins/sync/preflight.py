"""Transport preflight: refuse an engine that would report success without moving bytes.

vLLM 0.33's ``PyNcclCommunicator`` disables itself instead of failing when it cannot load NCCL (the
library is missing, or too old for the symbols vLLM binds, e.g. ``ncclCommSuspend`` missing in NCCL
2.28.9), when ``VLLM_DISABLE_PYNCCL`` is set, or when its group has one member. A disabled
communicator turns every ``broadcast`` into ``return``: ``send_weights()`` succeeds, the inference
side keeps whatever its buffers held. ``check_engine`` inspects the engine that
``WeightTransferTrainerFactory.trainer_init`` built, on every rank, right after it was built:

* NCCL (anything carrying ``model_update_group``): on the sender, the communicator exists, is
  ``available`` and not ``disabled``, is rank 0 of its group, has at least one receiver, and its world
  size equals ``expected_world_size`` (or the client's ``nccl_world_size()``, when it has one);
* NCCL with many senders (vLLM 0.34: the source's metadata names first owners other than rank 0,
  ``broadcast_ranks``): every broadcasting rank checks its own communicator the same way (enabled,
  its group rank is its place among the broadcasters), and the group size is the broadcasters plus
  the workers (the client's ``nccl_world_size()`` counts one trainer sender). vLLM 0.34 already
  refuses a disabled communicator at ``trainer_init`` (``_require_usable_communicator``); this check
  names the rank and stays for 0.33 and for communicators disabled after init.
* IPC (``IPCTrainerWeightTransferEngine``): CUDA is available and this rank owns every parameter;
* any engine: a ``preflight()`` method, if it has one, is called (the hook for other backends).

Invariant: the verdicts of all ranks are exchanged in one bounded gloo all-gather (only the sender
can see the communicator), so a bad transport raises on **every** rank, naming the rank and the
cause, before any byte moves. Nothing here touches a tensor or issues a device collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources import PreflightError, SilentTransportError
from weightsync.sources.toolkit import DEFAULT_TIMEOUT_S, broadcast_ranks, control_group, get_logger, multi_rank

__all__ = [
    "PreflightError", "PreflightReport", "check_engine", "check_weights_changed", "nccl_library_report",
    "pynccl_disabled_cause",
]

logger = get_logger(__name__)


@dataclass
class PreflightReport:
    """What ``check_engine`` verified on this rank (``checks``) and for which engine."""

    engine: str
    is_sender: bool
    checks: list[str] = field(default_factory=list)


def check_engine(
    engine: Any,
    *,
    expected_world_size: int | None = None,
    agree: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PreflightReport:
    """Raise ``SilentTransportError`` / ``PreflightError`` on every rank if ``engine`` cannot move
    bytes; return what was checked otherwise.

    Call it on every trainer rank right after ``trainer_init`` (``WeightSync`` does). With
    ``agree=False`` only this rank's own findings raise (no collective).
    """
    report = PreflightReport(
        engine=type(engine).__name__, is_sender=bool(getattr(engine, "is_sender", False))
    )
    rank = _rank(engine)
    error: BaseException | None = None
    try:
        _check_local(engine, report, rank, expected_world_size)
    except Exception as e:  # noqa: BLE001 - every rank must hear it, whatever it is
        error = e
    if agree and multi_rank():
        mine = None if error is None else (type(error).__name__, str(error))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (rank, mine), group=control_group(timeout_s=timeout_s))
        failed = [(r, m) for r, m in everyone if m is not None]
        if failed and error is None:
            r, (kind, message) = failed[0]
            cls = SilentTransportError if kind == SilentTransportError.__name__ else PreflightError
            raise cls(f"rank {rank}: transport preflight failed on rank {r}: {message}")
    if error is not None:
        raise error
    logger.debug("preflight of %s passed: %s", report.engine, "; ".join(report.checks))
    return report


def _rank(engine: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(getattr(engine, "rank", 0))


def _check_local(engine: Any, report: PreflightReport, rank: int, expected: int | None) -> None:
    if engine is None:
        raise PreflightError(f"rank {rank}: no trainer engine (trainer_init returned None)")
    name = type(engine).__name__
    if hasattr(engine, "model_update_group"):
        _check_nccl(engine, report, rank, expected)
    if name == "IPCTrainerWeightTransferEngine" or hasattr(engine, "gpu_uuid"):
        _check_ipc(engine, report, rank)
    hook = getattr(engine, "preflight", None)
    if callable(hook):
        hook()
        report.checks.append(f"{name}.preflight()")
    if not report.checks:
        logger.info("no transport preflight known for %s; only the source checks apply", name)


def _check_nccl(engine: Any, report: PreflightReport, rank: int, expected: int | None) -> None:
    source = getattr(engine, "source", None)
    metadata = getattr(source, "metadata", None)
    group = broadcast_ranks(metadata) if isinstance(metadata, list) else [0]
    if not engine.is_sender and rank not in group:
        report.checks.append("nccl: non-sender holds no communicator (joins only the gathers)")
        return
    where = group.index(rank) if rank in group else 0
    comm = engine.model_update_group
    if comm is None:
        raise SilentTransportError(
            f"rank {rank}: the NCCL sender has no communicator (model_update_group is None): "
            "trainer_init did not open the trainer endpoint, or the engine was shut down"
        )
    world = getattr(comm, "world_size", None)
    if getattr(comm, "disabled", False) or not getattr(comm, "available", True):
        raise SilentTransportError(
            f"rank {rank}: vLLM's NCCL communicator is disabled "
            f"(available={getattr(comm, 'available', None)}, disabled={getattr(comm, 'disabled', None)}), "
            f"so every broadcast would return without sending and send_weights() would report "
            f"success while the inference side keeps stale weights. Cause: {_nccl_cause(comm)}"
        )
    report.checks.append("nccl: communicator enabled")
    if getattr(comm, "rank", where) != where:
        raise PreflightError(
            f"rank {rank}: this NCCL sender is rank {comm.rank} of its transfer group, not {where} "
            f"(its place among the broadcasting trainer ranks {group}); vLLM's workers receive "
            "each broadcaster's turn from that group rank"
        )
    if world is not None and world <= len(group):
        raise SilentTransportError(
            f"rank {rank}: the NCCL transfer group has world_size {world}: no inference worker "
            "is in it, nothing would receive"
        )
    if not engine.is_sender:
        report.checks.append(f"nccl: broadcaster {where} of {group}, communicator enabled")
        return
    if expected is None:
        probe = getattr(engine.client, "nccl_world_size", None)
        if callable(probe):
            expected = int(probe()) - 1 + len(group)  # nccl_world_size() counts one trainer sender
    if expected is not None and world is not None:
        if world != expected:
            raise PreflightError(
                f"rank {rank}: the NCCL transfer group has world_size {world} but the inference "
                f"side needs {expected} ({len(group)} trainer sender(s) {group} + {expected - len(group)} "
                "workers): the broadcast would wait for ranks that never join, or leave workers without weights"
            )
        report.checks.append(f"nccl: world_size {world} matches the inference side")
    elif world is not None:
        report.checks.append(f"nccl: world_size {world} (not compared: no expected size known)")


def _nccl_cause(comm: Any) -> str:
    world = getattr(comm, "world_size", None)
    if world == 1:
        return "its group has world_size 1 (no inference worker joined)"
    if os.environ.get("VLLM_DISABLE_PYNCCL", "0") not in ("", "0", "false", "False"):
        return "VLLM_DISABLE_PYNCCL is set in the trainer's environment"
    if getattr(comm, "nccl", None) is None:
        return f"vLLM could not load the NCCL library: {nccl_library_report()}"
    version = getattr(comm, "nccl_version", None)
    return f"the communicator was destroyed or shut down (NCCL raw version {version})"


def pynccl_disabled_cause() -> str:
    """Why vLLM's ``PyNcclCommunicator`` disabled itself, from the environment, for the note on
    ``trainer_init``'s error (vLLM 0.34 raises there; 0.33 went on and ``check_engine`` catches it)."""
    if os.environ.get("VLLM_DISABLE_PYNCCL", "0") not in ("", "0", "false", "False"):
        return "vLLM disabled its NCCL communicator because VLLM_DISABLE_PYNCCL is set in the trainer's environment"
    return f"vLLM disabled its NCCL communicator: it could not load the NCCL library: {nccl_library_report()}"


def nccl_library_report() -> str:
    """Which NCCL library vLLM loads (``VLLM_NCCL_SO_PATH`` or the soname), the file and version that
    name resolves to in this process, and which of the symbols vLLM's wrapper binds it lacks -- the
    reason vLLM's ``PyNcclCommunicator`` disables itself (e.g. NCCL 2.28.9 has no ``ncclCommSuspend``)."""
    import ctypes

    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
        from vllm.utils.nccl import find_nccl_library

        name = find_nccl_library()
        wanted = [f.name for f in NCCLLibrary.exported_functions]
    except Exception as e:  # noqa: BLE001 - this report must never raise
        return f"(vLLM's NCCL wrapper is not importable here: {type(e).__name__}: {e})"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        return f"{name!r} does not load here ({e}); install NCCL or point VLLM_NCCL_SO_PATH at it"
    version = "?"
    try:
        v = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(v)) == 0:
            version = f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}"
    except AttributeError:
        pass
    missing = [n for n in wanted if not hasattr(lib, n)]
    where = f"{name!r} ({_loaded_path(lib) or 'path unknown'}, NCCL {version})"
    if not missing:
        return (f"{where} has every symbol vLLM binds, so the library that failed is another one (a library_path "
                "given to PyNcclCommunicator), or it failed for another reason; an NCCL older than the symbols "
                "vLLM binds (e.g. ncclCommSuspend, absent before 2.29.7) is the usual one")
    return (f"{where} lacks {', '.join(missing)}, which vLLM's NCCL wrapper binds; install the NCCL vLLM "
            "was built against or point VLLM_NCCL_SO_PATH at one that has them")


def _loaded_path(lib: Any) -> str | None:
    """The file a ``ctypes.CDLL`` handle was loaded from (glibc's ``dlinfo(RTLD_DI_LINKMAP)``)."""
    import ctypes

    class _LinkMap(ctypes.Structure):
        _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]

    try:
        dlinfo = ctypes.CDLL(None).dlinfo
        lm = ctypes.POINTER(_LinkMap)()
        if dlinfo(ctypes.c_void_p(lib._handle), 2, ctypes.byref(lm)) != 0:  # 2: RTLD_DI_LINKMAP
            return None
        return lm.contents.l_name.decode() or None
    except (AttributeError, OSError, ValueError):
        return None


def _check_ipc(engine: Any, report: PreflightReport, rank: int) -> None:
    if not torch.cuda.is_available():
        raise PreflightError(
            f"rank {rank}: the IPC engine shares CUDA memory, but CUDA is not available on this rank"
        )
    source = getattr(engine, "source", None)
    if source is not None:
        owned = len(source.owned_names(rank))
        total = len(source.metadata)
        if owned != total:
            raise PreflightError(
                f"rank {rank}: the IPC engine needs every trainer rank to own every parameter; "
                f"this rank owns {owned} of {total}"
            )
    report.checks.append("ipc: CUDA available, every parameter owned")


def check_weights_changed(
    before: Mapping[str, str],
    after: Mapping[str, str],
    *,
    what: str = "the served weights",
) -> list[str]:
    """Compare two ``POST /weight_checker {"action": "checksum"}`` results taken around a sync whose
    weights differ from the served ones; return the changed keys, or raise ``SilentTransportError``
    if none changed (the transport reported success but nothing landed)."""
    if not after:
        raise SilentTransportError(f"{what}: the receiver reported no checksums after the sync")
    changed = [k for k in after if before.get(k) != after[k]]
    if not changed:
        raise SilentTransportError(
            f"{what}: none of the {len(after)} checksums changed across a sync that sent different "
            "weights: the transport reported success without delivering"
        )
    return changed
