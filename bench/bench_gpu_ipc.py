"""GPU benchmark: an IPC refit of a Qwen3-1.7B-shaped model through vLLM 0.33's real CUDA IPC engines,
``FSDPSource`` against vLLM's ``ModuleSource``, packed and unpacked, all measured in one run.

Trainer: a transformers Qwen3 model with Qwen3-1.7B's shapes (random weights, bf16, 3.4 GB) on one
GPU, plain and under FSDP2 (world size 1, ``fully_shard`` per decoder layer and at the root).
Receiver: a spawned process with vLLM's ``IPCWeightTransferEngine`` loading into a transformers
model of the same config (``tests/gpu/receiver.py``). Sources timed, interleaved rep by rep:

* ``ModuleSource(plain)``  -- vLLM's source on the unsharded model (the reference cost);
* ``ModuleSource(fsdp2)``  -- vLLM's source on the FSDP2 model (one ``full_tensor()`` per parameter);
* ``FSDPSource(fsdp2)``    -- weightsync's source on the same FSDP2 model.

Each timing is one ``send_weights()`` (start, all update chunks, finish; the receiver copies every
tensor into its model and synchronizes) between two ``torch.cuda.synchronize()``; best and median
of ``--reps`` after ``--warmup``. The device-to-device copy of the same bytes is the floor.
Goal: FSDPSource <= 1.0x ModuleSource(plain), best and median, packed and unpacked (an FSDP2 model
as cheap to refit as the unsharded one; measured 0.97-1.05 after d5665fb). After timing, every
source is checked once: the receiver's per-parameter fp64 sums equal the trainer's.

Every ratio is compared with the last recorded run (``bench/_history.py``: REGRESSION when worse by
more than this run's noise, at least 5%); ``--record`` appends this run's ratios to the history, as
does every non-dry run under ``.ci/gpu`` (``OUT`` set: the lines also land in ``$OUT/bench-history.jsonl``).

    python bench/bench_gpu_ipc.py [--reps 7] [--warmup 2] [--dry-run] [--json out.json] [--record]
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
SHAPE = "qwen3-1.7b bf16 1gpu"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    facts = Facts("bench_ipc", dry_run=args.dry_run)
    import torch

    from hf_side import bench_config, build_hf, fsdp2_copy, tiny_config
    from receiver import start_receiver, sums_differ, trainer_engine

    setup = device_and_reps(args, facts)
    if setup is None:
        return facts.finish(args.json)
    device, reps, warmup = setup
    mode = "loopback" if args.dry_run else "ipc"
    client = None
    try:
        import datetime

        import torch.distributed as dist
        from vllm.distributed.weight_transfer import ModuleSource

        from weightsync.sources import FSDPSource

        dist.init_process_group("nccl" if not args.dry_run else "gloo", store=dist.HashStore(),  # 1 rank
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
        cfg = tiny_config("qwen3") if args.dry_run else bench_config()
        client = start_receiver(mode, device, timeout_s=300)
        client.call("build", (cfg, torch.bfloat16, 7, False))
        t0 = time.perf_counter()
        plain = build_hf(cfg, device=device, dtype=torch.bfloat16, seed=3)
        sharded = fsdp2_copy(plain, device)
        nbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
        nparams = len(list(plain.parameters()))
        log(f"[bench_ipc] models built in {time.perf_counter() - t0:.1f}s: {nparams} params, "
            f"{nbytes / 2**30:.2f} GiB bf16 each")
        facts.number("params", nparams)
        facts.number("GiB", round(nbytes / 2**30, 3))
        sources = {
            "ModuleSource(plain)": ModuleSource(plain),
            "ModuleSource(fsdp2)": ModuleSource(sharded),
            "FSDPSource(fsdp2)": FSDPSource(sharded),
        }
        ref_sums = {n: float(p.double().sum().item()) for n, p in plain.named_parameters()}
        results: dict[str, dict[str, float]] = {}
        guard = bench_guard("bench_ipc", SHAPE, args)
        ratios: list[tuple[str, float, float]] = []
        for packed in (False, True):
            mode_tag = "packed" if packed else "unpacked"
            engines = {
                name: trainer_engine(mode, client=client, source=src, packed=packed,
                                     buffer_bytes=1 << 30)
                for name, src in sources.items()
            }
            times = interleaved({name: eng.send_weights for name, eng in engines.items()},
                                device=device, reps=reps, warmup=warmup)
            for name, eng in engines.items():
                bad = sums_differ(client, eng, ref_sums)
                facts.check(f"{name} {mode_tag}: receiver holds the trainer's weights (fp64 sums)",
                            not bad, f"{len(bad)} differ: {bad[:3]}" if bad else f"{len(ref_sums)} params")
                eng.shutdown()
            for name, ts in times.items():
                best, med = min(ts), statistics.median(ts)
                results[f"{name} {mode_tag}"] = {"best_ms": best * 1e3, "median_ms": med * 1e3}
                facts.number(f"{name} {mode_tag} best_ms", round(best * 1e3, 3))
                facts.number(f"{name} {mode_tag} median_ms", round(med * 1e3, 3))
            for base in ("ModuleSource(plain)", "ModuleSource(fsdp2)"):
                for stat in ("best", "median"):
                    r = statistics.median(times["FSDPSource(fsdp2)"]) / statistics.median(times[base]) \
                        if stat == "median" else min(times["FSDPSource(fsdp2)"]) / min(times[base])
                    facts.number(f"ratio FSDPSource/{base} {mode_tag} {stat}", round(r, 3),
                                 f"(goal <= {GOAL_VS_MODULE}: {'met' if r <= GOAL_VS_MODULE else 'NOT met'})")
                    ratios.append((f"FSDPSource/{base} {mode_tag} {stat}", r,
                                   ratio_noise(times["FSDPSource(fsdp2)"], times[base])))
        stats = getattr(sources["FSDPSource(fsdp2)"], "last_pass", None)
        if stats is not None and hasattr(stats, "as_dict"):
            facts.number("FSDPSource last_pass", stats.as_dict())
        ct = copy_floor(nbytes, device=device, reps=reps)
        facts.number("d2d copy of the same bytes best_ms", round(min(ct) * 1e3, 3))
        facts.number("d2d copy of the same bytes median_ms", round(statistics.median(ct) * 1e3, 3))
        for key, r in results.items():
            facts.number(f"{key} best / d2d copy", round(r["best_ms"] / (min(ct) * 1e3), 2))
        # Regression guard: our ratios (FSDPSource over vLLM's own source, same run) against the last run.
        for ratio, value, noise in ratios:
            bad = guard.check(ratio, value, noise)
            facts.check(f"{ratio} no worse than the last recorded run", bad is None, guard.lines[-1])
        guard.finish()
    except Exception as e:  # noqa: BLE001
        facts.error("bench_ipc", e)
    finally:
        if client is not None:
            client.close()
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
