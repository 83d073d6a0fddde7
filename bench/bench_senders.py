"""Many senders (issue 40) on CPU: bytes each sender broadcasts, rank 0's extra memory, and a sync-time
model from the measured bytes, for ``senders="owners"`` against ``senders="rank0"``.

Every sync runs through vLLM 0.34's real NCCL trainer and worker engines on gloo ranks, with the
CPU stand-in for PyNcclCommunicator (``tests/many_senders_worlds.py``), which records what each
trainer rank broadcast as a source. Scenarios: MegatronSource PP2 and PP4 (Qwen3-shaped dense),
EP2 (Qwen3-MoE-shaped), FSDPSource under HSDP with 2 replicas x 2 shards.

Targets (issue 40), checked and printed as PASS / FAIL:

* bytes per sender: max over senders <= total / senders + the largest tensor;
* rank 0's extra memory in a MegatronSource PP sync (its source's ``peak_extra_bytes``) <= its own
  stage's largest group (the HF tensors one Megatron parameter becomes); with ``senders="rank0"``
  every later stage's tensors pass through it.

The sync-time model: a sender's NIC moves ``bytes / bandwidth``; with one sender the sync takes
``total / bw``, with many ``max_s(bytes_s) / bw`` (turns are sequential in vLLM's engine, but each
turn's broadcast leaves its own sender's NIC, so the model is the per-NIC lower bound of a sync
whose senders sit on different nodes; on one node they share the node's links). Printed at 25, 50
and 100 GB/s per sender NIC beside the CPU timings (gloo on 2 cores: timings, not the model).

Ratios recorded with ``--record`` in ``bench/results/history.jsonl`` (``_history.Guard``):
max-sender bytes / (total / senders) per scenario, and rank 0's peak / its stage's largest group.

    python bench/bench_senders.py [--reps 3] [--record]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from _history import Guard  # noqa: E402

NICS_GBPS = (25, 50, 100)


def _measure(rank: int, make, reps: int, facts: dict, key: str) -> None:
    """``reps`` syncs of ``make(senders)``'s source for each ``senders``; per rank: bytes broadcast as a
    source, sync seconds, the source's pass stats; rank 0 also the tensor sizes and groups."""
    import torch.distributed as dist
    from many_senders_worlds import InProcessWorker, NoClient, sent_by_me, weight_sync

    for senders in ("owners", "rank0"):
        src = make(senders)
        client = InProcessWorker() if rank == 0 else NoClient()
        sync = weight_sync(src, client, timeout_s=600)
        if rank == 0:
            client.expect(src.metadata)
        seconds, sent, peak, received = [], 0, 0, 0
        for step in range(reps):
            dist.barrier()
            t = time.perf_counter()
            sync.sync(step)
            dist.barrier()
            seconds.append(time.perf_counter() - t)
            _, sent = sent_by_me(sync)
            peak = max(peak, src.last_pass.peak_extra_bytes)
            received = src.last_pass.bytes_received
        out = {"seconds": statistics.median(seconds), "sent": sent, "peak": peak, "received": received}
        if rank == 0:
            out["sizes"] = [m.dtype.itemsize * _numel(m.shape) for m in src.metadata]
            plan = getattr(src, "plan", None)
            if plan is not None and key.startswith("PP"):  # rank 0's stage's largest group: one unit's HF tensors
                size = {m.name: m.dtype.itemsize * _numel(m.shape) for m in src.metadata}
                out["own_group"] = max(sum(size[n] for n in u.names) for u in plan if u.stage == 0)
        facts[key + "/" + senders] = out
        sync.shutdown()
        if rank == 0:
            client.engine.shutdown()
        dist.barrier()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _world(rank: int, world_size: int, *, reps: int, tmp: str) -> dict:
    import torch
    from many_senders_worlds import install_standins

    from weightsync.sources import FSDPSource, MegatronSource

    install_standins(timeout_s=600)
    torch.set_num_threads(1)
    facts: dict = {}
    if world_size == 2:
        from megatron_worlds import hf_config, init_parallel, megatron_model

        init_parallel(pp=2)
        cfg = hf_config("qwen3", layers=8, hidden_size=256, intermediate_size=768, vocab=8192,
                        num_attention_heads=8, num_key_value_heads=4)
        model = megatron_model(cfg)
        _measure(rank, lambda s: MegatronSource(model, hf_config=cfg, senders=s), reps, facts, "PP2")

        from moe_megatron import build_gpt, init_parallel as moe_parallel, moe_config
        from transformers import AutoConfig

        moe_parallel(ep=2)
        hf = AutoConfig.for_model("qwen3_moe", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=4096, num_experts_per_tok=2, head_dim=32,
                                  moe_intermediate_size=384, num_experts=16, intermediate_size=768)
        moe = build_gpt(hf, moe_config(hf, ep=2))
        with torch.no_grad():  # data-parallel replicas hold the same dense weights (build_gpt draws per rank)
            for n, p in moe.named_parameters():
                if ".experts." not in n:
                    torch.distributed.broadcast(p.data, src=0)
        _measure(rank, lambda s: MegatronSource(moe, hf_config=hf, senders=s), reps, facts, "EP2")
    else:
        from megatron_worlds import hf_config, init_parallel, megatron_model

        init_parallel(pp=4)
        cfg = hf_config("qwen3", layers=8, hidden_size=256, intermediate_size=768, vocab=8192,
                        num_attention_heads=8, num_key_value_heads=4)
        model = megatron_model(cfg)
        _measure(rank, lambda s: MegatronSource(model, hf_config=cfg, senders=s), reps, facts, "PP4")

        from fsdp_worlds import shard
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(0)
        fcfg = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=32, vocab_size=8192, tie_word_embeddings=False)
        fmodel = shard(AutoModelForCausalLM.from_config(fcfg), init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        _measure(rank, lambda s: FSDPSource(fmodel, senders=s) if s == "owners" else FSDPSource(fmodel), reps,
                 facts, "HSDP 2x2")
    return facts


def _report(name: str, res: dict, guard_record: bool, lines: list[str]) -> list[str]:
    fails = []
    own, one = res[0][name + "/owners"], res[0][name + "/rank0"]
    sizes = own["sizes"]
    total, largest = sum(sizes), max(sizes)
    sent = {r: res[r][name + "/owners"]["sent"] for r in res}
    senders = {r: b for r, b in sent.items() if b}
    worst = max(senders.values())
    bound = total / len(senders) + largest
    ok = worst <= bound
    fails += [] if ok else [f"{name}: max sender bytes {worst} > total/senders + largest {bound:.0f}"]
    mib = lambda b: b / 2**20  # noqa: E731
    lines.append(f"\n== {name}: {len(sizes)} tensors, {mib(total):.1f} MiB on the wire, largest tensor {mib(largest):.2f} MiB ==")
    lines.append("  bytes each rank broadcast as a source: "
                 + ", ".join(f"rank {r} {mib(b):.2f} MiB" for r, b in sorted(sent.items())))
    lines.append(f"  {'PASS' if ok else 'FAIL'} max over {len(senders)} senders {mib(worst):.2f} MiB <= total/senders + "
                 f"largest = {mib(bound):.2f} MiB (ratio max/(total/senders) = {worst / (total / len(senders)):.3f})")
    rank0_one = res[0][name + "/rank0"]["sent"]
    lines.append(f"  senders='rank0': rank 0 broadcast {mib(rank0_one):.2f} MiB (all of it)")
    lines.append(f"  CPU sync seconds (median, gloo, 2 cores): owners {own['seconds']:.3f} s, rank0 {one['seconds']:.3f} s")
    model = "  model sync seconds at " + "; ".join(
        f"{g} GB/s per NIC: one sender {total / (g * 1e9) * 1e3:.2f} ms, {len(senders)} senders "
        f"{worst / (g * 1e9) * 1e3:.2f} ms (x{total / worst:.2f})" for g in NICS_GBPS)
    lines.append(model)
    if "own_group" in own:
        grp = own["own_group"]
        ok0 = own["peak"] <= grp
        fails += [] if ok0 else [f"{name}: rank 0 peak extra {own['peak']} > its stage's largest group {grp}"]
        lines.append(f"  {'PASS' if ok0 else 'FAIL'} rank 0 extra memory {mib(own['peak']):.3f} MiB <= its stage's largest "
                     f"group {mib(grp):.3f} MiB (senders='rank0': {mib(one['peak']):.3f} MiB peak, "
                     f"{mib(one['received']):.2f} MiB received point to point; owners: {mib(own['received']):.2f} MiB)")
    guard = Guard("bench_senders", name, record=guard_record, printer=lines.append)
    guard.check("max sender bytes / (total/senders)", worst / (total / len(senders)), 0.0)
    if "own_group" in own:
        guard.check("rank 0 peak extra / own stage's largest group", own["peak"] / own["own_group"], 0.0)
    guard.finish()
    return fails


def main() -> int:
    from fsdp_worlds import unpack  # noqa: F401  (the worlds' helpers import cleanly)
    from many_senders_worlds import skip_reason
    from worlds import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append the ratios to bench/results/history.jsonl")
    args = ap.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"SKIP bench_senders: {reason}")
        return 0
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    res2 = run_world(_world, 2, timeout=1200, pg_timeout_s=600, reps=args.reps, tmp=tmp)
    res4 = run_world(_world, 4, timeout=1200, pg_timeout_s=600, reps=args.reps, tmp=tmp)
    lines = [f"bench_senders: vLLM 0.34 NCCL engines (CPU stand-in for PyNccl), fp32 wire, median of {args.reps} syncs"]
    fails = []
    for name, res in (("PP2", res2), ("EP2", res2), ("PP4", res4), ("HSDP 2x2", res4)):
        fails += _report(name, res, args.record, lines)
    lines.append(f"\n{len(fails)} target(s) missed in {time.perf_counter() - t0:.0f} s" + "".join(f"\n  {f}" for f in fails))
    print("\n".join(lines))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
