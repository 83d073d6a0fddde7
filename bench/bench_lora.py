"""What exporting a PEFT LoRA model costs over exporting its base model: ``FSDPSource`` passes, 2 gloo ranks, CPU.

The baseline is measured in the same run: the same Qwen3 base model (same init, same FSDP2 layout:
per decoder layer + root), without adapters. The LoRA model adds ``r``-rank adapters to every
linear projection (q/k/v/o/gate/up/down). Both sources export bf16 on the wire from fp32
parameters; passes are interleaved rep by rep so drift on a shared machine hits both alike, and
the figure is the median after one warm-up pass each.

What to expect: the same number of collectives (A/B join their base weight's batched gather); more
bytes received, because a merged weight and its A/B travel in their own dtype (fp32 here) and are
cast after the merge -- the exactness price (see ``sources/fsdp/lora.py``); plus the ``B @ A`` matmuls.

    python bench/bench_lora.py
    python bench/bench_lora.py --hidden 512 --layers 8 --rank 32 --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from worlds import run_world  # noqa: E402


def _base(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=args.vocab,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _lora(args) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(_base(args), LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def _shard(model, layers, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _timed_pass(source) -> float:
    t0 = time.perf_counter()
    for _name, _t in source.iter_full():
        pass
    return time.perf_counter() - t0


def _worker(rank, world, args):
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world,))
    base = _base(args)
    _shard(base, base.model.layers, mesh)
    lora = _lora(args)
    _shard(lora, lora.base_model.model.model.layers, mesh)
    sources = {"base": FSDPSource(base, dtype=torch.bfloat16), "lora": FSDPSource(lora, dtype=torch.bfloat16)}
    for s in sources.values():
        _timed_pass(s)  # warm-up (the first pass also agrees on metadata)
    stats = {k: s.last_pass.as_dict() for k, s in sources.items()}
    times = {k: [] for k in sources}
    for _ in range(args.reps):
        for k, s in sources.items():
            dist.barrier()
            times[k].append(_timed_pass(s))
    out = {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "stats": stats,
        "tensors": {k: len(s.metadata) for k, s in sources.items()},
        "names_equal": [m.name for m in sources["base"].metadata] == [m.name for m in sources["lora"].metadata],
        "lora_params": sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    r = run_world(_worker, args.world, timeout=1800, pg_timeout_s=600, args=args)[0]
    print(
        f"FSDPSource iter_full, bf16 wire, {args.world} ranks gloo (CPU), median of {args.reps} (rank 0); "
        f"Qwen3 hidden {args.hidden} x {args.layers} layers, LoRA r={args.rank} on 7 projections "
        f"({r['lora_params']:,} adapter params)"
    )
    print(f"{'model':<6} {'tensors':>7} {'s/pass':>8} {'colls':>6} {'MB recv':>8} {'MB peak':>8}")
    for k in ("base", "lora"):
        st = r["stats"][k]
        print(
            f"{k:<6} {r['tensors'][k]:>7} {r['seconds'][k]:>8.4f} {st['collectives']:>6} "
            f"{st['bytes_received'] / 1e6:>8.2f} {st['peak_extra_bytes'] / 1e6:>8.2f}"
        )
    b, lo = r["stats"]["base"], r["stats"]["lora"]
    print(
        f"ratio lora/base: time x{r['seconds']['lora'] / r['seconds']['base']:.2f}, "
        f"collectives x{lo['collectives'] / max(1, b['collectives']):.2f}, "
        f"bytes received x{lo['bytes_received'] / max(1, b['bytes_received']):.2f}, "
        f"peak extra x{lo['peak_extra_bytes'] / max(1, b['peak_extra_bytes']):.2f}; "
        f"same names: {r['names_equal']}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
