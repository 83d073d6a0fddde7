"""GPU benchmark: one ``MegatronSource`` export pass (TP1) against a device-to-device copy of the same
bytes, measured in one run.

Model: a megatron-core ``GPTModel`` with Qwen3-1.7B's shapes (hidden 2048, 28 layers, 16 heads,
8 query groups, head_dim 128, ffn 6144, vocab 151936 padded to 152064, tied), bf16, local spec, on
one GPU. A pass is ``for name, t in source.iter_full()`` to exhaustion (each tensor dropped after it
is yielded, as a consumer that copies it away would) between two ``torch.cuda.synchronize()``.
The baseline copies a flat buffer of exactly the bytes the pass yielded. Best and median of
``--reps`` after ``--warmup``. Goal: export <= 1.0x the copy, best and median. For reference it
also times vLLM's ``ModuleSource`` walking the same ``GPTModel`` (Megatron names and fused tensors,
no layout work): export/ModuleSource is host work over host work, so it stays put when the host is
faster or slower (export/copy does not: the pass is host-bound, the copy device-bound -- the
0.85x of a40f0f8 and the 1.64x of 25a3dd0 are the same export/ModuleSource, 2.30 and 2.31).

Every ratio is compared with the last recorded run (``bench/_history.py``: REGRESSION when worse by
more than this run's noise, at least 5%); ``--record`` appends this run's ratios to the history, as
does every non-dry run under ``.ci/gpu`` (``OUT`` set: the lines also land in ``$OUT/bench-history.jsonl``).
``--slowdown`` adds one copy of every yielded tensor to the timed pass (a deliberate regression,
to see the guard fire; run it with ``WS_BENCH_HISTORY`` pointing at a scratch copy). ``--ops`` also runs one export under a dispatch mode that counts aten ops and bytes written
(``bench/_opcount.py``), the host-speed-free measure of the pass's work.

    python bench/bench_gpu_megatron.py [--reps 7] [--warmup 2] [--dry-run] [--json out.json] [--record] [--ops]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

from _gpu_bench import device_and_reps, guard as bench_guard, parser  # noqa: E402
from _history import ratio_noise  # noqa: E402
from _timing import copy_floor, timed  # noqa: E402
from facts import Facts, log  # noqa: E402

GOAL_VS_COPY = 1.0
SHAPE = "qwen3-1.7b tp1 bf16"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, dry_help="CPU, tiny model")
    ap.add_argument("--ops", action="store_true", help="count aten ops and bytes written by one export")
    ap.add_argument("--slowdown", action="store_true",
                    help="deliberate regression: one extra copy of every yielded tensor (the guard must say REGRESSION)")
    args = ap.parse_args(argv)
    facts = Facts("bench_megatron", dry_run=args.dry_run)
    import torch

    from hf_side import bench_config, tiny_config
    from megatron_side import build_megatron, describe, init_parallel, megatron_version

    setup = device_and_reps(args, facts)
    if setup is None:
        return facts.finish(args.json)
    device, reps, warmup = setup
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
                if args.slowdown:
                    t = t.clone()
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
        facts.number("ratio export/ModuleSource(GPTModel) median", round(statistics.median(times) / statistics.median(mt), 3))
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
        if args.ops:
            from _opcount import count_ops

            ops = count_ops(lambda: sum(1 for _ in src.iter_full()))
            facts.number("one export: aten ops", ops.ops)
            facts.number("one export: bytes written", ops.bytes_written)
            facts.number("one export: ops by name", dict(ops.by_name.most_common()))
        # Regression guard: every ratio against the last recorded run of this shape.
        guard = bench_guard("bench_megatron", SHAPE, args, record=not args.slowdown)
        for ratio, value, noise in (
            ("export/copy best", best / cbest, ratio_noise(times, ct)),
            ("export/copy median", med / cmed, ratio_noise(times, ct)),
            ("export/ModuleSource(GPTModel) best", min(times) / min(mt), ratio_noise(times, mt)),
            ("export/ModuleSource(GPTModel) median", med / statistics.median(mt), ratio_noise(times, mt)),
        ):
            bad = guard.check(ratio, value, noise)
            facts.check(f"{ratio} no worse than the last recorded run", bad is None, guard.lines[-1])
        guard.finish()
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
