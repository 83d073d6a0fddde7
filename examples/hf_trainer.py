"""HF ``Trainer`` + ``WeightSyncCallback``: push the policy into vLLM every N optimizer steps.

CPU (loopback receiver, DDP -- accelerate enables FSDP only on accelerators)::

    torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 4 --every 2

GPU (FSDP2 through accelerate, vLLM over NCCL)::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}' &
    torchrun --nproc-per-node 8 examples/hf_trainer.py --fsdp2 --vllm-url http://127.0.0.1:8000 \
        --master-address <this host's IP reachable by the vLLM workers>

A TRL trainer (GRPOTrainer, ...) is a ``Trainer``: pass the same callback to it.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from common import SYNC_TIMEOUT_S, Target, add_args, build_model, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.accelerate import source_from_accelerator
from weightsync.plugins.sync import WeightSync
from weightsync.plugins.transformers import WeightSyncCallback
from weightsync.sources import configure_logging


class RandomTokens(Dataset):
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    p = add_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 (needs GPUs)")
    args = p.parse_args()
    configure_logging(logging.INFO)
    rank, _ = init_process_group()
    config = tiny_llama_config()
    target = Target(args, rank, receiver_model(config))
    try:
        targs = TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=args.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=not torch.cuda.is_available(),
            **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if args.fsdp2 else {}),
        )
        trainer = Trainer(model=build_model(config), args=targs, train_dataset=RandomTokens(config.vocab_size))

        def make_sync(model) -> WeightSync:  # called at train begin, after accelerate prepared the model
            source = source_from_accelerator(trainer.accelerator, model)
            return WeightSync(source, target.init_info, target.client, every=args.every, pause="keep", timeout_s=SYNC_TIMEOUT_S)

        trainer.add_callback(WeightSyncCallback(make_sync, trainer=trainer))
        trainer.train()
        if rank == 0:
            synced = [(e["step"], e["weightsync/bytes"]) for e in trainer.state.log_history if "weightsync/bytes" in e]
            print(f"synced at steps {[s for s, _ in synced]}; vLLM weight_version: {target.client.weight_info()}")
    finally:
        target.close()


if __name__ == "__main__":
    main()
