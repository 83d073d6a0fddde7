"""GPU benchmark: one ``MegatronSource`` export pass (TP1) against a device-to-device copy of the same
bytes, measured in one run.

Model: a megatron-core ``GPTModel`` with Qwen3-1.7B's shapes (hidden 2048, 28 layers, 16 heads,
8 query groups, head_dim 128, ffn 6144, vocab 151936 padded to 152064, tied), bf16, local spec, on
one GPU. A pass is ``for name, t in source.iter_full()`` to exhaustion (each tensor dropped after it
is yielded, as a consumer that copies it away would) between two ``torch.cuda.synchronize()``.
The baseline copies a flat buffer of exactly the bytes the pass yielded. Best and median of
``--reps`` after ``--warmup``. Goal: export <= 2x the copy. For reference it also times vLLM's
``ModuleSource`` walking the same ``GPTModel`` (Megatron names and fused tensors, no layout work).

    python bench/bench_gpu_megatron.py [--reps 7] [--warmup 2] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

from _timing import copy_floor, timed  # noqa: E402
from facts import Facts, log  # noqa: E402

GOAL_VS_COPY = 2.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("bench_megatron", dry_run=args.dry_run)
    import torch

    from hf_side import bench_config, tiny_config
    from megatron_side import build_megatron, describe, init_parallel, megatron_version

    device = "cpu" if args.dry_run else "cuda:0"
    reps, warmup = (2, 1) if args.dry_run else (args.reps, args.warmup)
    if not args.dry_run:
        if not torch.cuda.is_available():
            facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
            return facts.finish(args.json)
        torch.cuda.set_device(0)
    try:
        from weightsync.sources import MegatronSource

        log(f"[bench_megatron] megatron-core {megatron_version()}")
        init_parallel(device)
        cfg = tiny_config("qwen3") if args.dry_run else bench_config()
        t0 = time.perf_counter()
        # Values do not change the cost of an export pass: skip initialization (and perturbation).
        model = build_megatron(cfg, dtype=torch.bfloat16, device=device, perturb=False, init=False)
        log(f"[bench_megatron] built in {time.perf_counter() - t0:.1f}s: {describe(model)}")
        src = MegatronSource(model, hf_config=cfg)
        declared = sum(m.dtype.itemsize * _numel(m.shape) for m in src.metadata)
        counted = {"tensors": 0, "bytes": 0}

        def export() -> None:
            n = b = 0
            for _name, t in src.iter_full():
                b += t.numel() * t.element_size()
                n += 1
                del t
            counted.update(tensors=n, bytes=b)

        times = timed(export, device=device, reps=reps, warmup=warmup)
        ntensors, nbytes = counted["tensors"], counted["bytes"]
        facts.check("export yields every declared parameter and byte",
                    ntensors == len(src.metadata) and nbytes == declared,
                    f"{ntensors}/{len(src.metadata)} tensors, {nbytes}/{declared} bytes")
        facts.number("tensors", ntensors)
        facts.number("GiB", round(nbytes / 2**30, 3))
        stats = getattr(src, "last_pass", None)
        if stats is not None:
            facts.number("last_pass", stats.as_dict() if hasattr(stats, "as_dict") else str(stats))
        # Reference: vLLM's ModuleSource over the same GPTModel -- a bare named_parameters() walk
        # (Megatron names, fused tensors, no HF layout), the per-tensor floor of any source.
        from vllm.distributed.weight_transfer.base import ModuleSource

        plain = ModuleSource(model)

        def walk() -> None:
            for _name, t in plain.iter_full():
                del t

        mt = timed(walk, device=device, reps=reps, warmup=warmup)
        facts.number("ModuleSource(GPTModel) tensors", len(plain.metadata))
        facts.number("ModuleSource(GPTModel) best_ms", round(min(mt) * 1e3, 3))
        facts.number("ratio export/ModuleSource(GPTModel) best", round(min(times) / min(mt), 3))
        ct = copy_floor(nbytes, device=device, reps=reps, warmup=warmup)
        best, med = min(times), statistics.median(times)
        cbest, cmed = min(ct), statistics.median(ct)
        facts.number("export best_ms", round(best * 1e3, 3))
        facts.number("export median_ms", round(med * 1e3, 3))
        facts.number("d2d copy best_ms", round(cbest * 1e3, 3))
        facts.number("d2d copy median_ms", round(cmed * 1e3, 3))
        for stat, r in (("best", best / cbest), ("median", med / cmed)):
            facts.number(f"ratio export/copy {stat}", round(r, 3),
                         f"(goal <= {GOAL_VS_COPY}: {'met' if r <= GOAL_VS_COPY else 'NOT met'})")
    except Exception as e:  # noqa: BLE001
        facts.error("bench_megatron", e)
    return facts.finish(args.json)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
