"""Many senders (``senders="owners"``) through vLLM 0.34's real NCCL engines, on CPU ranks: the
harness ``test_many_senders.py`` and the dry run of ``tests/gpu/part_many_senders.py`` share.

What is vLLM's own and what stands in:

* **Real**: ``NCCLTrainerWeightTransferEngine`` built by ``WeightTransferTrainerFactory.trainer_init``
  (through ``WeightSync``) on every trainer rank -- its broadcast plan, its turns, its per-turn
  ``update_weights`` payloads with ``src``, its ``_checked_iter`` on each broadcaster and its
  ``_discard`` on the others -- and the worker's ``NCCLWeightTransferEngine`` (``parse_init_info``,
  ``init_transfer_engine``, ``update_weights`` -> ``receive_weights``, which checks ``src`` against
  ``rank_offset``).
* **Stand-in** (``GlooNCCL``, CPU only): vLLM's ``PyNcclCommunicator``, i.e. ``broadcast(tensor, src,
  stream)`` over a gloo group of the transfer world (trainer broadcasters + the worker), recording
  what each member sent. ``install_standins`` puts it where the engines open their endpoints, and
  makes the CUDA stream / cache calls the engines make unconditionally no-ops. On GPUs
  (``part_many_senders``) nothing stands in: the communicator is vLLM's.
* The worker's ``start_weight_update`` / ``finish_weight_update`` skip vLLM's reload lifecycle (it
  needs a vLLM model), as ``tests/gpu/receiver.py`` does; the worker runs inside rank 0's process
  (its ``update_weights`` runs on the trainer engine's RPC thread while rank 0 broadcasts), so a
  world needs no extra process. Its model (``Received``) is strict: an unknown name, another shape
  or dtype raises.
"""

from __future__ import annotations

import datetime
import socket
import types
from typing import Any

import torch

__all__ = ["skip_reason", "GlooNCCL", "install_standins", "Received", "InProcessWorker", "NoClient",
           "share_port", "weight_sync", "sent_by_me", "stage_of_layer"]


def skip_reason() -> str | None:
    """None when the installed vLLM's NCCL engine has many senders (0.34+), else why not."""
    try:
        from weightsync.sources.core.senders import many_senders_supported, vllm_version
    except Exception as e:  # noqa: BLE001
        return f"weightsync/vLLM not importable: {e}"
    if many_senders_supported():
        return None
    return f"vLLM {vllm_version()} has a single NCCL sender (many senders need vLLM 0.34+)"


