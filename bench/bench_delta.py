"""Delta sync vs the dense pass, on a model trained with Adam at an RL learning rate.

One FSDP2 model (fp32 master weights, bf16 wire), trained ``--steps`` Adam steps on random tokens; after
each step, on every rank, interleaved: a dense ``FSDPSource.iter_full`` pass (what a full sync costs
the trainer) and one ``DeltaSource`` round (diff where the shard lives + counts exchange + changed
elements to rank 0). Rank 0 drains both (no transport: the trainer's share only). Printed per round:
the changed fraction the step produced, wire bytes (indices + values) against the dense wire, the
trainer's collective bytes against the dense pass's, and seconds; then the medians and the ratios
the goals are stated in, checked against ``bench/results/history.jsonl`` (``--record`` appends).

Goals (issue 32): wire <= 6 bytes per changed element + a per-tensor constant; trainer collective
bytes O(changed elements); at ~2% changed, a delta round's trainer time <= 0.5x the dense pass's (2
CPU ranks, gloo); extra trainer memory for the snapshot = the rank's shard in the wire dtype. On a GPU
(``--device cuda``, one process) the same round is timed against a D2D copy of the model's wire
bytes (goal <= 2.0x, issue 53), and a sync-time model (trainer time + wire bytes / link) is printed for 25, 50
and 100 GB/s links.

    python bench/bench_delta.py                       # 2 gloo ranks on CPU (~110M parameters)
    python bench/bench_delta.py --lr 3e-6 --steps 6 --hidden 512 --vocab 16384
    python bench/bench_delta.py --device cuda --preset qwen3-1.7b --json out.json        # H200
    python bench/bench_delta.py --dry-run --json out.json   # the CUDA path's code on CPU, tiny model

With ``--json`` (the ``bench_delta`` part of ``tests/gpu/run_all.py``) or ``--dry-run`` the run is one
process (the GPU shape): per step, after the Adam step, a delta round, a dense pass and a D2D copy of
the model's wire bytes are timed interleaved (their order rotates step by step); the part reports
best and median of delta round / copy (goal <= 2.0x), the sync-time model, and checks every ratio
with the regression guard (``bench/_gpu_bench.py``: recorded under ``.ci/gpu``, never for a dry run)
and the wire at <= 6 bytes per changed element.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))
sys.path.insert(0, HERE)
from worlds import run_world  # noqa: E402

LINKS_GBPS = (25, 50, 100)
#: goal of the GPU shape (issue 53, 1.7B): a delta round's trainer time over a D2D copy of the wire bytes
GOAL_VS_COPY = 2.0
#: the dry run's tiny model (the GPU shape's code on CPU)
DRY = {"hidden": 256, "layers": 2, "vocab": 4096, "steps": 3}


def _model(args, device: str):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    if args.preset == "qwen3-1.7b":  # the shape every GPU bench uses (tests/gpu/hf_side.bench_config)
        from hf_side import bench_config

        with torch.device(device):
            return AutoModelForCausalLM.from_config(bench_config(), torch_dtype=torch.float32)
    cfg = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=max(2, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64 if args.hidden >= 64 else args.hidden // 2, vocab_size=args.vocab, tie_word_embeddings=False,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)


def _train_step(model, opt, args, device: str, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=g).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _drain(it) -> None:
    for _ in it:
        pass


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profile_round(delta, device: str) -> None:
    """One delta round under cProfile (host time per function) and torch.profiler (time per op)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        _drain(delta.iter_deltas())
        _sync(device)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    pr = cProfile.Profile()
    _sync(device)
    pr.enable()
    _drain(delta.iter_deltas())
    _sync(device)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


