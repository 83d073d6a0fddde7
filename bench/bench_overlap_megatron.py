"""Overlap in ``MegatronSource`` (issue 19): rank 0 posts the next unit's receives before handing on
the current one, measured against ``overlap=False`` in the same run.

Workload: a Llama-shaped megatron-core GPTModel (local spec, fp32) on 2 gloo ranks (CPU), TP2 or PP2
(``--tp`` / ``--pp``), exported by ``MegatronSource`` (mode ``full``: the peers send their pieces to
rank 0 point-to-point, rank 0 yields every HF tensor, the peers yield nothing). Variants, interleaved
rep by rep (median reported):

* ``export, overlap off`` / ``on``: one ``iter_full`` pass, tensors dropped;
* ``export + simulated send, overlap off`` / ``on``: rank 0's consumer sleeps ``nbytes / bandwidth``
  per tensor, the bandwidth calibrated once so that the send alone equals the overlap-off export
  (``--send-ratio`` times it): back to back ~2x the export; perfect overlap ~1x.

What overlap can hide here is the peers' transfer of the next unit (TP: the other half of every
sharded weight; PP: the second stage's layers) while rank 0's consumer sends, and (on CPU) rank 0's
own concatenation and QKV/GLU splits of that unit, which run on a helper thread
(``sources/megatron/ahead.py``). The bound printed for the shape: nothing overlaps the first unit
(no tensor to send yet), then at best the consumer never pauses: (time to the first tensor + the
consumer's own measured time) / back to back. Two shapes: the default and ``--hidden 2048 --layers 4
--vocab 4000`` (fewer, wider layers, small vocabulary). The ratio is compared with the last recorded
run of the same shape (``bench/_history.py``; ``--record`` appends it). Memory on rank 0: the
tracked peak extra bytes (``PassStats.peak_extra_bytes``) and the part posted ahead
(``ahead_peak_bytes``).

    python bench/bench_overlap_megatron.py              # TP2
    python bench/bench_overlap_megatron.py --hidden 2048 --layers 4 --vocab 4000
    python bench/bench_overlap_megatron.py --tp 1 --pp 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from _history import Guard, ratio_noise  # noqa: E402


def _worker(rank, world, args):
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import megatron_worlds as mw
    from bench_overlap import _drain, _first_and_consumer, _send  # the same consumers as FSDPSource's bench

    from weightsync.sources import MegatronSource
    from weightsync.sources.megatron.ahead import cores_per_local_rank

    cfg = mw.hf_config(
        "llama", layers=args.layers, vocab=args.vocab, hidden_size=args.hidden,
        intermediate_size=3 * args.hidden, num_attention_heads=16, num_key_value_heads=8,
    )
    mw.init_parallel(args.tp, args.pp)
    model = mw.megatron_model(cfg)
    on = MegatronSource(model, hf_config=cfg, overlap=True)
    off = MegatronSource(model, hf_config=cfg, overlap=False)
    for s in (on, off):
        _drain(s)  # warm-up (the first pass also agrees on metadata)
    total = sum(math.prod(m.shape) * m.dtype.itemsize for m in on.metadata)
    dist.barrier()
    t0 = time.perf_counter()
    _drain(off)
    g = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(g, op=dist.ReduceOp.MAX)
    bandwidth = total / (args.send_ratio * float(g))
    keys = ("export_off", "export_on", "send_off", "send_on")
    runs = {
        "export_off": lambda: _drain(off),
        "export_on": lambda: _drain(on),
        "send_off": lambda: _send(off, bandwidth),
        "send_on": lambda: _send(on, bandwidth),
    }
    times: dict[str, list[float]] = {k: [] for k in keys}
    first: list[float] = []
    runs["send_on"] = lambda: _send(on, bandwidth, first)
    stats: dict[str, dict] = {}
    for _rep in range(args.reps):
        for k in keys:
            dist.barrier()
            t0 = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
            stats[k] = (on if k.endswith("_on") else off).last_pass.as_dict()
    dist.barrier()
    if rank != 0:
        return None
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "all": times,
        "first": _first_and_consumer(first)[0],
        "consumer": _first_and_consumer(first)[1],
        "stats": stats,
        "total": total,
        "tensors": len(on.metadata),
        "bandwidth": bandwidth,
        "ahead_bytes": on.ahead_bytes,
        "cores_per_rank": cores_per_local_rank(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--send-ratio", type=float, default=1.0, help="simulated send time / overlap-off export")
    ap.add_argument("--record", action="store_true", help="append this run's ratios to bench/results/history.jsonl")
    args = ap.parse_args()
    from worlds import run_world

    world = args.tp * args.pp
    r = run_world(_worker, world, timeout=3600, pg_timeout_s=900, args=args)[0]
    s, st = r["seconds"], r["stats"]
    print(
        f"MegatronSource over a Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab} (fp32): "
        f"{r['tensors']} tensors, {r['total'] / 1e6:.1f} MB; TP{args.tp} x PP{args.pp} on {world} gloo ranks "
        f"(CPU); median of {args.reps} (rank 0); simulated send at {r['bandwidth'] / 1e6:.0f} MB/s "
        f"(= {args.send_ratio:g}x the overlap-off export)"
    )
    labels = {
        "export_off": "export, overlap off",
        "export_on": "export, overlap on",
        "send_off": "export + simulated send, overlap off",
        "send_on": "export + simulated send, overlap on",
    }
    print(f"{'variant':<40} {'s':>8}   reps")
    for k, label in labels.items():
        print(f"{label:<40} {s[k]:>8.3f}   " + " ".join(f"{v:.3f}" for v in r["all"][k]))
    from bench_overlap import overlap_bound

    b = overlap_bound(r["first"], r["consumer"], s["send_off"])
    send_ratio = s["send_on"] / s["send_off"]
    print(f"ratio send overlap on / off: x{send_ratio:.2f} (goal <= 0.75 and within 0.05 of the bound; back to "
          f"back x1.00); bound for this shape x{b:.2f} = (first unit {r['first']:.3f} s + consumer "
          f"{r['consumer']:.3f} s) / back to back {s['send_off']:.3f} s: "
          f"{'met' if send_ratio <= max(0.75, b + 0.05) and send_ratio <= b + 0.05 else 'NOT met'}; "
          f"export on / off: x{s['export_on'] / s['export_off']:.2f}")
    print(
        f"rank 0 memory (tracked): overlap off peak {st['send_off']['peak_extra_bytes'] / 1e6:.1f} MB; on "
        f"{st['send_on']['peak_extra_bytes'] / 1e6:.1f} MB, of it posted ahead "
        f"{st['send_on']['ahead_peak_bytes'] / 1e6:.1f} MB received (bound: less than ahead_bytes "
        f"{r['ahead_bytes'] / 1e6:.1f} MB + one unit ahead, sources/megatron/ahead.py; the default for "
        f"{r['cores_per_rank']:g} cores per rank)"
    )
    guard = Guard("bench_overlap_megatron", f"TP{args.tp}" + (f" PP{args.pp}" if args.pp > 1 else "")
                  + f" hidden{args.hidden} layers{args.layers} vocab{args.vocab} send{args.send_ratio:g}", record=args.record)
    guard.check("export+send overlap on/off", send_ratio,
                ratio_noise([a / b_ for a, b_ in zip(r["all"]["send_on"], r["all"]["send_off"])]))
    guard.check("export overlap on/off", s["export_on"] / s["export_off"],
                ratio_noise([a / b_ for a, b_ in zip(r["all"]["export_on"], r["all"]["export_off"])]))
    guard.finish()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
