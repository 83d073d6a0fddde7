"""GPU benchmark and evidence: FP8 rollouts -- ``FP8Source`` over ``FSDPSource`` through vLLM 0.33's real
CUDA IPC engines on a Qwen3-1.7B-shaped model, against the BF16 pass of the same source, in one run.

1. Numerics on CUDA: ``quantize_blocks`` (Triton kernels for the block amax and the scale-and-cast)
   equals vLLM's ``per_block_cast_to_fp8`` bit for bit (fp32 and UE8M0 scales) and transformers'
   ``Fp8Quantize`` (block-multiple shapes), on edge shapes (N, K not multiples of 128), all-zero
   blocks, subnormal-range and large values; and equals weightsync's own torch path (the one CPU runs).
2. Cost of quantization alone: the 196 projection weights one at a time, vs a D2D copy of the bytes
   they read, and vs vLLM's ``per_block_cast_to_fp8`` (the plain torch formula). Goal: <= 2x the copy.
3. IPC round trips (packed: FP8, BF16 and FP32 in one buffer; and unpacked) into a receiver holding an
   FP8 checkpoint's tensors (``FP8CheckpointModel``): every received tensor's bytes equal vLLM's
   quantizer applied to the trainer's weights, every receiver parameter written.
4. Time of one ``send_weights()``: FP8 pass / BF16 pass, packed and unpacked, interleaved rep by rep,
   with vLLM's ``ModuleSource`` over ready-made BF16 and FP8 modules (the engines' own cost, no
   weightsync code) and ``FP8Source`` over that ``ModuleSource`` (the quantization's own cost, no FSDP).
   Goals, packed: FP8 pass <= 1.35x the BF16 pass (the issue's; out of reach wherever the engines alone
   exceed it), and FP8Source's pass <= 1.09x the engines' own FP8 pass (the share of 1.35x the issue
   left to the source). Wire bytes: exactly an FP8 checkpoint's (embeddings stay BF16).

Every ratio is compared with the last recorded run (``bench/_history.py``: REGRESSION when worse by
more than the run's noise, 5% at least); ``--record`` (or ``OUT`` set, as under ``.ci/gpu``) records it.

    python bench/bench_gpu_fp8.py [--reps 7] [--warmup 2] [--dry-run] [--record] [--json out.json]
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

from _gpu_bench import device_and_reps, guard as bench_guard, parser  # noqa: E402
from _history import ratio_noise  # noqa: E402
from _timing import sync, timed  # noqa: E402
from facts import Facts, log  # noqa: E402

SHAPE = "qwen3-1.7b bf16 1gpu"
GOAL_QUANT_VS_COPY = 2.0
GOAL_FP8_VS_BF16_PACKED = 1.35
#: The issue measured the engines themselves (vLLM's ModuleSource over a ready-made FP8 module vs the BF16 one) at
#: 1.24x packed and set 1.35x for the whole FP8 pass: a source may add 1.35 / 1.24 on top of the engines' own FP8
#: pass. On the hosts lent here the engines alone take 1.36-1.49x, so 1.35x is out of reach for any source; this is
#: the part of the goal that is the source's.
GOAL_OVER_ENGINES_PACKED = round(1.35 / 1.24, 2)


def _numerics(facts: Facts, device: str) -> None:
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.sources import quantize_blocks
    from weightsync.sources.quant import fp8 as fp8mod  # noqa: PLC0415 - the torch path, for comparison

    g = torch.Generator(device="cpu").manual_seed(0)
    cases = []
    for shape in [(1, 1), (7, 300), (128, 128), (129, 257), (1000, 130), (2048, 6144), (384, 2048),
                  (300, 208), (130, 1040)]:  # the last two: batched, with edge blocks
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, generator=g) * 2
            if shape[0] >= 256:
                x[:128, :128] = 0  # an all-zero block
                x[128:256, :128] *= 1e-40  # subnormal range (fp32; flushes in bf16)
                x[:128, -100:] *= 1e30  # large values
            cases.append((x.to(dt).to(device), f"{shape} {str(dt)[6:]}"))
    bad_v, bad_t, bad_path, n = [], [], [], 0
    vllm_variants: list[str] = []
    refs: dict[str, tuple] = {}  # the static compile's bytes per case (the oracle), for the batched check
    for x, what in cases:
        for ue in (False, True):
            # vLLM's quantizer is torch.compile'd on CUDA, and its bytes depend on the compile state: a
            # shape first met after other shapes runs Inductor's dynamic-shape kernel, which differed
            # from the static one in 3 of 12.6M codes (fp32 (2048, 6144); tests/gpu/diag_fp8_f32.py).
            # The oracle is the static compile of each case (a fresh dynamo state); the dynamic one is
            # reported beside it, as a fact about vLLM.
            dq, ds = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue)
            torch._dynamo.reset()
            rq, rs = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue)
            if not (torch.equal(dq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(ds, rs)):
                vllm_variants.append(f"{what} ue8m0={ue}: {int((dq.view(torch.uint8) != rq.view(torch.uint8)).sum())} codes")
            if not ue:
                refs[what] = (rq, rs)
            q, s = quantize_blocks(x, (128, 128), scale_fmt="ue8m0" if ue else None)
            n += 1
            if not (torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)):
                bad_v.append(f"{what} ue8m0={ue}")
            # the torch path (CPU's) on the same device gives the same bytes as the kernels, both rules
            for rule in ("vllm", "transformers"):
                kq, ks = quantize_blocks(x, (128, 128), scale_fmt="ue8m0" if ue else None, rule=rule)
                kernels, fp8mod._KERNELS = fp8mod._KERNELS, None
                fp8mod._KERNELS_TRIED = True
                try:
                    tq, ts = quantize_blocks(x, (128, 128), scale_fmt="ue8m0" if ue else None, rule=rule)
                finally:
                    fp8mod._KERNELS = kernels
                if not (torch.equal(kq.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(ks, ts)):
                    bad_path.append(f"{what} ue8m0={ue} {rule}")
            if x.shape[0] % 128 == 0 and x.shape[1] % 128 == 0:
                hq = type("Q", (), {})()
                hq.quantization_config = FineGrainedFP8Config(weight_block_size=(128, 128),
                                                              scale_fmt="ue8m0" if ue else "float")
                out = Fp8Quantize(hq).convert({"w.weight": x})
                q2, s2 = quantize_blocks(x, (128, 128), scale_fmt="ue8m0" if ue else None, rule="transformers")
                if not (torch.equal(q2.view(torch.uint8), out["w.weight"].view(torch.uint8))
                        and torch.equal(s2, out["w.weight_scale_inv"].float())):
                    bad_t.append(f"{what} ue8m0={ue}")
    # the batched launch (what FP8Source uses on CUDA) gives every tensor's reference bytes too
    from weightsync.sources.quant.fp8 import quantize_many  # noqa: PLC0415

    for dt in (torch.bfloat16, torch.float32):
        xs = [(x, what) for x, what in cases if x.dtype == dt]
        for rule in ("vllm", "transformers"):
            for (x, what), (q, s) in zip(xs, quantize_many([x for x, _ in xs], (128, 128), rule=rule)):
                tq, ts = quantize_blocks(x, (128, 128), rule=rule)
                rq, rs = refs[what] if rule == "vllm" else (tq, ts)
                if not (torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
                        and torch.equal(q.view(torch.uint8), tq.view(torch.uint8))):
                    bad_path.append(f"batched {tuple(x.shape)} {dt} {rule}")
    # vLLM's quantizer under torch.compile (what a compiled vLLM path runs): Inductor fuses the
    # division chain, so its bytes may differ in the last bit; reported per case, eager is the reference
    try:
        import torch._dynamo

        same, diff, picked = 0, [], [(x, w) for x, w in cases if x.dtype == torch.bfloat16][1:5]  # edge shapes
        for x, what in picked:
            torch._dynamo.reset()  # a fresh graph per shape: no recompile limit, no silent eager fallback
            cq, cs = torch.compile(per_block_cast_to_fp8, dynamic=False, fullgraph=True)(x, [128, 128])
            q, s = quantize_blocks(x, (128, 128))
            if torch.equal(q.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(s, cs):
                same += 1
            else:
                nq = int((q.view(torch.uint8) != cq.view(torch.uint8)).sum())
                diff.append(f"{what}: {nq} codes, {int((s != cs).sum())} scales")
        cases_n = len(picked)
        facts.number("FP8Source bytes vs torch.compile(per_block_cast_to_fp8)",
                     f"{same}/{cases_n} cases bitwise equal; differing: {diff[:6]}")
    except Exception as e:  # noqa: BLE001 - Inductor unavailable here: say so, eager stays the reference
        facts.number("FP8Source bytes vs torch.compile(per_block_cast_to_fp8)", f"not run: {type(e).__name__}: {e}"[:300])
    facts.number("vLLM per_block_cast_to_fp8: dynamic-shape compile vs static compile",
                 f"differ in {vllm_variants[:6]}" if vllm_variants else "bitwise equal in every case")
    facts.check("CUDA quantize_blocks == vLLM per_block_cast_to_fp8 (bitwise, static compile)", not bad_v,
                f"{n} cases; bad: {bad_v[:4]}")
    facts.check("CUDA quantize_blocks(rule=transformers) == transformers Fp8Quantize (bitwise)", not bad_t, f"bad: {bad_t[:4]}")
    facts.check("Triton kernels (one tensor, batched) == weightsync's torch path and vLLM (bitwise)", not bad_path,
                f"bad: {bad_path[:4]}")


def _windows(weights: list, limit: int) -> list[list]:
    """``FP8Source``'s launch windows over consecutive weights: each closes once it holds ``limit``
    input bytes (``FP8Source._stream``)."""
    windows, cur, held = [], [], 0
    for w in weights:
        cur.append(w)
        held += w.numel() * w.element_size()
        if held >= limit:
            windows.append(cur)
            cur, held = [], 0
    return windows + ([cur] if cur else [])


def _profile(facts: Facts, device: str, mode: str, cfg, qcfg, bf16, fp8, weights, windows, reps: int, warmup: int):
    """Where an FP8 pass's time goes, as numbers (``--profile``)."""
    import cProfile
    import io
    import pstats

    import torch

    from receiver import start_receiver, trainer_engine

    from weightsync.sources.quant.fp8 import quantize_many  # noqa: PLC0415

    def drain(src):
        for _ in src.iter_full():
            pass

    for tag, src in (("bf16", bf16), ("fp8", fp8)):
        ts = timed(lambda: drain(src), device=device, reps=reps, warmup=warmup)
        facts.number(f"profile: {tag} source alone (iter_full, no engine) median_ms", round(statistics.median(ts) * 1e3, 3))
    host = []
    for _ in range(reps + warmup):
        sync(device)
        t0 = time.perf_counter()
        for ws in windows:
            quantize_many(ws)
        host.append(time.perf_counter() - t0)
        sync(device)
    facts.number("profile: quantize_many windows host time (no sync) median_ms", round(statistics.median(host[warmup:]) * 1e3, 3))
    facts.number("profile: windows", len(windows))
    for mib in (64, 128, 256):
        wins = _windows(weights, mib << 20)
        ts = timed(lambda: [quantize_many(ws) for ws in wins], device=device, reps=reps, warmup=warmup)
        facts.number(f"profile: quantize_many in {mib} MiB windows ({len(wins)}) best_ms", round(min(ts) * 1e3, 3))
    one = timed(lambda: quantize_many(weights), device=device, reps=reps, warmup=warmup)
    facts.number("profile: quantize_many all weights in ONE launch best_ms", round(min(one) * 1e3, 3))
    if device.startswith("cuda"):
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        quantize_many(weights)
        ev1.record()
        torch.cuda.synchronize()
        facts.number("profile: ONE launch device time (events) ms", round(ev0.elapsed_time(ev1), 3))
    client = start_receiver(mode, device, timeout_s=300)
    client.call("build_fp8", (cfg, torch.bfloat16, 7, True, qcfg))
    client_bf16 = start_receiver(mode, device, timeout_s=300)
    client_bf16.call("build", (cfg, torch.bfloat16, 7, False))
    client.call("track", False)
    client_bf16.call("track", False)
    for packed in (True, False):
        ptag = "packed" if packed else "unpacked"
        for tag, src, cl in (("bf16", bf16, client_bf16), ("fp8", fp8, client)):
            spent = [0.0]
            real = cl.update_weights

            def timed_update(info, _real=real, _spent=spent):
                t0 = time.perf_counter()
                try:
                    return _real(info)
                finally:
                    _spent[0] += time.perf_counter() - t0

            cl.update_weights = timed_update
            try:
                eng = trainer_engine(mode, client=cl, source=src, packed=packed, buffer_bytes=1 << 30)
                ts, recv = [], []
                for i in range(warmup + reps):
                    spent[0] = 0.0
                    sync(device)
                    t0 = time.perf_counter()
                    eng.send_weights()
                    sync(device)
                    if i >= warmup:
                        ts.append(time.perf_counter() - t0)
                        recv.append(spent[0])
                facts.number(f"profile: {tag} {ptag} pass median_ms", round(statistics.median(ts) * 1e3, 3))
                facts.number(f"profile: {tag} {ptag} receiver calls (update_weights) median_ms",
                             round(statistics.median(recv) * 1e3, 3))
                if packed:
                    pr = cProfile.Profile()
                    pr.enable()
                    eng.send_weights()
                    sync(device)
                    pr.disable()
                    buf = io.StringIO()
                    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
                    log(f"[bench_fp8 profile] cProfile {tag} {ptag}, by tottime:\n" + buf.getvalue())
                eng.shutdown()
            finally:
                cl.update_weights = real
    return client, client_bf16