class _Check:
    """The one-process run's checks, outside the timed region: a receiver on the device fed only the
    timed rounds equals a dense pass bitwise after each (the round is exact), and a second
    ``DeltaSource`` over the same source on the torch path (``WEIGHTSYNC_DELTA_TRITON=0``) yields the
    same deltas bit for bit (the kernel equals the reference at the real shape)."""

    def __init__(self, src, delta, args) -> None:
        from weightsync.sources import DeltaSource

        self.src, self.delta = src, delta
        self.ref = DeltaSource(src, group_bytes=delta.group_bytes)
        self.recv: dict[str, torch.Tensor] = {}

    def anchor(self) -> None:
        from delta_edges import torch_path

        for d in self.delta.iter_deltas(whole_when_cheaper=True):
            self.recv[d.name] = d.values.reshape(d.full_shape).clone()
        with torch_path():
            _drain(self.ref.iter_deltas())

    def after_round(self, kept: list) -> dict:
        from delta_edges import torch_path

        with torch_path():
            ref = list(self.ref.iter_deltas())
        differ = []
        if [d.name for d in ref] != [d.name for d in kept]:
            differ.append(f"tensors: {len(kept)} from the kernels, {len(ref)} from the torch path")
        for a, b in zip(kept, ref):
            if a.name != b.name:
                break
            if not (torch.equal(a.indices, b.indices) and torch.equal(_ibits(a.values), _ibits(b.values))):
                differ.append(a.name)
        for d in kept:
            self.recv[d.name].view(-1)[d.indices.long()] = d.values
        wrong = [n for n, t in self.src.iter_full() if not torch.equal(_ibits(self.recv[n]), _ibits(t))]
        return {"same_as_torch": differ[:3], "exact_wrong": wrong[:3], "torch_kernel_buckets":
                self.ref.last_round.kernel_buckets}


