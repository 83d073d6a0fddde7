"""The ``weightsync`` checkpoint-engine backend for verl 0.9.1 (``checkpoint_engine.backend: weightsync``).

Why a backend of its own, not verl's: verl's transports (``nccl``, ``nixl``, ``hccl``, ``mooncake``,
``kimi``) need cupy / RDMA / NPUs, carry no per-tensor check of the bytes against what was announced
(verl #7224: FP8 scales all zero after a refit, unnoticed) and never see the model; this one

* feeds the stream from weightsync's source of verl's engine (``EngineWeights`` from the actor tap,
  ``stream.engine_stream``) on every actor rank, in lockstep; a plain ``(name, tensor)`` iterable
  (verl's own ``get_per_tensor_param()`` result) is sent as it is (the benchmark's baseline);
* moves the bytes over a gloo group of actor rank 0 and the rollout workers (host memory: it runs on
  CPU-only machines and in CI), in buckets of verl's ``update_weights_bucket_megabytes``; each bucket's
  header carries every tensor's name, dtype, shape, offset and a checksum, and the sender's
  ``global_steps``;
* on the rollout side checks each tensor's bytes against its checksum and the header's
  ``global_steps`` against the one verl's manager gave this worker, before yielding it to the server
  adapter; a failed pass on the actor sends an abort header, so the rollout workers raise with the
  actor's reason instead of waiting.

Topology: actor rank 0 sends (transfer rank 0), other actor ranks walk the stream (transfer rank -1:
their collectives are part of it), rollout worker i is transfer rank 1 + i. The group is rebuilt for
every sync, as verl's manager calls ``prepare`` / ``init_process_group`` / ``finalize`` around each.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncGenerator, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.sources import IntegrityError, WeightSyncError
from weightsync.sources.toolkit import checksum, get_logger

from .options import VerlOptions
from .stream import engine_stream
from .tap import EngineWeights

__all__ = ["WeightSyncCheckpointEngine"]

logger = get_logger("weightsync.plugins.verl")

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
                               torch.float8_e5m2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@CheckpointEngineRegistry.register("weightsync")
class WeightSyncCheckpointEngine(CheckpointEngine):
    """verl ``CheckpointEngine`` moving weightsync's stream (module docstring). Keyword arguments
    beyond verl's ``bucket_size`` / ``is_master`` are ``engine_kwargs.weightsync`` (``VerlOptions``)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **options: Any) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.options = VerlOptions.from_kwargs(options)
        self.rank: int | None = None
        self._group: Any = None
        self._store: Any = None
        self._port: int | None = None

    # ---- verl's lifecycle: prepare -> build_topology -> init_process_group -> send/receive -> finalize

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        self._port = _free_port()
        return {"host": socket.gethostbyname(socket.gethostname()), "port": self._port}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0]
        if not master:
            raise WeightSyncError("weightsync backend: actor rank 0 must be the master (its prepare() was empty)")
        world = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict[str, Any]) -> None:
        self.rank = rank
        if rank < 0:
            return
        timeout = timedelta(seconds=self.options.timeout_s)
        self._store = dist.TCPStore(master["host"], master["port"], world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        logger.info("weightsync backend: transfer rank %d of %d joined", rank, world_size)

    def finalize(self) -> None:
        self._group = None
        self._store = None
        self.rank = None

    # ---- the wire: per bucket, [header_len, payload_len] then the JSON header then the payload

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def _send_bucket(self, header: dict[str, Any], payload: torch.Tensor) -> None:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([raw.numel(), payload.numel()], dtype=torch.int64))
        self._broadcast(raw)
        if payload.numel():
            self._broadcast(payload)

    def _recv_bucket(self) -> tuple[dict[str, Any], torch.Tensor]:
        sizes = torch.zeros(2, dtype=torch.int64)
        self._broadcast(sizes)
        raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
        self._broadcast(raw)
        payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if payload.numel():
            self._broadcast(payload)
        return json.loads(bytes(raw.numpy()).decode()), payload

    # ---- actor side

    def _stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(weights, EngineWeights):
            return engine_stream(weights.engine, weights.kind, self.options)
        return iter(weights)

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        stream = self._stream(weights)
        if self.rank is None or self.rank < 0:  # walk: this rank's collectives are part of the pass
            for _ in stream:
                pass
            return {}
        entries: list[list[Any]] = []
        parts: list[torch.Tensor] = []
        filled = sent = n = 0

        def flush(last: bool, error: str | None = None) -> None:
            nonlocal entries, parts, filled
            payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            self._send_bucket({"global_steps": global_steps, "last": last, "error": error, "tensors": entries},
                              payload)
            entries, parts, filled = [], [], 0

        try:
            for name, tensor in stream:
                flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
                if filled and filled + flat.numel() > self.bucket_size:
                    flush(False)
                entries.append([name, str(tensor.dtype), list(tensor.shape), filled, flat.numel(),
                                checksum(flat)])
                parts.append(flat)
                filled += flat.numel()
                sent += flat.numel()
                n += 1
            flush(True)
        except Exception as e:
            flush(True, error=f"{type(e).__name__}: {e}")
            raise
        elapsed = time.perf_counter() - t0
        logger.info("weightsync backend: rank 0 sent %d tensors, %.1f MiB, global_steps=%s in %.3f s",
                    n, sent / 2**20, global_steps, elapsed)
        return {"weightsync/sync_s": elapsed, "weightsync/bytes": float(sent), "weightsync/tensors": float(n)}

    # ---- rollout side

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        while True:
            header, payload = self._recv_bucket()
            if header["error"] is not None:
                raise WeightSyncError(f"weightsync backend: the actor's sync failed: {header['error']}")
            if header["global_steps"] != global_steps:
                raise WeightSyncError(f"weightsync backend: the actor sent global_steps={header['global_steps']}, "
                                      f"this rollout worker was told {global_steps}")
            for name, dtype, shape, offset, nbytes, digest in header["tensors"]:
                flat = payload[offset:offset + nbytes]
                if checksum(flat) != digest:
                    raise IntegrityError(f"weightsync backend: tensor {name!r} arrived with other bytes than sent "
                                         f"(checksum {checksum(flat)} != {digest})")
                yield name, flat.clone().view(_DTYPES[dtype]).view(shape)
            if header["last"]:
                return
