"""Delta sync under FSDP2: after every N optimizer steps only the elements whose bf16 bytes changed
travel to vLLM (its ``sparse_nccl`` backend), the first sync and the one after any failure whole.

The trainer keeps fp32 master weights and an RL-like learning rate, so most bf16 values are the same
from one sync to the next. ``DeltaSource`` diffs each rank's FSDP shard against a snapshot of it on
that rank and sends rank 0 only the changed elements; ``WeightSync`` pauses, streams the patches in
bounded chunks, commits ``weight_version`` and resumes.

CPU (loopback receiver applying the patches through vLLM's own ``load_checkpoint_weight_patches``;
after every sync the receiver's full tensors are checked against a dense pass of the trainer)::

    torchrun --nproc-per-node 2 examples/delta_fsdp2.py --steps 4

GPU::

    VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "sparse_nccl"}' &
    torchrun --nproc-per-node 8 examples/delta_fsdp2.py --vllm-url http://127.0.0.1:8000 \\
        --master-address <this host's IP>
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import SYNC_TIMEOUT_S, Target, add_args, build_model, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.sync import WeightSync
from weightsync.sources import DeltaSource, FSDPSource, configure_logging


def main() -> None:
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (RL-like)")
    p.add_argument("--anchor-every", type=int, default=None, help="also send every element every N syncs")
    args = p.parse_args()
    configure_logging(logging.INFO)
    rank, world = init_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = tiny_llama_config()
    target = Target(args, rank, receiver_model(config, torch.bfloat16), sparse=True)
    try:
        model = build_model(config).to(device)  # fp32 master weights
        mesh = init_device_mesh(device, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=args.lr)
        delta = DeltaSource(FSDPSource(model, dtype=torch.bfloat16), anchor_every=args.anchor_every)
        ws = WeightSync(delta, target.init_info, target.client, every=args.every, pause="keep", timeout_s=SYNC_TIMEOUT_S)
        report = ws.sync(step=0)  # the first sync is an anchor: every element
        if rank == 0:
            print(f"step 0: anchor, {report.delta_changed} elements, {report.delta_sent_bytes} bytes sent")
        gen = torch.Generator().manual_seed(rank)
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            report = ws.maybe_sync(step)  # every rank, every step: never inside `if rank == 0`
            if report is not None and rank == 0:
                kind = "anchor" if report.delta_anchor else "delta"
                print(f"step {step}: loss {loss.item():.4f}, {kind}, {100 * report.changed_fraction:.2f}% of "
                      f"{report.delta_elements} elements changed, {report.delta_sent_bytes} bytes sent vs "
                      f"{report.delta_dense_bytes} dense, weight_version {report.weight_version}")
        ws.shutdown()
    finally:
        target.close()


if __name__ == "__main__":
    main()
