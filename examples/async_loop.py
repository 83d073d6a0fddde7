"""Async RL shape: generation keeps running against vLLM while the trainer updates; each sync
pauses with ``keep`` (in-flight requests freeze, nothing is aborted), sends, commits the step as
``weight_version`` and resumes.

CPU (loopback receiver; a thread stands in for the rollout workers, polling the server)::

    torchrun --nproc-per-node 2 examples/async_loop.py --steps 6 --every 2

GPU::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}' &
    torchrun --nproc-per-node 4 examples/async_loop.py --vllm-url http://127.0.0.1:8000 \
        --master-address <this host's IP>
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import SYNC_TIMEOUT_S, Target, add_args, build_model, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.sync import WeightSync
from weightsync.sources import FSDPSource
from weightsync.sources import configure_logging


def rollouts(client, stop: threading.Event, seen: list) -> None:
    """Stand-in for rollout workers: keep asking the server which policy version it serves."""
    while not stop.is_set():
        seen.append(next(iter(client.weight_info().values())))
        time.sleep(0.01)


def main() -> None:
    args = add_args(argparse.ArgumentParser(description=__doc__)).parse_args()
    configure_logging(logging.INFO)
    rank, world = init_process_group()
    config = tiny_llama_config()
    target = Target(args, rank, receiver_model(config))
    stop, seen = threading.Event(), []
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = build_model(config).to(device)
        mesh = init_device_mesh(device, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ws = WeightSync(FSDPSource(model), target.init_info, target.client, every=args.every, pause="keep", timeout_s=SYNC_TIMEOUT_S)
        ws.sync(step=0)
        if rank == 0:  # the rollout side; the sync itself is still called on every rank below
            threading.Thread(target=rollouts, args=(target.client, stop, seen), daemon=True).start()
        gen = torch.Generator().manual_seed(rank)
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
            optim.step()
            optim.zero_grad()
            report = ws.maybe_sync(step)
            if report is not None and rank == 0:
                print(f"step {step}: paused (keep) {report.pause_seconds * 1e3:.1f} ms, "
                      f"sent {report.bytes / 1e6:.2f} MB in {report.send_seconds * 1e3:.1f} ms, "
                      f"resumed {report.resume_seconds * 1e3:.1f} ms")
        if rank == 0 and ws.last_report is not None:  # let the rollouts see the last committed version
            # (a poll every 10 ms; on a loaded machine its thread can miss the window before stop)
            deadline = time.monotonic() + 10.0
            while (not seen or seen[-1] != ws.last_report.weight_version) and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.barrier()
        ws.shutdown()
        if rank == 0:
            stop.set()
            versions = [v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]
            print(f"rollouts saw policy versions {versions} over {len(seen)} polls")
    finally:
        stop.set()
        target.close()


if __name__ == "__main__":
    main()
