"""What the loopback backend costs on top of the source's own pass: 2 gloo trainer ranks (FSDP2 on
CPU) + 1 receiver process, one full sync per rep.

Variants, interleaved rep by rep so drift on a shared machine hits all alike (median of ``--reps``):

* ``pass``        -- ``FSDPSource.iter_full()`` drained on every rank, nothing sent: the baseline;
* ``unpacked``    -- loopback ``send_weights()``, one broadcast per tensor, no checksums;
* ``packed``      -- loopback, tensors batched into ``--buffer-mb`` flat buffers, no checksums;
* ``packed+crc``  -- packed with per-parameter checksums (the default configuration).

Each variant's engine is rebuilt per rep (the receiver re-joins the transport); only
``send_weights()`` is timed. Prints seconds, MB/s and the ratio against ``pass`` measured in the
same run. The loopback backend is a test/demo transport: these numbers say what it adds to a CI
run, not how fast vLLM's NCCL/IPC engines are.

    python bench/bench_loopback.py                       # llama-ish, 4 layers, hidden 512
    python bench/bench_loopback.py --hidden 1024 --layers 2 --reps 7
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("pass", "unpacked", "packed", "packed+crc")


def _model(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _worker(rank, world, port, url, ports, args, queue):
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)  # the parent's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.sources import FSDPSource

    model = _model(args.hidden, args.layers, args.vocab)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    source = FSDPSource(model)
    client = ReceiverClient(url)
    buffer = args.buffer_mb * 1024 * 1024
    conf = {
        "unpacked": dict(packed=False, checksums=False),
        "packed": dict(packed=True, checksums=False, packed_buffer_size_bytes=buffer),
        "packed+crc": dict(packed=True, checksums=True, packed_buffer_size_bytes=buffer),
    }
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    nbytes = 0
    k = 0
    for rep in range(args.reps + 1):  # rep 0 warms up
        for v in VARIANTS:
            if v == "pass":
                dist.barrier()
                t0 = time.perf_counter()
                for _ in source.iter_full():
                    pass
                dt = time.perf_counter() - t0
            else:
                info = LoopbackTrainerInitInfo("127.0.0.1", ports[k], 2, rank=rank, **conf[v])
                k += 1
                engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
                dist.barrier()
                t0 = time.perf_counter()
                engine.send_weights()
                dt = time.perf_counter() - t0
                nbytes = engine.last_send.bytes
                engine.shutdown()
            if rep:
                times[v].append(dt)
    if rank == 0:
        queue.put((times, nbytes))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--buffer-mb", type=int, default=16)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from weightsync.plugins.loopback.receiver import start_receiver_process

    _, handle = start_receiver_process(functools.partial(_model, args.hidden, args.layers, args.vocab, 1))
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # port 0: no race
        port = store.port
        ports = [0] * (3 * (args.reps + 1))  # 0: each loopback sender binds a free port itself
        procs = [
            ctx.Process(target=_worker, args=(r, 2, port, handle.url, ports, args, queue))
            for r in range(2)
        ]
        for pr in procs:
            pr.start()
        times, nbytes = queue.get(timeout=1800)
        for pr in procs:
            pr.join(60)
    finally:
        handle.stop()
    base = statistics.median(times["pass"])
    n_params = sum(p.numel() for p in _model(args.hidden, args.layers, args.vocab).parameters())
    print(
        f"loopback bench: llama hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.1f}M params, "
        f"{nbytes / 2**20:.1f} MiB per sync, 2 trainer ranks + 1 receiver, median of {args.reps}"
    )
    print(f"  {'variant':<12} {'seconds':>8} {'MiB/s':>8} {'x pass':>7}")
    for v in VARIANTS:
        m = statistics.median(times[v])
        print(f"  {v:<12} {m:>8.3f} {nbytes / 2**20 / m:>8.1f} {m / base:>7.2f}")


if __name__ == "__main__":
    main()
