"""What the delta-sync GPU parts (``part_delta.py``, ``part_sparse_nccl.py``) share: a receiver model
for vLLM's sparse apply, bitwise comparisons, and the CPU stand-ins of the dry run.

Invariants:

* ``CheckpointTensors`` holds one tensor per checkpoint name (as declared by a source's metadata)
  and its ``load_weights`` ends every write in one same-shaped floating ``Tensor.copy_`` -- the only
  loader vLLM 0.33's ``load_checkpoint_weight_patches`` supports for sparse patches (it swaps
  ``copy_`` for a NaN-masked ``torch.where``). It is strict: an unknown name, a shape or a dtype that
  differs raises, so a round cannot pass by landing somewhere else.
* Comparisons are on the integers of the bytes (``bits``), never on float values: ``-0.0`` vs ``0.0``
  and NaN payloads count, exactly as ``DeltaSource`` diffs.
* The dry-run stand-ins replace only what a CPU cannot run -- vLLM's ``PyNcclCommunicator`` (by
  ``GlooCommunicator``, the same ``broadcast(tensor, src, stream)`` / ``disabled`` / ``destroy``
  surface over a gloo group between the two processes) and the CUDA stream / device-sync calls
  vLLM's sparse engines make unconditionally. The engines, their update info, the rendezvous
  lifecycle and vLLM's apply are the real ones.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from typing import Any

import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # tests/gloo_comm.py: the communicator stand-in the CPU worlds use too
    sys.path.insert(0, _TESTS)
from gloo_comm import GlooCommunicator  # noqa: E402

__all__ = ["CheckpointTensors", "bits", "bitwise_equal", "changed_indices", "GlooCommunicator",
           "install_cpu_standins", "install_old_nccl_shim", "OLD_NCCL_MISSING", "free_port", "start_sparse_worker"]

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened as the integers of its bytes (a view where ``t`` is contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(_INT_OF[flat.element_size()]) if flat.dtype.is_floating_point else flat


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (compared where ``a`` lives)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bool(
        torch.equal(bits(a), bits(b.to(a.device))))


def changed_indices(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions (ascending) where the bytes of ``after`` differ from ``before``: the dense
    oracle a round's patch set must equal (computed where the tensors live)."""
    return (bits(before) != bits(after)).nonzero().view(-1)


class CheckpointTensors(torch.nn.Module):
    """A stand-in vLLM model: one tensor per checkpoint name, written by ``load_weights`` with one
    same-shaped ``copy_`` per tensor (see the module docstring). Starts filled with ``fill`` (not
    what any trainer holds), so only what a round delivers can make it equal a dense pass."""

    def __init__(self, metas: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device | str,
                 fill: float = 0.123) -> None:
        super().__init__()
        self.held: dict[str, torch.Tensor] = {
            name: torch.full(tuple(shape), fill, dtype=dtype, device=device) for name, dtype, shape in metas
        }
        self.loads = 0
        #: test hook: the next ``load_weights`` writes the first half of its tensors (none if it got
        #: one), then raises (a worker left in an unknown state, as vLLM documents for a failed apply).
        self.fail_next = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        fail, self.fail_next = self.fail_next, False
        done: set[str] = set()
        for i, (name, t) in enumerate(weights):
            dst = self.held.get(name)
            if dst is None:
                raise KeyError(f"CheckpointTensors: unknown checkpoint name {name!r}")
            if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                raise ValueError(f"CheckpointTensors: {name!r} is {tuple(t.shape)} {t.dtype}, "
                                 f"held {tuple(dst.shape)} {dst.dtype}")
            if fail and i >= len(weights) // 2:
                raise RuntimeError(f"injected: load_weights failed after {i} of {len(weights)} tensors")
            dst.copy_(t)
            done.add(name)
        self.loads += 1
        return done

    def scramble(self, name: str) -> None:
        """Overwrite one held tensor with other values (a worker state no round produced)."""
        t = self.held[name]
        t.copy_(torch.full_like(t, -7.25))


# ---- dry run: CPU stand-ins for what only CUDA + NCCL can run -------------------------------------------


