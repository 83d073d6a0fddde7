"""What writing a checkpoint with ``save_safetensors`` costs, against ``save_pretrained`` in the same run.

Workload: a Qwen3-shaped transformers model (random init, fp32), FSDP2 over ``--world`` gloo ranks on
CPU (each decoder layer + root), ``FSDPSource``; the folder is split at ``--max-shard-mb``.

Measured per rep, interleaved so drift on a shared machine hits every variant alike (median reported):

* ``pass``: one ``iter_full`` pass of the source, tensors dropped -- the gathers alone;
* ``save_safetensors``: the same pass, streamed into a staged folder on rank 0 (headers, space
  reserved, each tensor written at its offset, fsync, rename), every rank agreeing;
* ``save_pretrained``: transformers writing an unsharded copy of the same model on rank 0 (no
  gathers at all: the floor a single-process writer gets), and the same followed by an fsync of
  its files (``save_safetensors`` fsyncs, ``save_pretrained`` does not).

Throughput is checkpoint bytes / seconds. Memory of the writer (rank 0), two ways:

* tracked: ``SaveReport.peak_extra_bytes`` -- bytes the writer holds beyond what the source yields
  (headers + a host copy of one tensor, none for a contiguous CPU tensor);
* RSS: a thread samples rank 0's resident set every 2 ms (psutil); each variant's figure is how far
  RSS rose above its value at the variant's start (median over reps); what writing adds is
  ``save_safetensors``'s rise minus a plain ``pass``'s (same gathers). Page cache is not in RSS; the
  ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors leave RSS at once instead of
  staying in glibc's heap (which otherwise makes rises of a few MB come and go at random). Both are
  printed against the largest shard file.

The first rep also checks that the two folders are byte-identical.

    python bench/bench_checkpoint.py
    python bench/bench_checkpoint.py --hidden 2048 --layers 8 --max-shard-mb 500 --reps 3
    python bench/bench_checkpoint.py --device cuda --world 1 --hidden 2048 --layers 16   # GPU host
"""

from __future__ import annotations

import argparse
import copy
import filecmp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from worlds import run_world  # noqa: E402


class PeakRSS:
    """Peak resident set size of this process while active, above its size at entry (``grew``;
    psutil, sampled every 2 ms)."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.grew = self.peak - self.start


def _model(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=args.hidden // 16, vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _fsync_folder(path: str) -> None:
    for f in os.listdir(path):
        fd = os.open(os.path.join(path, f), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _drain(source) -> None:
    """One pass, each tensor dropped before the next is made (as the writer does): a loop variable
    left holding the last tensor would shift the next measurement's RSS baseline by its size."""
    for _name, t in source.iter_full():
        del t


def _worker(rank, world, args):
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import FSDPSource

    limit = int(args.max_shard_mb * 10**6)
    model = _model(args)
    if args.device == "cuda":  # one rank, the module on the GPU: every tensor takes the host-copy path
        model = model.to("cuda")
        ref = model
    else:
        ref = copy.deepcopy(model) if rank == 0 else None
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    src = FSDPSource(model)
    _drain(src)  # warm-up (the first pass also agrees on metadata)
    root = args.dir
    times: dict[str, list[float]] = {k: [] for k in ("pass", "ours", "hf", "hf_fsync")}
    rss: dict[str, list[int]] = {k: [] for k in ("pass", "ours", "hf")}
    report = None
    identical = None
    for rep in range(args.reps):
        ours, hf = os.path.join(root, f"ours-{rep}"), os.path.join(root, f"hf-{rep}")
        dist.barrier()
        with PeakRSS() as m:
            t0 = time.perf_counter()
            _drain(src)
            times["pass"].append(time.perf_counter() - t0)
        rss["pass"].append(m.grew)
        dist.barrier()
        with PeakRSS() as m:
            t0 = time.perf_counter()
            report = save_safetensors(src, ours, max_shard_bytes=limit)
            times["ours"].append(time.perf_counter() - t0)
        rss["ours"].append(m.grew)
        dist.barrier()
        if rank == 0:
            with PeakRSS() as m:
                t0 = time.perf_counter()
                ref.save_pretrained(hf, max_shard_size=limit)
                times["hf"].append(time.perf_counter() - t0)
                _fsync_folder(hf)
                times["hf_fsync"].append(time.perf_counter() - t0)
            rss["hf"].append(m.grew)
            if rep == 0:
                identical = all(
                    filecmp.cmp(os.path.join(ours, f), os.path.join(hf, f), shallow=False) for f in os.listdir(hf)
                ) and sorted(os.listdir(hf)) == sorted(os.listdir(ours))
            shutil.rmtree(ours)
            shutil.rmtree(hf)
    dist.barrier()
    if rank != 0:
        return None
    return {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "rss": {k: statistics.median(v) for k, v in rss.items()},
        "rss_reps": rss,
        "report": report.metrics(),
        "identical": identical,
        "tensors": len(src.metadata),
    }