class GlooNCCL:
    """CPU stand-in for ``PyNcclCommunicator`` in a transfer world of ``world_size`` members:
    ``broadcast(tensor, src, stream)`` moves ``tensor``'s bytes from group rank ``src`` over gloo.
    ``log`` records ``(src, nbytes)`` of every broadcast this member took part in."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")
        self.available, self.disabled = True, False
        self.nccl = None
        self.log: list[tuple[int, int]] = []
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s))
        self._group = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.disabled or tensor.numel() == 0:
            return
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._group.broadcast([buf.view(-1).view(torch.uint8)], opts).wait()
        if buf is not tensor:
            tensor.copy_(buf)
        self.log.append((src, tensor.numel() * tensor.element_size()))

    def destroy(self) -> None:
        self._group = None


def install_standins(timeout_s: float = 60.0) -> None:
    """CPU only: vLLM's dense NCCL engines open ``GlooNCCL`` endpoints in this process; CUDA stream,
    synchronize and cache calls become no-ops (a CPU host has no CUDA driver)."""
    import vllm.distributed.weight_transfer.nccl_engine as ne

    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.empty_cache = lambda *a, **k: None  # type: ignore[assignment]

    def trainer_endpoint(info: Any, rank: int = 0) -> GlooNCCL:
        return GlooNCCL(info.master_address, info.master_port, rank, info.world_size, timeout_s)

    def worker_group(info: Any, parallel_config: Any) -> GlooNCCL:
        rank = info.rank_offset + parallel_config.data_parallel_index * parallel_config.world_size \
            + parallel_config.rank
        return GlooNCCL(info.master_address, info.master_port, rank, info.world_size, timeout_s)

    ne.open_trainer_endpoint = trainer_endpoint  # type: ignore[assignment]
    ne.worker_init_process_group = worker_group  # type: ignore[assignment]


class Received(torch.nn.Module):
    """The worker's model: what arrived, by checkpoint name. Strict about names, shapes, dtypes
    declared at ``expect``; starts filled with NaN so only what a round delivers can match."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, torch.Tensor] = {}
        self.loaded: list[str] = []

    def expect(self, metas: list[Any], device: torch.device | str = "cpu") -> None:
        self.held = {m.name: torch.full(tuple(m.shape), float("nan"), dtype=m.dtype, device=device) for m in metas}
        self.loaded = []

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, t in weights:
            dst = self.held.get(name)
            if dst is None:
                raise KeyError(f"Received: unknown checkpoint name {name!r}")
            if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                raise ValueError(f"Received: {name!r} is {tuple(t.shape)} {t.dtype}, expected {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(t)
            self.loaded.append(name)
            done.add(name)
        return done


class InProcessWorker:
    """A ``VLLMWeightSyncClient`` on rank 0 whose inference side is vLLM's real worker
    ``NCCLWeightTransferEngine`` in this process (one worker). Records each ``update_weights``
    payload's ``src`` and names, and each committed ``weight_version``."""

    def __init__(self, device: str = "cpu") -> None:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        class Worker(NCCLWeightTransferEngine):
            def start_weight_update(self) -> None:  # the reload lifecycle needs a vLLM model
                pass

            def finish_weight_update(self) -> None:
                pass

        self.model = Received()
        pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
        self.engine = Worker(WeightTransferConfig(backend="nccl"), vcfg, torch.device(device), self.model)
        self.updates: list[tuple[int, list[str]]] = []
        self.versions: list[str | None] = []
        self.init_payloads: list[dict] = []

    def nccl_world_size(self) -> int:
        return 1 + 1  # one trainer sender + one worker, as VLLMHTTPClient counts

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.init_payloads.append(dict(init_info))
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.updates.append((int(update_info.get("src", 0)), list(update_info.get("names", []))))
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()
        self.versions.append(weight_version)


class NoClient:
    """The client of a rank other than 0: vLLM's engine never calls it there."""

    def _never(self, *a: Any, **k: Any) -> None:
        raise AssertionError("a non-zero trainer rank called the vLLM client")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _never


def share_port() -> int:
    """A free port picked on rank 0 and broadcast to every rank (the transfer world's rendezvous)."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            box[0] = s.getsockname()[1]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def weight_sync(source: Any, client: Any, *, packed: bool = False, timeout_s: float = 60.0) -> Any:
    """A ``WeightSync`` over vLLM's NCCL engine for this rank: transfer world = broadcasters + 1 worker."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync.driver import WeightSync
    from weightsync.sources import broadcast_ranks

    group = broadcast_ranks(source.metadata)
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=share_port(),
                               world_size=len(group) + 1, rank=dist.get_rank(), packed=packed)
    return WeightSync(source, info, client, pause=None, timeout_s=timeout_s)


def sent_by_me(sync: Any) -> tuple[int, int]:
    """``(tensors, bytes)`` this rank broadcast as a source in the last sync (0, 0: not a broadcaster)."""
    comm = getattr(sync.engine, "model_update_group", None)
    if comm is None:
        return 0, 0
    mine = [n for s, n in comm.log if s == comm.rank]
    comm.log.clear()
    return len(mine), sum(mine)


def stage_of_layer(layer: int, layers: int, pp: int, vpp: int = 1) -> int:
    """The pipeline stage holding global ``layer`` (Megatron's even split, virtual chunks round robin)."""
    chunk = layer // (layers // (pp * vpp))
    return chunk % pp