def _vllm_quantized(fp8, plain: dict, plans: dict) -> dict:
    """``{name: digest}`` of what the receiver must hold: vLLM's ``per_block_cast_to_fp8`` of each
    planned weight (codes and scale), every other tensor as the trainer has it."""
    from hf_side import digest
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    want = {}
    for m in fp8.source.metadata:
        t = plain.get(m.name, plain.get("model.embed_tokens.weight") if m.name == "lm_head.weight" else None)
        if m.name in plans:
            q, sc = per_block_cast_to_fp8(t, [128, 128])
            want[m.name], want[plans[m.name].scale_name] = digest(q), digest(sc)
        elif t is not None:
            want[m.name] = digest(t)
    return want


def _nccl_round_trip(facts: Facts, device: str, dry_run: bool, cfg, qcfg, fp8, plain: dict, plans: dict) -> None:
    """Part ``nccl_fp8``: ``FP8Source(FSDPSource)`` through vLLM's dense NCCL engines into a receiver holding
    an FP8 checkpoint's tensors, unpacked and packed: every received code and scale equals vLLM's
    quantizer on the trainer's weights, every receiver tensor written."""
    import torch

    from receiver import shutdown_pair, start_receiver, trainer_engine

    mode, worker = "loopback", device
    if not dry_run:
        from nccl_one_gpu import place, why_not

        where = place(2)
        if where is None:
            facts.skip("FP8 over NCCL", why_not(2))
            return
        mode, worker = "nccl", where[1]
    want = _vllm_quantized(fp8, plain, plans)
    client = start_receiver(mode, worker, timeout_s=300)
    try:
        client.call("build_fp8", (cfg, torch.bfloat16, 7, True, qcfg))
        for packed in (False, True):
            tag = "packed" if packed else "unpacked"
            eng = trainer_engine(mode, client=client, source=fp8, packed=packed, buffer_bytes=1 << 30)
            try:
                client.call("reset")
                eng.send_weights()
                rep = client.call("report")
            finally:
                shutdown_pair(eng, client, mode)
            got = dict(rep["received"])
            bad = [n for n, d in want.items() if got.get(n) != d]
            facts.check(f"FP8 over NCCL {tag}: received codes and scales == vLLM's quantizer on the trainer's "
                        "weights, every receiver tensor written", not bad and not rep["missing"],
                        f"{len(got)} tensors ({sum(1 for n in got if n.endswith('weight_scale_inv'))} scales); "
                        f"differ {bad[:3]}; missing {rep['missing'][:3]}")
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--profile", action="store_true",
                    help="diagnose instead of measuring: where a pass's time goes (source alone, quantization's host "
                         "and device time, the receiver's share, cProfile of one packed pass); no goals, no record")
    ap.add_argument("--transport", choices=("ipc", "nccl"), default="ipc",
                    help="nccl (part nccl_fp8): only the round trip, through vLLM's dense NCCL engines (on one GPU "
                         "under NCCL's multi-rank mode): received bytes == vLLM's quantizer, unpacked and packed")
    args = ap.parse_args(argv)
    nccl = args.transport == "nccl"
    facts = Facts("nccl_fp8" if nccl else "bench_fp8", dry_run=args.dry_run)
    guard = bench_guard("bench_fp8", SHAPE, args, record=not args.profile and not nccl)
    ratios: list[tuple[str, float, float]] = []
    import torch

    from hf_side import bench_config, build_hf, tiny_config
    from receiver import start_receiver, trainer_engine

    setup = device_and_reps(args, facts)
    if setup is None:
        return facts.finish(args.json)
    device, reps, warmup = setup
    mode = "loopback" if args.dry_run else "ipc"
    client = client_bf16 = None
    try:
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        from weightsync.sources import FP8Source, FSDPSource, quantize_blocks
        from weightsync.sources.quant.fp8 import quantize_many  # noqa: PLC0415

        if not args.profile and not nccl:
            _numerics(facts, device)
        dist.init_process_group("nccl" if not args.dry_run else "gloo", store=dist.HashStore(),  # 1 rank
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
        cfg = tiny_config("qwen3") if args.dry_run else bench_config()
        model = build_hf(cfg, device=device, dtype=torch.bfloat16, seed=3)
        plain = {n: p.detach().clone() for n, p in model.named_parameters()}
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        bf16 = FSDPSource(model)
        fp8 = FP8Source(FSDPSource(model))
        qcfg = fp8.quantization_config
        plans = fp8._plans
        facts.number("quantized tensors", len(plans))

        if nccl:
            _nccl_round_trip(facts, device, args.dry_run, cfg, qcfg, fp8, plain, plans)
            return facts.finish(args.json)
        # 2. quantization alone, one tensor at a time
        weights = [plain[n] for n in plans]
        read = sum(w.numel() * w.element_size() for w in weights)
        windows = _windows(weights, fp8.batch_bytes)
        # Interleaved, rep by rep, after a spin-up: a GPU that idled through the numerics above clocks up
        # over tens of ms, and measuring the copy floor last (as the first runs did) compared a warm copy
        # with a cold quantization (same code: 1.11x in a warm probe, 2.33x in that bench).
        bufs = {"src": torch.empty(read, dtype=torch.uint8, device=device)}
        bufs["dst"] = torch.empty_like(bufs["src"])
        spin_until = time.perf_counter() + (0.0 if args.dry_run else 0.5)
        while time.perf_counter() < spin_until:
            bufs["dst"].copy_(bufs["src"])
            sync(device)
        runs = {"copy": lambda: bufs["dst"].copy_(bufs["src"]),
                "ours": lambda: [quantize_many(ws) for ws in windows],
                "one": lambda: [quantize_blocks(w) for w in weights],
                "vllm": lambda: [per_block_cast_to_fp8(w, [128, 128]) for w in weights]}
        got: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(warmup + reps):
            for k, fn in runs.items():
                t = timed(fn, device=device, reps=1, warmup=0)
                if i >= warmup:
                    got[k] += t
        q_ours, q_one, q_vllm, ct = (got[k] for k in ("ours", "one", "vllm", "copy"))
        bufs.clear()  # 2 x the weights' bytes, before the receivers start
        facts.number("quantize_blocks one launch per tensor best_ms", round(min(q_one) * 1e3, 3))
        facts.number("FP8Source windows (batch_bytes MiB, launches)", f"{fp8.batch_bytes >> 20}, {len(windows)}")
        for tag, ts in (("weightsync quantize_many (FP8Source's windows)", q_ours), ("vLLM per_block_cast_to_fp8", q_vllm)):
            r = min(ts) / min(ct)
            facts.number(f"{tag} best_ms", round(min(ts) * 1e3, 3))
            facts.number(f"{tag} / d2d copy of the bytes read (best)", round(r, 2),
                         f"(goal <= {GOAL_QUANT_VS_COPY}: {'met' if r <= GOAL_QUANT_VS_COPY else 'NOT met'})"
                         if tag.startswith("weightsync") else "")
        facts.number("d2d copy of the bytes read best_ms", round(min(ct) * 1e3, 3))
        ratios.append(("quantize/copy best", min(q_ours) / min(ct), ratio_noise(q_ours, ct)))

        if args.profile:
            client, client_bf16 = _profile(facts, device, mode, cfg, qcfg, bf16, fp8, weights, windows, reps, warmup)
            return facts.finish(args.json)

        # 3. round trips: received bytes == vLLM's quantizer on the trainer's weights
        want = _vllm_quantized(fp8, plain, plans)
        client = start_receiver(mode, device, timeout_s=300)
        client.call("build_fp8", (cfg, torch.bfloat16, 7, True, qcfg))
        client_bf16 = start_receiver(mode, device, timeout_s=300)  # the BF16 pass's own receiver
        client_bf16.call("build", (cfg, torch.bfloat16, 7, False))
        clients = {"bf16": client_bf16, "fp8": client, "bf16 module": client_bf16, "fp8 module": client,
                   "fp8 over module": client}
        # The engines themselves: vLLM's ModuleSource over ready-made modules (no weightsync code), the
        # BF16 model and the same weights as an FP8 checkpoint's tensors -- what the FP8 stream costs
        # vLLM's engines and the receiver whoever quantizes it.
        from vllm.distributed.weight_transfer import ModuleSource

        from weightsync.plugins.testbed.fp8_model import FP8CheckpointModel

        ready_bf16 = build_hf(cfg, device=device, dtype=torch.bfloat16, seed=3)
        ready_bf16.load_state_dict(plain, strict=False)
        ready_fp8 = FP8CheckpointModel(ready_bf16, qcfg)
        # and FP8Source over vLLM's ModuleSource of the BF16 model: the quantization's own cost, without FSDPSource's
        ready = {"bf16 module": ModuleSource(ready_bf16), "fp8 module": ModuleSource(ready_fp8),
                 "fp8 over module": FP8Source(ModuleSource(ready_bf16))}
        wire_fp8 = sum(math.prod(m.shape) * m.dtype.itemsize for m in fp8.metadata)
        wire_bf16 = sum(math.prod(m.shape) * m.dtype.itemsize for m in bf16.metadata)
        facts.number("wire bytes FP8 / BF16", round(wire_fp8 / wire_bf16, 3))
        results: dict[str, list[float]] = {}
        for packed in (False, True):
            tag = "packed" if packed else "unpacked"
            engines = {name: trainer_engine(mode, client=clients[name], source=src, packed=packed, buffer_bytes=1 << 30)
                       for name, src in (("bf16", bf16), ("fp8", fp8), *ready.items())}
            client.call("reset")
            engines["fp8"].send_weights()
            rep = client.call("report")
            got = dict(rep["received"])
            bad = [n for n, d in want.items() if got.get(n) != d]
            facts.check(f"FP8 {tag}: received bytes == vLLM's quantizer on the trainer's weights", not bad and
                        not rep["missing"], f"{len(got)} tensors; differ {bad[:3]}; missing {rep['missing'][:3]}")
            client.call("track", False)  # digests cost seconds a pass: off while timing
            times = {name: [] for name in engines}
            for i in range(warmup + reps):
                for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                    sync(device)
                    t0 = time.perf_counter()
                    engines[name].send_weights()
                    sync(device)
                    if i >= warmup:
                        times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                results[f"{name} {tag}"] = ts
                facts.number(f"{name} {tag} best_ms", round(min(ts) * 1e3, 3))
                facts.number(f"{name} {tag} median_ms", round(statistics.median(ts) * 1e3, 3))
            for stat, f in (("best", min), ("median", statistics.median)):
                facts.number(f"ratio engines themselves (ModuleSource FP8 module / BF16 module) {tag} {stat}",
                             round(f(times["fp8 module"]) / f(times["bf16 module"]), 3))
                over = f(times["fp8"]) / f(times["fp8 module"])
                facts.number(f"ratio FP8Source pass / ModuleSource(FP8 module) pass {tag} {stat}", round(over, 3),
                             f" (goal <= {GOAL_OVER_ENGINES_PACKED}: {'met' if over <= GOAL_OVER_ENGINES_PACKED else 'NOT met'})"
                             if packed else "")
                facts.number(f"ratio FP8Source(ModuleSource) pass / ModuleSource(FP8 module) pass {tag} {stat}",
                             round(f(times["fp8 over module"]) / f(times["fp8 module"]), 3))
                r = f(times["fp8"]) / f(times["bf16"])
                own = f(times["fp8 module"]) / f(times["bf16 module"])
                goal = f" (goal <= {GOAL_FP8_VS_BF16_PACKED}: {'met' if r <= GOAL_FP8_VS_BF16_PACKED else 'NOT met'}" + (
                    f"; out of reach in this run: the engines themselves take {own:.3f})"
                    if own > GOAL_FP8_VS_BF16_PACKED else ")") if packed else ""
                facts.number(f"ratio FP8/BF16 pass {tag} {stat}", round(r, 3), goal)
                if stat == "median":
                    ratios.append((f"FP8/BF16 {tag} median", r, ratio_noise(times["fp8"], times["bf16"])))
            for eng in engines.values():
                eng.shutdown()
            client.call("track", True)
        for ratio, value, noise in ratios:
            bad = guard.check(ratio, value, noise)
            facts.check(f"{ratio} no worse than the last recorded run", bad is None, guard.lines[-1])
        guard.finish()
        log(f"[bench_fp8] done: {len(plans)} quantized tensors")
    except Exception as e:  # noqa: BLE001
        facts.error("bench_fp8", e)
    finally:
        for c in (client, client_bf16):
            if c is not None:
                c.close()
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
