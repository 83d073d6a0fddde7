"""MoE export benchmark on CPU gloo ranks: a Qwen3-MoE-shaped model (>= 64 experts x >= 8 layers).

For each source and wire layout, one fresh world per mode (peak RSS is per process), printing per
rank: seconds, tensors, collectives, bytes, peak extra bytes (the source's own accounting) and the
OS's peak-RSS growth over the pass, plus ratios against a baseline measured in the same run:

* FSDP2 (``FSDPSource`` + ``ExpertTransform``): ``per_expert`` / ``fused`` vs the verl-#6691
  pattern (stream per-expert tensors, keep a layer's experts, ``torch.stack`` them).
* Megatron (``MegatronMoEExporter``, EP = ranks): ``per_expert`` / ``fused`` with a byte-bounded
  expert batch vs the same export with the bound lifted (a whole layer's experts in one batch).

    python bench/bench_moe.py --ranks 2 --experts 64 --layers 8 --hidden 256 --moe-ffn 128
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _hf_config(a):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", hidden_size=a["hidden"], intermediate_size=4 * a["hidden"],
        moe_intermediate_size=a["moe_ffn"], num_experts=a["experts"], num_experts_per_tok=8,
        num_hidden_layers=a["layers"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=a["hidden"] // 4, vocab_size=512, decoder_sparse_step=1, mlp_only_layers=[],
    )


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def fsdp_world(rank, world_size, *, a, mode):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from weightsync.sources import FSDPSource
    from weightsync.sources.core.hf.experts import ExpertTransform

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(a))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layout = "fused" if mode == "fused" else "per_expert"
    src = FSDPSource(model, dtype=torch.bfloat16, transforms=[ExpertTransform.for_module(model, expert_layout=layout)])
    _ = src.metadata  # first pass measured: peak RSS is monotonic, a warm-up would hide it
    rss0 = _rss_kib()
    t0 = time.perf_counter()
    held: dict[str, list] = {}
    for name, t in src.iter_full():
        if mode == "stack" and ".experts." in name:
            key = name.split(".experts.")[0]
            held.setdefault(key, []).append((name, t.clone()))  # consumer keeps what it will stack
            if len(held[key]) == 3 * a["experts"]:
                got = held.pop(key)  # verl #6691: stack a whole layer of separately held experts
                pick = lambda leaf: torch.stack([x for n, x in got if n.endswith(leaf)])  # noqa: E731
                fused = (torch.cat([pick("gate_proj.weight"), pick("up_proj.weight")], 1), pick("down_proj.weight"))
                del fused, got
    secs = time.perf_counter() - t0
    st = src.last_pass.as_dict()
    return dict(st, seconds=secs, rss_growth=(_rss_kib() - rss0) * 1024)


def megatron_world(rank, world_size, *, a, mode):
    import torch
    from moe_megatron import build_gpt, init_parallel, moe_config

    from weightsync.sources.megatron.moe import MegatronMoEExporter

    init_parallel(ep=world_size)
    hf = _hf_config(a)
    mcfg = moe_config(hf, ep=world_size)
    model = build_gpt(hf, mcfg)
    per_expert = 3 * a["hidden"] * a["moe_ffn"] * 2
    batch = a["batch_experts"] * per_expert if mode != "unbounded" else 10**15
    layout = "fused" if mode == "fused" else "per_expert"
    ex = MegatronMoEExporter(model, hf, mcfg, expert_layout=layout, dtype=torch.bfloat16,
                             expert_batch_bytes=batch)
    ex.exchange_coords()  # the one cached coordinate exchange (not per pass)
    rss0 = _rss_kib()
    ex.stats.start()
    for lay in range(a["layers"]):
        for _ in ex.export(lay):
            pass
    ex.stats.stop()
    return dict(ex.stats.as_dict(), rss_growth=(_rss_kib() - rss0) * 1024)


def main() -> None:
    from worlds import run_world

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-ffn", type=int, default=128)
    p.add_argument("--batch-experts", type=int, default=4, help="Megatron expert batch bound, in experts")
    p.add_argument("--source", choices=("fsdp", "megatron", "both"), default="both")
    args = p.parse_args()
    a = dict(experts=args.experts, layers=args.layers, hidden=args.hidden, moe_ffn=args.moe_ffn,
             batch_experts=args.batch_experts)
    layer_bytes = 3 * args.experts * args.hidden * args.moe_ffn * 2
    print(f"model: Qwen3-MoE-shaped, {args.layers} layers x {args.experts} experts, hidden {args.hidden}, "
          f"moe_ffn {args.moe_ffn}; one layer's experts = {layer_bytes / 2**20:.1f} MiB bf16; {args.ranks} ranks")
    runs = []
    if args.source in ("fsdp", "both"):
        runs += [("fsdp", fsdp_world, m) for m in ("stack", "per_expert", "fused")]
    if args.source in ("megatron", "both"):
        runs += [("megatron", megatron_world, m) for m in ("unbounded", "per_expert", "fused")]
    # glibc would serve freed multi-MiB blocks from an untrimmed heap, making peak RSS track allocator
    # history rather than live bytes: mmap every block >= 128 KiB in the (spawned) ranks.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    results = {}
    for src, fn, mode in runs:
        res = run_world(fn, args.ranks, a=a, mode=mode, timeout=600)
        results[(src, mode)] = res
        for r in sorted(res):
            s = res[r]
            print(f"{src:8s} {mode:10s} rank {r}: {s['seconds']:.3f}s tensors={s['tensors']} "
                  f"collectives={s['collectives']} bytes={s['bytes'] / 2**20:.1f}MiB "
                  f"peak_extra={s['peak_extra_bytes'] / 2**20:.1f}MiB rss_growth={s['rss_growth'] / 2**20:.1f}MiB")
    for src, base in (("fsdp", "stack"), ("megatron", "unbounded")):
        if (src, base) not in results:
            continue
        b = results[(src, base)][0]
        for mode in ("per_expert", "fused"):
            s = results[(src, mode)][0]
            print(f"ratio {src} {mode}/{base} (rank 0): seconds {s['seconds'] / max(b['seconds'], 1e-9):.2f}x "
                  f"rss_growth {s['rss_growth'] / max(b['rss_growth'], 1):.2f}x "
                  f"peak_extra {s['peak_extra_bytes'] / max(b['peak_extra_bytes'], 1):.2f}x "
                  f"tensors {s['tensors'] / max(b['tensors'], 1):.3f}x")


if __name__ == "__main__":
    main()
