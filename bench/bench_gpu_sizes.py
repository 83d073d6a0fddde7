"""GPU benchmark at real sizes: one export pass of each source over a Qwen3-8B- or Qwen3-30B-A3B-shaped
model (or Qwen3-1.7B's shape), against vLLM's ``ModuleSource`` over the same model and a D2D copy of the
same bytes.

The model is built on the meta device and materialized on CUDA with random weights (no download):
``--shape qwen3-8b`` (36 layers, 8.2B parameters, 16.4 GB bf16) or ``--shape qwen3-30b-a3b`` (48
layers of 128 experts; ``--layers`` keeps the full width with fewer layers, stated in the output).
Sources, each drained once per repetition (``iter_full``; no transport), interleaved rep by rep:

* ``ModuleSource(plain)``   -- vLLM's source on the unsharded model (the reference cost);
* ``FSDPSource(fsdp2)``     -- weightsync's source on the same weights under FSDP2 (world size 1,
  ``fully_shard`` per decoder layer and at the root), experts per-expert (the checkpoint's names) and,
  for MoE, ``expert_layout="fused"`` (vLLM's fused names);
* ``ModuleSource(fsdp2)``   -- vLLM's source over the FSDP2 model (one ``full_tensor()`` per parameter).

Per source: seconds (best and median), GB/s of wire bytes, ratio to the copy floor and to
``ModuleSource(plain)``, tensors per second, and the peak device memory a pass allocates beyond the
model. Received bytes: every pass's tensors are summed (fp64) per name once and compared with the
plain model's (per-expert slices of the fused tensors for MoE) -- speed is never bought with a wrong
byte. ``--profile`` prints a cProfile of one ``FSDPSource`` pass (where per-tensor host time goes).

``--nccl`` (issue 51) times each source through vLLM's dense NCCL engines into a receiver process --
on one GPU under NCCL 2.30+'s multi-rank mode with the ferried library (``.ci/nccl_ferry.py``) --
against a bare broadcast of the same bytes on the same communicator, and reports the per-tensor cost.
One GPU measures NCCL's protocol and per-tensor overheads, not a link's bandwidth.

    python bench/bench_gpu_sizes.py --shape qwen3-1.7b --nccl
    python bench/bench_gpu_sizes.py --shape qwen3-8b
    python bench/bench_gpu_sizes.py --shape qwen3-30b-a3b --layers 12 --profile
    python bench/bench_gpu_sizes.py --dry-run            # CPU, tiny widths, the same code
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

from _gpu_bench import device_and_reps, guard as bench_guard, parser  # noqa: E402
from _history import ratio_noise  # noqa: E402
from _timing import copy_floor, interleaved, sync  # noqa: E402
from facts import Facts, log  # noqa: E402

GOAL_VS_MODULE = 1.0


def config(shape: str, layers: int | None, dry: bool):
    """The transformers config of ``shape`` (real widths; ``layers`` overrides the depth)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if shape == "qwen3-1.7b":  # the shape of every other GPU bench (tied embeddings)
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
        if dry:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)
        cfg = Qwen3Config(**kw)
    elif shape == "qwen3-8b":
        kw = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
        if dry:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)
        cfg = Qwen3Config(**kw)
    else:
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                  tie_word_embeddings=False)
        if dry:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8)
        cfg = Qwen3MoeConfig(**kw)
    if layers:
        cfg.num_hidden_layers = layers
    return cfg


