"""What the driver adds on top of the engine: ``WeightSync.sync`` vs ``engine.send_weights()``.

Run on CPU (loopback receiver, FSDP2 on gloo ranks)::

    torchrun --nproc-per-node 2 bench/bench_driver.py [--hidden 256 --layers 4 --reps 7]

Measured in the same run, interleaved, medians over ``--reps``: the bare engine call (baseline:
what you pay without weightsync's driver), ``sync(pause=None)`` (outcome exchanges, version commit,
report), and ``sync(pause="keep")`` (plus the pause/resume HTTP round trips). Printed as seconds and
as ratios to the baseline.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from common import build_model, init_process_group  # noqa: E402

from weightsync.plugins.sync import VLLMHTTPClient, WeightSync  # noqa: E402
from weightsync.sources import FSDPSource  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    rank, world = init_process_group()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import start_receiver_process

    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    model = build_model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    handle = None
    if rank == 0:
        _, handle = start_receiver_process(functools.partial(build_model, cfg, 1))
    box = [(handle.url, 0) if rank == 0 else None]  # 0: the loopback sender binds a free port
    dist.broadcast_object_list(box, src=0)
    url, port = box[0]
    try:
        client = VLLMHTTPClient(url)
        info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank)
        ws = WeightSync(FSDPSource(model), info, client, pause=None)
        ws.sync(step=0)  # cold: rendezvous, preflight
        engine = ws.engine
        times: dict[str, list[float]] = {"engine.send_weights": [], "sync(pause=None)": [], "sync(pause=keep)": []}
        step = 0
        for _ in range(args.reps):
            for name in times:
                dist.barrier()
                step += 1
                t = time.perf_counter()
                if name == "engine.send_weights":
                    engine.send_weights()
                else:
                    ws.pause_mode = None if name == "sync(pause=None)" else "keep"
                    ws.sync(step=step)
                times[name].append(time.perf_counter() - t)
        if rank == 0:
            base = statistics.median(times["engine.send_weights"])
            n = sum(p.numel() for p in model.parameters())
            print(f"{world} ranks, {n:,} params ({ws.last_report.bytes / 1e6:.1f} MB wire), {args.reps} reps, medians:")
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"  {name:22s} {med * 1e3:8.2f} ms   x{med / base:5.2f} of engine.send_weights")
    finally:
        if handle is not None:
            handle.stop()


if __name__ == "__main__":
    main()
