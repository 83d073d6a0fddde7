"""Overlap (issue 19): what posting the next gather ahead buys, measured against overlap off in the same run.

Workload: a Qwen3-shaped transformers model (random init, fp32), FSDP2 over ``--world`` gloo ranks on
CPU (each decoder layer + root), ``FSDPSource``. The default shape (hidden 1024, 16 layers, vocab
16000: 937 MB, embeddings and lm_head 7% of the bytes each) keeps the proportions of the models RL
teams sync (Qwen3-8B: 7.6% each): the first group's gather and the last tensor's send can never
overlap anything, so a toy whose embeddings are 20% of the bytes each (``--hidden 1024 --layers 8
--vocab 32000``) measures mostly those two. Variants, interleaved rep by rep (median reported),
every rank running the same one between barriers:

* ``gathers, overlap off`` / ``on``: one ``iter_full`` pass, tensors dropped -- the gathers alone;
* ``send, overlap off`` / ``on``: the same pass feeding a consumer that "sends" each tensor at a fixed
  bandwidth (``time.sleep(nbytes / bandwidth)`` on every rank), the bandwidth calibrated once so that
  the consumer's total equals the overlap-off gathers (``--send-ratio`` times them): gathers and
  consumer back to back cost ~2x the gathers; perfect overlap ~1x;
* ``save_safetensors`` (overlap on, writes on the writer thread) against ``gathers, overlap on``
  (the plain pass with the same gathers), and ``save_safetensors, sequential`` (overlap off,
  ``write_queue_bytes=0``: the code before issue 19) against ``gathers, overlap off``;
* ``disk floor``: rank 0 alone writes the checkpoint's byte count to one file (``pwrite``, 64 MB at a
  time) and fsyncs it -- no gather, no tensor: no ``save_safetensors`` can beat
  ``max(gathers, disk floor)`` here, which the last ratio compares against.

Memory, rank 0: the source's tracked peak extra bytes (``PassStats.peak_extra_bytes``) and of it the
bytes posted ahead (``ahead_peak_bytes``), against the stated bound (two gather groups -- the largest
group held by the overlap-off pass, twice -- plus the send block packed ahead on CPU); the writer's peak queued bytes against
``write_queue_bytes``; and the RSS rise over each variant (``PeakHWM``: the kernel's high-water mark, no sampling thread).

    python bench/bench_overlap.py
    python bench/bench_overlap.py --hidden 512 --layers 36 --dir /dev/shm/ws-bench   # Qwen3-8B's depth; tmpfs
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from _history import Guard, ratio_noise  # noqa: E402


def _model(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=args.hidden // 16, vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _drain(source) -> None:
    for _name, t in source.iter_full():
        del t


def _send(source, bandwidth: float, first: list | None = None) -> None:
    """A consumer that spends ``nbytes / bandwidth`` seconds on each tensor (a simulated send).
    ``first`` gets the seconds until the first tensor arrived (the first group's gather)."""
    t0, seen, slept = time.perf_counter(), False, 0.0
    for _name, t in source.iter_full():
        if not seen:
            seen = True
            if first is not None:
                first.append(time.perf_counter() - t0)
        s0 = time.perf_counter()
        time.sleep(t.numel() * t.element_size() / bandwidth)
        slept += time.perf_counter() - s0
        del t
    if first is not None:
        first.append(-slept)  # (negative: the consumer's own time, as slept, see _first_and_consumer)


def _first_and_consumer(first: list) -> tuple[float, float]:
    """Median seconds to the first tensor and median seconds the consumer itself took (its sleeps
    as measured: they overshoot the intended ``nbytes / bandwidth`` by a few percent)."""
    return (statistics.median([v for v in first if v >= 0]), statistics.median([-v for v in first if v < 0]))


def overlap_bound(first_s: float, consumer_s: float, back_to_back_s: float) -> float:
    """The best overlap ratio this shape allows: nothing overlaps the first group's gather (no tensor
    to send yet), then at best the consumer runs without a pause: (first + consumer) / back to back."""
    return (first_s + consumer_s) / back_to_back_s


class PeakHWM:
    """Peak RSS of this process while active, above its size at entry (``grew``), read from the
    kernel's high-water mark (``/proc/self/status`` VmHWM after resetting it through
    ``/proc/self/clear_refs``): no sampling thread, so nothing competes for the GIL or a core
    with the pass being timed (``bench_checkpoint.PeakRSS`` samples every 2 ms from a thread).
    Falls back to ``PeakRSS`` where clear_refs cannot be written."""

    def __enter__(self) -> "PeakHWM":
        self._fallback = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = self._rss()
        except OSError:
            from bench_checkpoint import PeakRSS as _Sampled

            self._fallback = _Sampled().__enter__()
        return self

    @staticmethod
    def _rss(field: str = "VmRSS:") -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise OSError(field)

    def __exit__(self, *exc) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
            self.grew = self._fallback.grew
        else:
            self.grew = self._rss("VmHWM:") - self.start


def _disk_floor(path: str, nbytes: int) -> None:
    """Write ``nbytes`` to one new file with ``pwrite`` (64 MB at a time) and fsync it: what the
    checkpoint's bytes cost this disk alone, with no gather at all."""
    buf = memoryview(bytearray(64 << 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, buf[: min(len(buf), nbytes - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)


def _worker(rank, world, args):
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import FSDPSource

    model = _model(args)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"group_bytes": int(args.group_mb * 2**20)} if args.group_mb else {}
    pre = {"prefetch_bytes": int(args.prefetch_mb * 2**20)} if args.prefetch_mb else {}
    on = FSDPSource(model, overlap=True, **kw, **pre)
    off = FSDPSource(model, overlap=False, **kw)
    for s in (on, off):
        _drain(s)  # warm-up (the first pass also agrees on metadata)
    total = sum(math.prod(m.shape) * m.dtype.itemsize for m in on.metadata)
    # Calibrate the simulated send: the consumer's total = send_ratio x the overlap-off gathers.
    dist.barrier()
    t0 = time.perf_counter()
    _drain(off)
    g = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(g, op=dist.ReduceOp.MAX)
    bandwidth = total / (args.send_ratio * float(g))
    root = args.dir
    keys = ("gathers_off", "gathers_on", "send_off", "send_on", "save_on", "save_sync", "disk")
    if args.send_only:
        keys = keys[:4]
    times: dict[str, list[float]] = {k: [] for k in keys}
    first: list[float] = []  # seconds to the first tensor of the overlap-on send pass
    rss: dict[str, list[int]] = {k: [] for k in keys}
    stats: dict[str, dict] = {}
    reports: dict[str, dict] = {}
    runs = {
        "gathers_off": lambda rep: _drain(off),
        "gathers_on": lambda rep: _drain(on),
        "send_off": lambda rep: _send(off, bandwidth),
        "send_on": lambda rep: _send(on, bandwidth, first),
        "save_on": lambda rep: save_safetensors(on, os.path.join(root, f"on-{rep}"), max_shard_bytes=args.shard),
        "save_sync": lambda rep: save_safetensors(
            off, os.path.join(root, f"sync-{rep}"), max_shard_bytes=args.shard, write_queue_bytes=0
        ),
        "disk": lambda rep: _disk_floor(os.path.join(root, "floor.bin"), total) if rank == 0 else None,
    }
    for rep in range(args.reps):
        for k in keys:
            dist.barrier()
            with PeakHWM() as m:
                t0 = time.perf_counter()
                out = runs[k](rep)
                times[k].append(time.perf_counter() - t0)
            rss[k].append(m.grew)
            src = on if k.endswith("_on") else off
            stats[k] = src.last_pass.as_dict()
            if out is not None:
                reports[k] = out.metrics()
        dist.barrier()
        if rank == 0:
            for sub in ("on", "sync"):
                shutil.rmtree(os.path.join(root, f"{sub}-{rep}"), ignore_errors=True)
    dist.barrier()
    if rank != 0:
        return None
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "all": times,
        "first": _first_and_consumer(first)[0],
        "consumer": _first_and_consumer(first)[1],
        "rss": {k: statistics.median(v) for k, v in rss.items()},
        "stats": stats,
        "reports": reports,
        "total": total,
        "bandwidth": bandwidth,
        "tensors": len(on.metadata),
        "steps": len(on._plan(on._resolve())),
        "embed_share": max(math.prod(m.shape) * m.dtype.itemsize for m in on.metadata) / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--send-ratio", type=float, default=1.0, help="simulated send time / overlap-off gathers")
    ap.add_argument("--max-shard-mb", type=float, default=200.0)
    ap.add_argument("--dir", default=None, help="where save_safetensors writes (default: a temp folder in /tmp)")
    ap.add_argument("--group-mb", type=float, default=0, help="FSDPSource group_bytes (MiB; 0: one group per unit)")
    ap.add_argument("--prefetch-mb", type=float, default=0, help="FSDPSource prefetch_bytes with overlap (MiB; 0: one group ahead)")
    ap.add_argument("--send-only", action="store_true", help="only the gathers and send variants (no checkpoint writes)")
    ap.add_argument("--record", action="store_true", help="append this run's ratios to bench/results/history.jsonl")
    args = ap.parse_args()
    args.shard = int(args.max_shard_mb * 10**6)
    from bench_checkpoint import writing_world

    r = writing_world(_worker, args, prefix="bench-overlap-")
    s, st = r["seconds"], r["stats"]
    mb = r["total"] / 1e6
    print(
        f"FSDPSource over a Qwen3 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab} (fp32): "
        f"{r['tensors']} tensors, {mb:.1f} MB (largest tensor {100 * r['embed_share']:.1f}%), {r['steps']} plan "
        f"steps; FSDP2 over {args.world} gloo ranks "
        f"(CPU); median of {args.reps} (rank 0); simulated send at {r['bandwidth'] / 1e6:.0f} MB/s "
        f"(= {args.send_ratio:g}x the overlap-off gathers)"
    )
    print(f"{'variant':<48} {'s':>8}   reps")
    labels = {
        "gathers_off": "gathers, overlap off",
        "gathers_on": "gathers, overlap on",
        "send_off": "gathers + simulated send, overlap off",
        "send_on": "gathers + simulated send, overlap on",
        "save_sync": "save_safetensors, sequential (overlap off, q=0)",
        "save_on": "save_safetensors (overlap on, writer thread)",
        "disk": "disk floor: pwrite + fsync of the bytes, rank 0",
    }
    for k, label in labels.items():
        if k not in s:
            continue
        print(f"{label:<48} {s[k]:>8.3f}   " + " ".join(f"{v:.3f}" for v in r["all"][k]))
    b = overlap_bound(r["first"], r["consumer"], s["send_off"])
    send_ratio = s["send_on"] / s["send_off"]
    print(f"ratio send overlap on / off: x{send_ratio:.2f} (goal: within 0.05 of the bound; back to back would "
          f"be x1.00); bound for this shape x{b:.2f} = (first group's gather {r['first']:.3f} s + consumer "
          f"{r['consumer']:.3f} s) / back to back {s['send_off']:.3f} s: {'met' if send_ratio <= b + 0.05 else 'NOT met'}")
    per_rep = [a / b_ for a, b_ in zip(r["all"]["send_on"], r["all"]["send_off"])]
    guard = Guard("bench_overlap", f"hidden{args.hidden} layers{args.layers} vocab{args.vocab} world{args.world} "
                  f"send{args.send_ratio:g}", record=args.record)
    guard.check("send overlap on/off", send_ratio, ratio_noise(per_rep))
    if args.send_only:
        guard.finish()
        return
    print(f"ratio save_safetensors / plain pass, overlap on: x{s['save_on'] / s['gathers_on']:.2f} (target <= 1.25); "
          f"sequential: x{s['save_sync'] / s['gathers_off']:.2f}; gathers on / off: x{s['gathers_on'] / s['gathers_off']:.2f}")
    floor = max(s["gathers_on"], s["disk"])
    print(f"ratio save_safetensors / max(plain pass, disk floor): x{s['save_on'] / floor:.2f} "
          f"(sequential: x{s['save_sync'] / max(s['gathers_off'], s['disk']):.2f})")
    # two groups, plus (CPU) the next group's send block packed ahead: 1/(n+1) of a group's footprint
    off_peak = st["gathers_off"]["peak_extra_bytes"]
    bound = 2 * off_peak + off_peak // (args.world + 1)
    print(
        f"source memory (rank 0, tracked): overlap off peak {st['gathers_off']['peak_extra_bytes'] / 1e6:.1f} MB "
        f"(one group + the tensor being unpacked); overlap on peak {st['gathers_on']['peak_extra_bytes'] / 1e6:.1f} MB, "
        f"of it posted ahead {st['gathers_on']['ahead_peak_bytes'] / 1e6:.1f} MB; bound (two groups + a send block) "
        f"{bound / 1e6:.1f} MB: {'within' if st['gathers_on']['peak_extra_bytes'] <= bound else 'EXCEEDED'}"
    )
    rep = r["reports"]["save_on"]
    qb = max(rep["write_queue_bytes"], 0)
    print(
        f"writer (rank 0): peak queued {rep['peak_queued_bytes'] / 1e6:.1f} MB vs write_queue_bytes "
        f"{qb / 1e6:.1f} MB (bound max(that, largest tensor)); host copies {rep['peak_extra_bytes'] / 1e3:.1f} KB "
        f"(headers); sequential writer queued {r['reports']['save_sync']['peak_queued_bytes']}"
    )
    print("RSS rise (rank 0, MB, median): " + "; ".join(f"{k} {v / 1e6:.1f}" for k, v in r["rss"].items()))
    guard.check("save_safetensors/plain pass", s["save_on"] / s["gathers_on"],
                ratio_noise(r["all"]["save_on"], r["all"]["gathers_on"]))
    guard.finish()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
