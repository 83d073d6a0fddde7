"""A plain accelerate loop with the FSDP2 plugin, syncing into vLLM after every N optimizer steps.

CPU (loopback receiver; accelerate runs FSDP only on accelerators, so on CPU this is DDP and the
source sends the unwrapped module)::

    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py --steps 4

GPU (FSDP2 shards, bf16 mixed precision: the wire dtype is bf16, cast before the gather)::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}' &
    torchrun --nproc-per-node 8 examples/accelerate_fsdp2.py --bf16 --vllm-url http://127.0.0.1:8000 \
        --master-address <this host's IP>
"""

from __future__ import annotations

import argparse
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from common import SYNC_TIMEOUT_S, Target, add_args, build_model, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.accelerate import source_from_accelerator
from weightsync.plugins.sync import WeightSync
from weightsync.sources import configure_logging


def main() -> None:
    p = add_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    configure_logging(logging.INFO)
    rank, _ = init_process_group()
    config = tiny_llama_config()
    target = Target(args, rank, receiver_model(config))
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = Accelerator(
            fsdp_plugin=plugin, mixed_precision="bf16" if args.bf16 else "no", cpu=not torch.cuda.is_available()
        )
        model = build_model(config)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optim = accelerator.prepare(model, optim)
        ws = WeightSync(source_from_accelerator(accelerator, model), target.init_info, target.client,
                        every=args.every, pause="wait", timeout_s=SYNC_TIMEOUT_S)
        ws.sync(step=0)  # cold sync: vLLM starts from the trainer's weights
        gen = torch.Generator().manual_seed(rank)
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(accelerator.device)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optim.step()
            optim.zero_grad()
            report = ws.maybe_sync(step)  # every rank, every step: never inside `if rank == 0`
            if report is not None and rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, synced {report.bytes / 1e6:.2f} MB")
        ws.shutdown()
    finally:
        target.close()


if __name__ == "__main__":
    main()