def build(cfg, device: str):
    """The causal LM of ``cfg`` in bf16 on ``device``: built on meta, materialized, random normal."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.to_empty(device=device)
    if getattr(cfg, "tie_word_embeddings", False):  # to_empty unties: one tensor again, as loaded models have
        model.tie_weights()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for b in model.buffers():  # rotary inv_freq (not part of the checkpoint): defined, not used
            b.zero_()
    return model.eval()


def _drain_sums(src, plain_sums: dict | None):
    """One pass; per-name fp64 sums (for the received-bytes check)."""
    out = {}
    for name, t in src.iter_full():
        out[name] = float(t.double().sum().item())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, dry_help="CPU, tiny widths")
    ap.add_argument("--shape", choices=("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b"), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers at full width (stated)")
    ap.add_argument("--profile", action="store_true", help="cProfile one FSDPSource pass")
    ap.add_argument("--sources", default=None, help="comma list of source labels to time (default: all)")
    ap.add_argument("--ipc", action="store_true",
                    help="also time each source through vLLM's real IPC engines (packed and unpacked) into a "
                         "receiver process holding the same model; received per-parameter sums checked")
    ap.add_argument("--nccl", action="store_true",
                    help="also time each source through vLLM's real dense NCCL engines (packed and unpacked) into a "
                         "receiver process, against a bare NCCL broadcast of the same bytes on the same "
                         "communicator; on one GPU under NCCL's multi-rank mode (tests/gpu/nccl_one_gpu.py)")
    ap.add_argument("--delta", type=float, default=0.0,
                    help="also time DeltaSource(FSDPSource) rounds after changing this fraction of elements")
    args = ap.parse_args(argv)
    facts = Facts(f"bench_sizes_{args.shape}", dry_run=args.dry_run)
    import torch

    setup = device_and_reps(args, facts)
    if setup is None:
        return facts.finish(args.json)
    device, reps, warmup = setup
    try:
        _run(args, facts, device, reps, warmup)
    except Exception as e:  # noqa: BLE001
        facts.error("bench_sizes", e)
    return facts.finish(args.json)


def _run(args, facts, device: str, reps: int, warmup: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from hf_side import fsdp2_copy
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FSDPSource

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    cfg = config(args.shape, args.layers, args.dry_run)
    moe = args.shape == "qwen3-30b-a3b"
    t0 = time.perf_counter()
    plain = build(cfg, device)
    sharded = fsdp2_copy(plain, device)
    nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    full = {"qwen3-1.7b": 28, "qwen3-8b": 36}.get(args.shape, 48)
    what = (f"{args.shape} ({cfg.num_hidden_layers} of {full} layers at full width, "
            f"{sum(p.numel() for p in plain.parameters()) / 1e9:.2f}B params, {nbytes / 2**30:.2f} GiB bf16)")
    log(f"[bench_sizes] models built in {time.perf_counter() - t0:.1f}s: {what}")
    facts.number("model", what)
    sources = {"ModuleSource(plain)": ModuleSource(plain), "FSDPSource(fsdp2)": FSDPSource(sharded)}
    if moe:
        sources["FSDPSource(fsdp2, fused experts)"] = FSDPSource(sharded, expert_layout="fused")
    sources["ModuleSource(fsdp2)"] = ModuleSource(sharded)
    if args.sources:
        keep = set(args.sources.split(","))
        sources = {k: v for k, v in sources.items() if k in keep or k == "ModuleSource(plain)"}
    counts = {k: len(v.metadata) for k, v in sources.items()}
    for k, n in counts.items():
        facts.number(f"{k} tensors", n)
    # received bytes: per-name sums, fused experts compared per expert slice
    ref = {n: float(p.double().sum().item()) for n, p in plain.named_parameters()}
    for name, src in sources.items():
        got = _drain_sums(src, ref)
        bad = _compare(got, ref, plain, moe)
        facts.check(f"{name}: every tensor's fp64 sum equals the trainer's", not bad, bad[:5])
    base_mem = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    times: dict[str, list[float]] = {k: [] for k in sources}
    peaks: dict[str, int] = {}
    names = list(sources)
    for rep in range(warmup + reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t = time.perf_counter()
            for _ in sources[name].iter_full():
                pass
            sync(device)
            if rep >= warmup:
                times[name].append(time.perf_counter() - t)
            if device.startswith("cuda"):
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - base_mem)
    floor = copy_floor(nbytes, device=device, reps=reps)
    fb, fm = min(floor), statistics.median(floor)
    mod = times["ModuleSource(plain)"]
    facts.number("d2d copy best_ms / median_ms", f"{fb * 1e3:.2f} / {fm * 1e3:.2f}")
    guard = bench_guard("bench_sizes", f"{args.shape} l{cfg.num_hidden_layers} bf16 1gpu", args)
    for name, ts in times.items():
        b, m = min(ts), statistics.median(ts)
        line = (f"{b * 1e3:8.2f} ms best {m * 1e3:8.2f} ms median, {nbytes / b / 1e9:7.1f} GB/s, "
                f"{b / fb:5.2f}x copy, {b / min(mod):5.2f}x ModuleSource(plain) best / {m / statistics.median(mod):5.2f} median, "
                f"{counts[name] / b:9.0f} tensors/s, peak +{peaks.get(name, 0) / 2**20:.0f} MiB")
        log(f"[bench_sizes] {name:34s} {line}")
        facts.number(name, line)
        if name.startswith("FSDPSource"):
            for stat, r in (("best", b / min(mod)), ("median", m / statistics.median(mod))):
                noise = ratio_noise(ts, mod)
                bad = guard.check(f"{name}/ModuleSource(plain) {stat}", r, noise)
                facts.number(f"ratio {name}/ModuleSource(plain) {stat}", round(r, 3),
                             f"(goal <= {GOAL_VS_MODULE}: {'met' if r <= GOAL_VS_MODULE else 'NOT met'})")
                facts.check(f"{name}/ModuleSource(plain) {stat} no worse than the last recorded run", bad is None,
                            guard.lines[-1])
    if args.ipc:
        _ipc(args, facts, device, sources, cfg, plain, nbytes, reps, warmup, fb, guard)
    if args.nccl:
        _nccl(args, facts, device, sources, cfg, plain, nbytes, reps, warmup, fb, guard)
    if args.delta:
        _delta(args, facts, device, sharded, reps, fb, guard)
    guard.finish()
    if args.profile:
        import cProfile
        import pstats

        src = sources["FSDPSource(fsdp2)"]
        pr = cProfile.Profile()
        sync(device)
        pr.enable()
        for _ in src.iter_full():
            pass
        sync(device)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(25)


def _ipc(args, facts, device: str, sources: dict, cfg, plain, nbytes: int, reps: int, warmup: int,
         copy_s: float, guard) -> None:
    """Each source through vLLM's IPC trainer engine and its worker engine in a receiver process
    (``tests/gpu/receiver.py``: a transformers model of the same config; per-expert names land in
    its fused tensors), packed (1 GiB buffers) and unpacked, interleaved; then per source one sync
    into a reset receiver whose per-parameter fp64 sums must equal the trainer's."""
    import torch

    from receiver import start_receiver, sums_differ, trainer_engine

    mode = "loopback" if args.dry_run else "ipc"
    ref = {n: float(p.double().sum().item()) for n, p in plain.named_parameters()}
    if device.startswith("cuda"):
        import gc

        gc.collect()
        torch.cuda.empty_cache()  # the receiver process needs the memory this one's allocator caches
    client = start_receiver(mode, device, timeout_s=900)
    try:
        client.call("build", (cfg, torch.bfloat16, 7, False))
        # packed buffers hold the largest tensor (Qwen3-8B's embedding is 1.16 GiB): vLLM refuses a smaller one
        largest = max(p.numel() * p.element_size() for p in plain.parameters())
        buffer_bytes = max(1 << 30, -(-largest // (1 << 20)) << 20)
        for packed in (False, True):
            tag = "packed" if packed else "unpacked"
            engines = {name: trainer_engine(mode, client=client, source=src, packed=packed, buffer_bytes=buffer_bytes)
                       for name, src in sources.items()}
            times = interleaved({name: eng.send_weights for name, eng in engines.items()},
                                device=device, reps=reps, warmup=warmup)
            for name, eng in engines.items():
                bad = sums_differ(client, eng, ref)
                facts.check(f"ipc {tag} {name}: the receiver's per-parameter sums equal the trainer's", not bad,
                            bad[:5])
            mod = times["ModuleSource(plain)"]
            for name, ts in times.items():
                b, m = min(ts), statistics.median(ts)
                line = (f"{b * 1e3:8.1f} ms best {m * 1e3:8.1f} ms median, {nbytes / b / 1e9:6.1f} GB/s, "
                        f"{b / copy_s:5.2f}x copy, {b / min(mod):5.2f}x / {m / statistics.median(mod):5.2f}x "
                        "ModuleSource(plain) best / median")
                log(f"[bench_sizes] ipc {tag:8s} {name:34s} {line}")
                facts.number(f"ipc {tag} {name}", line)
                if name.startswith("FSDPSource"):
                    r = b / min(mod)
                    bad = guard.check(f"ipc {tag} {name}/ModuleSource(plain) best", r, ratio_noise(ts, mod))
                    facts.number(f"ratio ipc {tag} {name}/ModuleSource(plain) best", round(r, 3),
                                 f"(goal <= {GOAL_VS_MODULE}: {'met' if r <= GOAL_VS_MODULE else 'NOT met'})")
                    facts.check(f"ipc {tag} {name}/ModuleSource(plain) best no worse than the last recorded run",
                                bad is None, guard.lines[-1])
    finally:
        client.close()


#: a refit over NCCL (packed, weightsync's source) against a bare broadcast of the same bytes (issue 51)
GOAL_NCCL_VS_BROADCAST = 1.1


def _nccl(args, facts, device: str, sources: dict, cfg, plain, nbytes: int, reps: int, warmup: int,
          copy_s: float, guard) -> None:
    """Each source through vLLM's dense NCCL trainer engine and its worker engine in a receiver process
    (``tests/gpu/receiver.py``, mode "nccl"), unpacked and packed (1 GiB buffers), one source at a time
    (each engine is its own communicator with the worker); per source and mode, then a bare broadcast of
    ``nbytes`` in 1 GiB pieces on the same communicator (the transport alone: no source, no per-tensor
    work); then one sync into a reset receiver whose per-parameter fp64 sums must equal the trainer's.
    The per-tensor cost is ``ModuleSource(plain)``'s time (no gathers: the engines alone) less the bare
    broadcast's, per tensor, unpacked and packed. A dry run uses the loopback transport (no broadcast
    floor)."""
    import torch

    from receiver import shutdown_pair, start_receiver, sums_differ, trainer_engine

    mode = "loopback" if args.dry_run else "nccl"
    worker_device = device
    if mode == "nccl":
        from nccl_one_gpu import loaded_nccl, place, why_not

        where = place(2)
        if where is None:
            facts.skip("nccl refits", why_not(2))
            return
        worker_device = where[1]
        facts.number("nccl placement", f"trainer {device}, worker {worker_device}; NCCL_MAX_CTAS="
                                       f"{os.environ.get('NCCL_MAX_CTAS', '(NCCL default)')}")
    ref = {n: float(p.double().sum().item()) for n, p in plain.named_parameters()}
    if device.startswith("cuda"):
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    client = start_receiver(mode, worker_device, timeout_s=900)
    piece = 1 << 30 if not args.dry_run else 1 << 20
    try:
        client.call("build", (cfg, torch.bfloat16, 7, False))
        largest = max(p.numel() * p.element_size() for p in plain.parameters())
        buffer_bytes = max(1 << 30, -(-largest // (1 << 20)) << 20)
        best: dict[tuple[str, bool], float] = {}
        bares: dict[tuple[str, bool], float] = {}
        for packed in (False, True):
            tag = "packed" if packed else "unpacked"
            for name, src in sources.items():
                eng = trainer_engine(mode, client=client, source=src, packed=packed, buffer_bytes=buffer_bytes)
                try:
                    if mode == "nccl" and name == "ModuleSource(plain)" and not packed:
                        facts.number("nccl communicator", loaded_nccl(eng.model_update_group))
                    ts = []
                    for i in range(warmup + reps):
                        torch.cuda.synchronize() if device.startswith("cuda") else None
                        t0 = time.perf_counter()
                        eng.send_weights()
                        torch.cuda.synchronize() if device.startswith("cuda") else None
                        if i >= warmup:
                            ts.append(time.perf_counter() - t0)
                    bad = sums_differ(client, eng, ref)
                    facts.check(f"nccl {tag} {name}: the receiver's per-parameter sums equal the trainer's", not bad,
                                bad[:5])
                    bare = _bare_broadcast(eng, client, nbytes, piece, reps, warmup) if mode == "nccl" else None
                finally:
                    shutdown_pair(eng, client, mode)
                b, m = min(ts), statistics.median(ts)
                best[(name, packed)] = b
                if bare:
                    bares[(name, packed)] = bare
                line = (f"{b * 1e3:8.1f} ms best {m * 1e3:8.1f} ms median, {nbytes / b / 1e9:6.1f} GB/s, "
                        f"{b / copy_s:6.1f}x copy")
                if bare:
                    line += f", {b / bare:5.2f}x a bare broadcast of the same bytes ({bare * 1e3:.1f} ms)"
                log(f"[bench_sizes] nccl {tag:8s} {name:34s} {line}")
                facts.number(f"nccl {tag} {name}", line)
                if bare and name.startswith("FSDPSource") and packed:
                    r = b / bare
                    facts.number(f"ratio nccl packed {name}/bare broadcast best", round(r, 3),
                                 f"(goal <= {GOAL_NCCL_VS_BROADCAST}: "
                                 f"{'met' if r <= GOAL_NCCL_VS_BROADCAST else 'NOT met'})")
                    g = guard.check(f"nccl packed {name}/bare broadcast best", r, 0.05)
                    facts.check(f"nccl packed {name}/bare broadcast best no worse than the last recorded run",
                                g is None, guard.lines[-1])
        n = len(sources["ModuleSource(plain)"].metadata)
        for packed in (False, True):  # the engines' cost per tensor beyond the transport itself
            key = ("ModuleSource(plain)", packed)
            if key in best and key in bares:
                per = (best[key] - bares[key]) / n
                facts.number(f"nccl per-tensor cost, {'packed' if packed else 'unpacked'} (ModuleSource(plain) "
                             "less the bare broadcast, per tensor)", f"{per * 1e6:.1f} us over {n} tensors")
    finally:
        client.close()


def _bare_broadcast(eng, client, nbytes: int, piece: int, reps: int, warmup: int) -> float:
    """Best seconds of broadcasting ``nbytes`` in ``piece``-byte broadcasts on ``eng``'s communicator,
    the receiver taking them on its own (its ``recv_raw``): the transport's floor for the same bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    comm = eng.model_update_group
    buf = torch.empty(piece, dtype=torch.uint8, device=comm.device)
    count = max(1, -(-nbytes // piece))
    out = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for i in range(warmup + reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = pool.submit(client.call, "recv_raw", (piece, count))
            for _ in range(count):
                comm.broadcast(buf, src=0, stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            fut.result(timeout=600)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    del buf
    return min(out)


def _delta(args, facts, device: str, sharded, reps: int, copy_s: float, guard) -> None:
    """DeltaSource over FSDPSource: per rep, ``--delta`` of the elements change (parameter noise on
    the local shards; bf16 model, so every noised element changes on the wire), then one delta round
    and one dense pass, interleaved; rounds checked against the dense pass (changed count)."""
    import torch

    from receiver import preload_checkpoint_weight_patch

    preload_checkpoint_weight_patch()  # DeltaSource's patch type: vLLM's file, without the serving stack
    from weightsync.sources import DeltaSource, FSDPSource

    dense_src = FSDPSource(sharded)
    delta = DeltaSource(FSDPSource(sharded))
    for _ in delta.iter_patches():  # anchor
        pass
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for rep in range(reps):
        with torch.no_grad():
            for p in sharded.parameters():
                t = p._local_tensor if hasattr(p, "_local_tensor") else p
                m = torch.rand(t.shape, generator=g, device=device) < args.delta
                t.add_(m.to(t.dtype) * 0.01)
                del m
        times = {}
        for what in (("delta", "dense") if rep % 2 else ("dense", "delta")):
            sync(device)
            t0 = time.perf_counter()
            if what == "delta":
                n = 0
                for pt in delta.iter_patches():
                    n += pt.indices.numel()
            else:
                for _ in dense_src.iter_full():
                    pass
            sync(device)
            times[what] = time.perf_counter() - t0
        st = delta.last_round
        rows.append((times["delta"], times["dense"], st.changed, st.elements, st.kernel_buckets, n))
    import statistics as stt

    d = [r[0] for r in rows]
    dn = [r[1] for r in rows]
    frac = stt.median(r[2] / r[3] for r in rows)
    line = (f"changed {100 * frac:.2f}%, round best {min(d) * 1e3:.1f} ms median {stt.median(d) * 1e3:.1f} ms; "
            f"dense pass median {stt.median(dn) * 1e3:.1f} ms; round/dense {stt.median(d) / stt.median(dn):.3f}; "
            f"round/copy best {min(d) / copy_s:.2f}; kernel buckets {rows[-1][4]}")
    log(f"[bench_sizes] DeltaSource(FSDPSource) {line}")
    facts.number("DeltaSource(FSDPSource)", line)
    facts.check("every delta round's patches carry exactly its changed count", all(r[2] == r[5] for r in rows),
                [(r[2], r[5]) for r in rows])
    guard.check("delta round/copy best", min(d) / copy_s, 0.1)


def _compare(got: dict, ref: dict, plain, moe: bool) -> list[str]:
    """Names whose sum differs from the trainer's (fused in-memory experts checked per expert)."""
    bad = []
    import torch

    for name, v in got.items():
        want = ref.get(name)
        if want is None and moe and ".mlp.experts." in name:
            # per-expert checkpoint name: the slice of the fused in-memory parameter
            pre, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[0], rest.split(".")[1]
            experts = plain.get_submodule(pre + ".mlp.experts")
            e = int(e)
            if proj in ("gate_proj", "up_proj"):
                w = experts.gate_up_proj[e]
                half = w.shape[0] // 2
                w = w[:half] if proj == "gate_proj" else w[half:]
            else:
                w = experts.down_proj[e]
            want = float(w.double().sum().item())
        if want is None or want != v:
            bad.append(name)
    return bad


if __name__ == "__main__":
    sys.exit(main())