def writing_world(worker, args, *, prefix: str) -> dict:
    """Run ``worker`` on ``args.world`` gloo ranks writing under ``args.dir`` (default: a temporary
    folder, removed afterwards) and return rank 0's result. Allocations >= 128 KiB are mmap-ed and
    unmapped on free (glibc's dynamic threshold off), so RSS follows live tensor memory instead of
    what the allocator keeps: the ranks (forked from a server started here) inherit this."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix=prefix)
    try:
        return run_world(worker, args.world, timeout=3600, pg_timeout_s=900, args=args)[0]
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-shard-mb", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: one rank, the unsharded model on the GPU (FSDPSource yields GPU tensors, the writer "
        "copies one at a time to host; save_pretrained writes the same GPU model)",
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    args = ap.parse_args()
    if args.device == "cuda" and args.world != 1:
        ap.error("--device cuda runs one rank (--world 1)")
    # Allocations >= 128 KiB are mmap-ed and unmapped on free (glibc's dynamic threshold off), so RSS
    # follows live tensor memory instead of what the allocator keeps: the ranks inherit this.
    r = writing_world(_worker, args, prefix="bench-checkpoint-")
    rep, s = r["report"], r["seconds"]
    mb = rep["total_size"] / 1e6
    print(
        f"checkpoint of a Qwen3 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab} (fp32): "
        f"{r['tensors']} tensors, {mb:.1f} MB in {rep['num_shards']} shard(s) <= {args.max_shard_mb:g} MB "
        f"(largest {rep['largest_shard_bytes'] / 1e6:.1f} MB); "
        f"{'one rank, model on cuda' if args.device == 'cuda' else f'FSDP2 over {args.world} gloo ranks (CPU)'}; "
        f"median of {args.reps}; folders byte-identical: {r['identical']}"
    )
    print(f"{'variant':<44} {'s':>8} {'MB/s':>8} {'vs save_pretrained':>19}")
    rows = (
        ("iter_full pass only (gathers, no write)", s["pass"]),
        ("save_safetensors (FSDPSource, fsync)", s["ours"]),
        ("save_pretrained (unsharded copy, rank 0)", s["hf"]),
        ("save_pretrained + fsync of its files", s["hf_fsync"]),
    )
    for label, sec in rows:
        print(f"{label:<44} {sec:>8.3f} {mb / sec:>8.0f} {sec / s['hf']:>18.2f}x")
    print(
        f"ratio save_safetensors / save_pretrained: x{s['ours'] / s['hf']:.2f} (x{s['ours'] / s['hf_fsync']:.2f} "
        f"against save_pretrained + fsync); write time over the pass: {s['ours'] - s['pass']:.3f} s"
    )
    largest = rep["largest_shard_bytes"]
    rss = r["rss"]
    extra = rss["ours"] - rss["pass"]
    print(
        f"writer memory (rank 0), largest shard {largest / 1e6:.1f} MB: tracked peak extra "
        f"{rep['peak_extra_bytes'] / 1e3:.1f} KB ({rep['peak_extra_bytes'] / largest:.5f} of it); RSS rise "
        f"save_safetensors {rss['ours'] / 1e6:.1f} MB - plain pass {rss['pass'] / 1e6:.1f} MB = "
        f"{extra / 1e6:+.1f} MB ({extra / largest:+.3f} of the largest shard); save_pretrained's rise "
        f"{rss['hf'] / 1e6:.1f} MB"
    )
    print("  RSS rise per rep (MB): " + "; ".join(
        f"{k} " + " ".join(f"{v / 1e6:.1f}" for v in vals) for k, vals in r["rss_reps"].items()
    ))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
