"""PEFT LoRA under FSDP2, syncing *merged* weights into vLLM after every N optimizer steps.

Only the adapters train; vLLM serves the full model. ``FSDPSource`` sends ``W + scaling * (B @ A)``
under the base checkpoint names without touching the trainer's model (no merge/unmerge), so the
serving side needs no LoRA support at all.

CPU (loopback receiver, a plain transformers model; after each sync rank 0 checks the receiver's
logits against the trainer's LoRA forward)::

    torchrun --nproc-per-node 2 examples/lora_fsdp2.py --steps 3

GPU::

    VLLM_SERVER_DEV_MODE=1 vllm serve <base model> --weight-transfer-config '{"backend": "nccl"}' &
    torchrun --nproc-per-node 8 examples/lora_fsdp2.py --vllm-url http://127.0.0.1:8000 \
        --master-address <this host's IP>
"""

from __future__ import annotations

import argparse
import logging

import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import SYNC_TIMEOUT_S, Target, add_args, build_model, init_process_group, receiver_model, tiny_llama_config
from weightsync.plugins.sync import WeightSync
from weightsync.sources import FSDPSource
from weightsync.sources import configure_logging

#: fp32 logits of the unmerged LoRA forward and a plain model holding the merged weights.
MERGED_VS_UNMERGED_REL = 1e-4


def main() -> None:
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--lora-rank", type=int, default=8)
    args = p.parse_args()
    configure_logging(logging.INFO)
    rank, world = init_process_group()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = tiny_llama_config()
    target = Target(args, rank, receiver_model(config))
    try:
        base = build_model(config).to(device)
        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        model = get_peft_model(base, lora)
        mesh = init_device_mesh(device, (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
        ws = WeightSync(FSDPSource(model), target.init_info, target.client, every=args.every, pause="wait", timeout_s=SYNC_TIMEOUT_S)
        ws.sync(step=0)  # cold sync: B starts at zero, so this is the base model
        gen = torch.Generator().manual_seed(rank)
        probe = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
        checker = None
        if rank == 0 and target.handle is not None:
            from weightsync.plugins.loopback.receiver import ReceiverClient

            checker = ReceiverClient(target.handle.url)
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            report = ws.maybe_sync(step)  # every rank, every step: never inside `if rank == 0`
            if report is None:
                continue
            with torch.no_grad():
                trainer = model(input_ids=probe.to(device)).logits.float().cpu()  # collective: every rank
            if checker is not None:
                got, _ = checker.logits(probe.tolist())
                rel = float((got - trainer).abs().max() / trainer.abs().max())
                ok = rel <= MERGED_VS_UNMERGED_REL
                print(f"step {step}: loss {loss.item():.4f}, synced {report.tensors} merged tensors "
                      f"({report.bytes / 1e6:.2f} MB); receiver logits vs trainer LoRA forward: "
                      f"rel err {rel:.2e} ({'ok' if ok else 'MISMATCH'})")
                if not ok:
                    raise SystemExit(f"receiver logits differ from the trainer's by {rel:.2e}")
        ws.shutdown()
    finally:
        target.close()


if __name__ == "__main__":
    main()