def free_port() -> int:
    """A TCP port free on this host now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_cpu_standins(side: str) -> None:
    """Dry run only: make vLLM's sparse engines run on CPU in this process. ``side`` "trainer" or
    "worker": the engine module's communicator constructor becomes ``GlooCommunicator``; CUDA stream
    lookups return None and ``torch.accelerator.synchronize`` is a no-op (vLLM calls both
    unconditionally; a CPU-only host has no CUDA driver)."""
    import vllm.distributed.weight_transfer.sparse_nccl_engine as sne

    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    if side == "trainer":
        sne.open_trainer_endpoint = lambda info: GlooCommunicator(  # type: ignore[assignment]
            info.master_address, info.master_port, 0, info.world_size)
    else:
        def worker_group(init_info: Any, parallel_config: Any) -> GlooCommunicator:
            rank = init_info.rank_offset + parallel_config.data_parallel_index * parallel_config.world_size \
                + parallel_config.rank
            return GlooCommunicator(init_info.master_address, init_info.master_port, rank, init_info.world_size)

        sne.worker_init_process_group = worker_group  # type: ignore[assignment]


#: the symbols vLLM 0.33's NCCL wrapper binds that NCCL < 2.29.7 lacks (2.28.9 on the device image);
#: ``PyNcclCommunicator`` calls them only after ``has_symbol`` says they exist (``suspend`` / ``resume``).
OLD_NCCL_MISSING = ("ncclCommSuspend", "ncclCommResume")


def install_old_nccl_shim() -> str:
    """Opt-in (``part_sparse_nccl.py --old-nccl-shim``): let vLLM's ``NCCLLibrary`` load an NCCL that
    lacks ``OLD_NCCL_MISSING``, instead of failing the load -- which makes ``PyNcclCommunicator``
    disable itself and every broadcast a silent no-op. Only the list of symbols bound at load time
    changes (``OLD_NCCL_MISSING`` only: any other missing symbol still disables the communicator, and
    the preflight says so); the communicator, the engines and their broadcasts are vLLM's, and the
    probe still has to see a known tensor arrive. Call before any communicator is built, in every
    process. Returns which of ``OLD_NCCL_MISSING`` the library vLLM would load lacks."""
    import ctypes

    from vllm.distributed.device_communicators import pynccl_wrapper as pw
    from vllm.utils.nccl import find_nccl_library

    try:
        lib = ctypes.CDLL(find_nccl_library())
        lacks = [n for n in OLD_NCCL_MISSING if not hasattr(lib, n)]
        found = f"{find_nccl_library()} lacks {lacks or 'none of them'}"
    except Exception as e:  # noqa: BLE001 - e.g. no NCCL library on a CPU host
        found = f"{find_nccl_library()} not loadable here ({type(e).__name__})"
    pw.NCCLLibrary.exported_functions = [f for f in pw.NCCLLibrary.exported_functions
                                         if f.name not in OLD_NCCL_MISSING]
    return found


# ---- the worker process of part_sparse_nccl: vLLM's real SparseNCCLWeightTransferEngine -------------------


def _worker_main(conn: Any, device_str: str, dry_run: bool, old_nccl_shim: bool) -> None:
    """A vLLM worker reduced to its weight-transfer engine: ``SparseNCCLWeightTransferEngine`` (vLLM's,
    unmodified) over a ``CheckpointTensors`` model; ``mtp_validation`` stubbed as ``receiver.py``
    does (its import chain needs the serving stack). Answers the four ``VLLMWeightSyncClient`` calls
    plus test-only ones (build, digests, the preflight probe, fault injection)."""
    import traceback
    import types

    from hf_side import digest
    from receiver import _stub_mtp_validation, preload_checkpoint_weight_patch

    _stub_mtp_validation()
    preload_checkpoint_weight_patch()
    device = torch.device(device_str)
    if dry_run:
        install_cpu_standins("worker")
    else:
        from nccl_one_gpu import patch_vllm_stream

        torch.cuda.set_device(device)
        patch_vllm_stream()
    if old_nccl_shim:
        install_old_nccl_shim()
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine

    pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
    model: CheckpointTensors | None = None
    engine: Any = None
    while True:
        method, arg = conn.recv()
        try:
            result: Any = None
            if method == "stop":
                if engine is not None:
                    engine.shutdown()
                conn.send(("ok", None))
                return
            if method == "build":  # a fresh model (other values than any trainer) and a fresh engine
                if engine is not None:
                    engine.shutdown()
                model = CheckpointTensors(arg, device)
                engine = SparseNCCLWeightTransferEngine(WeightTransferConfig(backend="sparse_nccl"), vcfg,
                                                        device, model)
            elif method == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif method == "start_weight_update":
                engine.start_weight_update()
            elif method == "update_weights":
                for info in arg if isinstance(arg, list) else [arg]:
                    engine.update_weights(info)
            elif method == "finish_weight_update":
                engine.finish_weight_update()
            elif method == "digests":
                result = {n: digest(t) for n, t in model.held.items()}
            elif method == "fail_next":
                model.fail_next = True
            elif method == "scramble":
                model.scramble(arg)
            elif method == "comm":  # what the worker's communicator says about itself
                c = engine.model_update_group
                result = None if c is None else {k: str(getattr(c, k, None)) for k in
                                                 ("device", "rank", "world_size", "available", "disabled")}
            elif method == "disable":  # the silent no-op mode of an old NCCL, on / off; returns the old value
                result = bool(engine.model_update_group.disabled)
                engine.model_update_group.disabled = bool(arg)
            elif method == "probe_recv":  # receive the preflight's known tensor, as a fill-initialized buffer
                numel, dtype_name = arg
                c = engine.model_update_group
                buf = torch.full((numel,), -1, dtype=getattr(torch, dtype_name), device=c.device)
                stream = torch.cuda.current_stream(device=c.device) if c.device.type == "cuda" else None
                c.broadcast(buf, src=0, stream=stream)
                if c.device.type == "cuda":
                    torch.cuda.synchronize(c.device)
                result = buf.cpu()
            elif method == "shutdown_engine":
                engine.shutdown()
            else:
                raise ValueError(f"unknown worker call {method!r}")
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


def start_sparse_worker(device: str, dry_run: bool, old_nccl_shim: bool = False, timeout_s: float = 120.0) -> Any:
    """Spawn the worker process on ``device`` (``cuda:1``, or ``cpu`` for the dry run); returns
    ``receiver.PipeClient`` (vLLM's ``VLLMWeightSyncClient`` over a pipe, plus ``call``)."""
    import multiprocessing as mp
    import os
    import sys

    from receiver import PipeClient

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, _TESTS, os.environ.get("PYTHONPATH", "")])
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(b, device, dry_run, old_nccl_shim), daemon=True)
    proc.start()
    return PipeClient(a, proc, timeout_s)
