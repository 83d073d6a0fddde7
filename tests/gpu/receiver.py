"""A receiver process for round trips through vLLM's engines, and the client that drives it.

The receiver is a separate (spawned) process holding vLLM's **real** worker-side
``IPCWeightTransferEngine`` (mode "ipc") or ``NCCLWeightTransferEngine`` (mode "nccl") and a
transformers model behind ``HFReceiver``. Only two things are
substituted, both outside the data plane under test:

* ``vllm.model_executor.model_loader.mtp_validation`` is stubbed (its import chain needs the whole
  serving stack; the engine only uses its ``disable_mtp_completeness_check`` context manager);
* ``start_weight_update`` / ``finish_weight_update`` skip vLLM's *layerwise reload* (it needs a vLLM
  model); ``finish`` still closes the packed-buffer importer exactly like vLLM's does.

``PipeClient`` implements vLLM's ``VLLMWeightSyncClient`` protocol (four methods) over a pipe, plus
test-only calls (build a model, report what arrived, compute logits).

For the CPU dry run (``mode="loopback"``) both engines are replaced by a loopback speaking the same
four-phase protocol with CPU tensors in the message: everything else (sources, spawning, strict
load, reports, logits) is the code that runs on the GPU.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import types
from typing import Any

import torch

__all__ = ["start_receiver", "PipeClient", "LoopbackTrainerEngine", "trainer_engine", "shutdown_pair", "sums_differ",
           "free_port"]


def _stub_mtp_validation() -> None:
    name = "vllm.model_executor.model_loader.mtp_validation"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.disable_mtp_completeness_check = contextlib.nullcontext  # type: ignore[attr-defined]
    sys.modules[name] = stub


def preload_checkpoint_weight_patch() -> None:
    """Make ``vllm.model_executor.model_loader.checkpoint_weight_patch`` importable without its package.

    The module (vLLM's sparse-patch apply path, which ``sparse_nccl_engine`` imports too) needs only
    torch, but importing it normally runs ``model_loader/__init__``, which pulls the serving stack
    (xgrammar, fastapi, ...) the device kit does not carry. Loading the file itself under its full
    name puts vLLM's own code in ``sys.modules``, so later imports find it without the package.
    """
    import importlib.util
    import os

    name = "vllm.model_executor.model_loader.checkpoint_weight_patch"
    if name in sys.modules:
        return
    try:
        import vllm.model_executor.model_loader  # noqa: F401  (a full vLLM install: the normal path)
        return
    except Exception:  # noqa: BLE001 - the kit's partial tree; load the one file instead
        pass
    import vllm

    path = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "model_loader",
                        "checkpoint_weight_patch.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)


def _ipc_worker_engine(device: torch.device, model: Any) -> Any:
    _stub_mtp_validation()
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    class Engine(IPCWeightTransferEngine):
        def start_weight_update(self) -> None:  # layerwise reload needs a vLLM model
            pass

        def finish_weight_update(self) -> None:
            self._packed_importer.close()

    pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
    return Engine(WeightTransferConfig(backend="ipc"), vcfg, device, model)


def _nccl_worker_engine(device: torch.device, model: Any) -> Any:
    """vLLM's worker-side ``NCCLWeightTransferEngine`` (dense NCCL), reload lifecycle skipped as above.
    Its communicator joins the trainer's at ``init_transfer_engine`` (one GPU each, or both on one
    GPU under NCCL's multi-rank mode: ``nccl_one_gpu``)."""
    _stub_mtp_validation()
    from nccl_one_gpu import patch_vllm_stream

    patch_vllm_stream()
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    class Engine(NCCLWeightTransferEngine):
        def start_weight_update(self) -> None:  # layerwise reload needs a vLLM model
            pass

        def finish_weight_update(self) -> None:
            pass

    pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
    return Engine(WeightTransferConfig(backend="nccl"), vcfg, device, model)


_WORKER_ENGINES = {"ipc": _ipc_worker_engine, "nccl": _nccl_worker_engine}


def _worker_engine(mode: str, device: torch.device, model: Any) -> Any:
    make = _WORKER_ENGINES.get(mode)
    return make(device, model) if make is not None else _LoopbackWorkerEngine(model)


class _LoopbackWorkerEngine:
    """CPU stand-in for the worker engine: ``update_weights`` carries the tensors themselves."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def parse_init_info(self, d: dict) -> dict:
        return d

    def init_transfer_engine(self, info: dict) -> None:
        self.packed = info.get("packed", False)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, info: dict) -> None:
        self.model.load_weights(list(zip(info["names"], info["tensors"])))

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _receiver_main(conn: Any, mode: str, device_str: str) -> None:
    from hf_side import HFReceiver, build_hf, hf_logits

    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # logits are compared with fp32 tolerances
    recv: HFReceiver | None = None
    engine: Any = None
    versions: list[str | None] = []
    while True:
        method, arg = conn.recv()
        try:
            result: Any = None
            if method == "stop":
                if engine is not None:
                    engine.shutdown()
                conn.send(("ok", None))
                return
            elif method == "build":
                config, dtype, seed, track = arg
                if engine is not None and mode == "nccl":  # a fresh group per engine
                    engine.shutdown()
                recv = HFReceiver(build_hf(config, device=device, dtype=dtype, seed=seed), track=track)
                engine = _worker_engine(mode, device, recv)
            elif method == "build_fp8":  # an FP8 checkpoint's tensors (weightsync's FP8CheckpointModel)
                from weightsync.plugins.testbed.fp8_model import FP8CheckpointModel

                config, dtype, seed, track, quantization = arg
                if engine is not None and mode == "nccl":  # a fresh group per engine
                    engine.shutdown()
                recv = HFReceiver(FP8CheckpointModel(build_hf(config, device=device, dtype=dtype, seed=seed),
                                                     quantization), track=track)
                engine = _worker_engine(mode, device, recv)
            elif method == "track":  # digests of every received tensor on (correctness) or off (timing)
                assert recv is not None
                recv.track = bool(arg)
            elif method == "reset":
                assert recv is not None
                recv.reset()
            elif method == "report":
                assert recv is not None
                result = {"received": list(recv.received), "missing": recv.missing()}
            elif method == "checksums":
                assert recv is not None
                result = recv.checksums()
            elif method == "logits":
                assert recv is not None
                result = hf_logits(recv.model, arg.to(device)).cpu()
            elif method == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif method == "start_weight_update":
                engine.start_weight_update()
            elif method == "update_weights":
                for info in arg if isinstance(arg, list) else [arg]:
                    engine.update_weights(info)
            elif method == "finish_weight_update":
                engine.finish_weight_update()
                versions.append(arg)
            elif method == "versions":  # every finish's weight_version (None: finished, nothing committed)
                result = list(versions)
            elif method == "shutdown_engine":  # NCCL: the trainer destroys its end at the same time
                if engine is not None:
                    engine.shutdown()
            elif method == "recv_raw":  # a bare NCCL broadcast's receiving end: (piece bytes, count)
                piece, count = arg
                c = engine.model_update_group
                buf = torch.empty(piece, dtype=torch.uint8, device=c.device)
                for _ in range(count):
                    c.broadcast(buf, src=0, stream=torch.cuda.current_stream())
                torch.cuda.synchronize(c.device)
                del buf
            elif method == "sync":  # NCCL receives are enqueued on a stream: wait before timing them
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            else:
                raise ValueError(f"unknown receiver call {method!r}")
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


class PipeClient:
    """vLLM's ``VLLMWeightSyncClient`` over a pipe to the receiver process (+ test-only calls)."""

    def __init__(self, conn: Any, proc: Any, timeout_s: float = 120.0) -> None:
        self.conn = conn
        self.proc = proc
        self.timeout_s = timeout_s

    def call(self, method: str, arg: Any = None) -> Any:
        self.conn.send((method, arg))
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"receiver did not answer {method!r} within {self.timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver failed in {method!r}: {value}")
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop")
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def start_receiver(mode: str, device: str, timeout_s: float = 120.0) -> PipeClient:
    """Spawn the receiver process (``mode`` "ipc" or "nccl" on CUDA, "loopback" on CPU)."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(b, mode, device), daemon=True)
    proc.start()
    return PipeClient(a, proc, timeout_s)


class LoopbackTrainerEngine:
    """CPU stand-in for ``IPCTrainerWeightTransferEngine`` (dry run only): the same trainer_init
    checks and four-phase round trip, chunked by bytes when packed, tensors copied into the message."""

    def __init__(self, client: Any, source: Any, packed: bool, buffer_bytes: int) -> None:
        self.client, self.source, self.packed, self.buffer_bytes = client, source, packed, buffer_bytes

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any) -> "LoopbackTrainerEngine":
        if not source.implements_iter_full():
            raise TypeError(f"{type(source).__name__} does not implement iter_full()")
        if len(source.owned_names(init_info.rank)) != len(source.metadata):
            raise ValueError(f"rank {init_info.rank} does not own every parameter")
        client.init_weight_transfer_engine({"packed": init_info.packed})
        return cls(client, source, init_info.packed, init_info.packed_buffer_size_bytes)

    def send_weights(self) -> None:
        self.client.start_weight_update()
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        size = 0
        for name, t in self.source.iter_full():
            nbytes = t.numel() * t.element_size()
            if self.packed and names and size + nbytes > self.buffer_bytes:
                self.client.update_weights({"names": names, "tensors": tensors})
                names, tensors, size = [], [], 0
            names.append(name)
            tensors.append(t.detach().to("cpu", copy=True).contiguous())
            size += nbytes
        if names:
            self.client.update_weights({"names": names, "tensors": tensors})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        pass


def sums_differ(client: PipeClient, engine: Any, ref: dict[str, float]) -> list[str]:
    """One sync through ``engine`` into a reset receiver; the parameters whose fp64 sum there differs
    from ``ref`` (the trainer's)."""
    client.call("reset")
    engine.send_weights()
    got = client.call("checksums")
    return [n for n, v in ref.items() if got.get(n) != v]


def free_port() -> int:
    """A TCP port free on this host now (bound and released): the NCCL rendezvous's store."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_pair(engine: Any, client: Any, mode: str) -> None:
    """Shut the trainer engine down; under NCCL together with the worker's communicator (NCCL's
    destroy may wait for its peer, so neither side may wait alone)."""
    if mode != "nccl":
        engine.shutdown()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(client.call, "shutdown_engine")
        try:
            engine.shutdown()
        finally:
            fut.result(timeout=120)


def trainer_engine(mode: str, *, client: Any, source: Any, packed: bool, buffer_bytes: int) -> Any:
    """vLLM's real trainer engine through its factory ("ipc", "nccl": one sender, one worker), or the
    CPU loopback."""
    if mode == "nccl":
        from nccl_one_gpu import patch_vllm_stream
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        patch_vllm_stream()
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0,
                                   packed=packed, packed_buffer_size_bytes=buffer_bytes)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    if mode == "ipc":
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=buffer_bytes)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    info = IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=buffer_bytes)
    return LoopbackTrainerEngine.trainer_init(info, client=client, source=source)