def _ibits(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _worker(rank: int, world: int, args) -> dict | None:
    from weightsync.sources import DeltaSource, FSDPSource

    device = args.device
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = _model(args, device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = _model(args, device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    src = FSDPSource(model, dtype=torch.bfloat16)
    delta = DeltaSource(src, **({"group_bytes": args.group_mib << 20} if getattr(args, "group_mib", None) else {}))
    one_process = world == 1 and (device == "cuda" or getattr(args, "part", False))
    check = _Check(src, delta, args) if one_process else None
    if check is None:
        _drain(delta.iter_deltas())  # the anchor (first round): not timed
    else:
        check.anchor()
    _drain(src.iter_full())  # warm-up
    copy_src = copy_dst = None
    if one_process:  # the D2D copy of the model's wire bytes, timed interleaved with the rounds
        copy_src = torch.empty(delta.last_round.dense_bytes, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)
        copy_dst.copy_(copy_src)
    rows = []
    for step in range(args.steps):
        _train_step(model, opt, args, device, seed=step)
        times = {}
        if one_process:
            kinds = ("delta", "dense", "copy")
            order = kinds[step % 3:] + kinds[:step % 3]
        else:
            order = ("dense", "delta") if step % 2 else ("delta", "dense")
        for what in order:
            if world > 1:
                dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            if what == "dense":
                _drain(src.iter_full())
                dense_coll = src.last_pass.bytes_received
            elif what == "copy":
                copy_dst.copy_(copy_src)
            else:
                wire = 0
                kept = []
                for d in delta.iter_deltas():
                    wire += d.nbytes
                    kept.append(d)
            _sync(device)
            times[what] = time.perf_counter() - t0
        st = delta.last_round
        verdict = check.after_round(kept) if check is not None else {}
        kept = []
        rows.append({
            "step": step + 1, "changed": st.changed, "elements": st.elements, "tensors": st.tensors,
            "wire": wire, "dense_wire": st.dense_bytes, "coll": st.collective_bytes, "dense_coll": dense_coll,
            "t_delta": times["delta"], "t_dense": times["dense"], "t_copy": times.get("copy"),
            "snapshot": st.snapshot_bytes, "anchor": st.anchor, "kernel_buckets": st.kernel_buckets, **verdict,
        })
    if getattr(args, "profile", False) and rank == 0:
        _train_step(model, opt, args, device, seed=args.steps)
        _profile_round(delta, device)
    shard = sum((p._local_tensor if hasattr(p, "_local_tensor") else p).numel() * 2 for p in model.parameters())
    copy_s = min(r["t_copy"] for r in rows) if one_process else None
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, {"rows": rows, "shard": shard})
        if rank:
            return None
        return {"ranks": got, "copy_s": copy_s}
    return {"ranks": [{"rows": rows, "shard": shard}], "copy_s": copy_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (RL-like)")
    ap.add_argument("--record", action="store_true", help="append the ratios to bench/results/history.jsonl")
    ap.add_argument("--preset", choices=("qwen3-1.7b",), default=None,
                    help="Qwen3-1.7B's shapes (tests/gpu/hf_side.bench_config) instead of --hidden/--layers/--vocab")
    ap.add_argument("--json", default=None, help="run as a GPU-evidence part: one process, facts into this file")
    ap.add_argument("--dry-run", action="store_true", help="the part's code on CPU, tiny model, never recorded")
    ap.add_argument("--group-mib", type=int, default=None, help="DeltaSource(group_bytes=) in MiB (default: its own)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, one more step and round under cProfile and torch.profiler (printed)")
    args = ap.parse_args(argv)
    args.part = args.json is not None or args.dry_run
    if args.dry_run:
        args.device, args.preset = "cpu", None
        for k, v in DRY.items():
            setattr(args, k, v)
    if args.device == "cuda" or args.part:
        args.world = 1
    if args.part:
        return _run_part(args)
    _run(args)
    return 0


def _run_part(args) -> int:
    """The ``bench_delta`` part: ``_run`` under ``Facts`` (a crash is a failed check, not a traceback
    that loses the numbers already measured)."""
    from facts import Facts

    facts = Facts("bench_delta", dry_run=args.dry_run)
    from receiver import preload_checkpoint_weight_patch

    preload_checkpoint_weight_patch()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
            return facts.finish(args.json)
        torch.cuda.set_device(0)
    try:
        _run(args, facts)
    except Exception as e:  # noqa: BLE001
        facts.error("bench_delta", e)
    return facts.finish(args.json)


def _run(args, facts=None) -> None:
    """Run the bench and print its table; with ``facts`` (the part), also its numbers, the GPU-shape
    ratios against the copy and the regression guard as checks."""
    if args.world > 1:
        res = run_world(_worker, args.world, timeout=3600, pg_timeout_s=900, args=args)[0]
    else:
        res = _worker(0, 1, args)
    rows0 = res["ranks"][0]["rows"]
    what = ("Qwen3-1.7B-shaped" if args.preset
            else f"Qwen3-shaped hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}")
    print(f"delta sync vs dense pass: {what}, "
          f"fp32 masters, bf16 wire, Adam lr {args.lr:g}, {args.world} rank(s) on {args.device}")
    print(f"{'step':>4} {'changed':>8} {'tensors':>7} {'wire/dense':>10} {'B/changed':>9} "
          f"{'coll/dense':>10} {'t_delta':>8} {'t_dense':>8} {'delta/dense':>11}")
    for r in rows0:
        frac = r["changed"] / r["elements"]
        bpe = (r["wire"] / r["changed"]) if r["changed"] else 0.0
        coll = sum(x["rows"][r["step"] - 1]["coll"] for x in res["ranks"])
        dcoll = sum(x["rows"][r["step"] - 1]["dense_coll"] for x in res["ranks"])
        print(f"{r['step']:>4} {100 * frac:>7.2f}% {r['tensors']:>7} {r['wire'] / r['dense_wire']:>10.4f} {bpe:>9.2f} "
              f"{(coll / dcoll if dcoll else float('nan')):>10.4f} {r['t_delta']:>8.4f} {r['t_dense']:>8.4f} "
              f"{r['t_delta'] / r['t_dense']:>11.3f}")
    frac = statistics.median(r["changed"] / r["elements"] for r in rows0)
    ratio = statistics.median(r["t_delta"] / r["t_dense"] for r in rows0)
    coll = statistics.median(
        sum(x["rows"][i]["coll"] for x in res["ranks"]) / max(1, sum(x["rows"][i]["dense_coll"] for x in res["ranks"]))
        for i in range(len(rows0)))
    bpe = statistics.median(r["wire"] / r["changed"] for r in rows0 if r["changed"])
    snap = [x["rows"][-1]["snapshot"] / x["shard"] for x in res["ranks"]]
    print(f"median changed fraction {100 * frac:.2f}%; wire {bpe:.2f} B per changed element (goal <= 6 + per-tensor "
          f"constant); trainer collective bytes {coll:.4f}x the dense pass's; snapshot = {min(snap):.3f}-{max(snap):.3f}x "
          "the rank's shard in bf16 (stated: 1.0x)")
    print(f"trainer time, delta round / dense pass: median {ratio:.3f} (goal <= 0.5 at ~2% changed, 2 CPU ranks)")
    if res["copy_s"]:
        t = statistics.median(r["t_delta"] for r in rows0)
        cmed = statistics.median(r["t_copy"] for r in rows0)
        best = min(r["t_delta"] for r in rows0) / res["copy_s"]
        print(f"{args.device}: delta round / D2D copy of the wire bytes: best {best:.3f}, median {t / cmed:.3f} "
              f"(goal <= {GOAL_VS_COPY})")
        dense_wire = rows0[-1]["dense_wire"]
        for gbps in LINKS_GBPS:
            dense = statistics.median(r["t_dense"] for r in rows0) + dense_wire / (gbps * 1e9)
            dl = t + statistics.median(r["wire"] for r in rows0) / (gbps * 1e9)
            print(f"  sync-time model at {gbps} GB/s: dense {dense:.3f} s, delta {dl:.3f} s ({dense / dl:.1f}x)")
            if facts is not None:
                facts.number(f"sync-time model {gbps} GB/s: dense / delta s",
                             f"{dense:.4f} / {dl:.4f} ({dense / dl:.1f}x)")
    from _history import Guard, ratio_noise

    if args.preset:
        shape = f"{args.preset} lr{args.lr:g} {args.world}r {args.device}"
    else:
        shape = f"qwen3 h{args.hidden} l{args.layers} v{args.vocab} lr{args.lr:g} {args.world}r {args.device}"
    t_delta = [r["t_delta"] for r in rows0]
    ratios = [("delta/dense trainer time median", ratio, ratio_noise(t_delta, [r["t_dense"] for r in rows0])),
              ("wire bytes per changed element", bpe, 0.0)]
    if facts is None:
        guard = Guard("bench_delta", shape, record=args.record)
    else:
        from _gpu_bench import guard as bench_guard

        guard = bench_guard("bench_delta", shape, args)
        t_copy = [r["t_copy"] for r in rows0]
        best, med = min(t_delta) / min(t_copy), statistics.median(t_delta) / statistics.median(t_copy)
        n = len(rows0)
        facts.number("model", f"{what}, {rows0[0]['elements']} elements, "
                              f"{rows0[0]['dense_wire'] / 2**30:.3f} GiB bf16 wire")
        facts.number("changed fraction per step", [round(r["changed"] / r["elements"], 5) for r in rows0])
        for key, xs in (("delta round", t_delta), ("dense pass", [r["t_dense"] for r in rows0]), ("d2d copy", t_copy)):
            facts.number(f"{key} best_ms", round(min(xs) * 1e3, 3))
            facts.number(f"{key} median_ms", round(statistics.median(xs) * 1e3, 3))
        for stat, r in (("best", best), ("median", med)):
            facts.number(f"ratio delta/copy {stat}", round(r, 3),
                         f"(goal <= {GOAL_VS_COPY}: {'met' if r <= GOAL_VS_COPY else 'NOT met'}; {n} interleaved reps)")
        facts.number("ratio delta/dense median", round(ratio, 3))
        facts.check("wire <= 6 bytes per changed element (int32 index + bf16 value)", bpe <= 6.0 + 1e-9, f"{bpe:.3f}")
        facts.check("every timed round was a sparse delta (0 < changed < all)", all(
            0 < r["changed"] < r["elements"] and not r["anchor"] for r in rows0),
            [(r["changed"], r["anchor"]) for r in rows0])
        facts.check("snapshot = the model in the bf16 wire dtype (1.0x)", all(abs(x - 1.0) < 1e-9 for x in snap), snap)
        facts.check("every round exact: a receiver fed only the rounds == the dense pass, bitwise", all(
            not r["exact_wrong"] for r in rows0), [r["exact_wrong"] for r in rows0 if r["exact_wrong"]][:2] or n)
        facts.check("every round's deltas == the torch path's (WEIGHTSYNC_DELTA_TRITON=0), bitwise", all(
            not r["same_as_torch"] and r["torch_kernel_buckets"] == 0 for r in rows0),
            [r["same_as_torch"] for r in rows0 if r["same_as_torch"]][:2] or n)
        if args.device == "cuda":
            facts.check("the timed rounds ran the fused kernel (kernel_buckets > 0)", all(
                r["kernel_buckets"] > 0 for r in rows0), [r["kernel_buckets"] for r in rows0])
            from delta_edges import check as edge_check

            for label, ok, detail in edge_check("cuda", kernels=True):
                facts.check(f"edges: {label}", ok, detail)
        noise = ratio_noise(t_delta, t_copy)
        ratios += [("delta/copy best", best, noise), ("delta/copy median", med, noise)]
    for name, value, noise in ratios:
        bad = guard.check(name, value, noise)
        if facts is not None:
            facts.check(f"{name} no worse than the last recorded run", bad is None, guard.lines[-1])
    guard.finish()


if __name__ == "__main__":
    sys.exit(main())
