"""What checking costs: a pass of FSDPSource with and without weightsync's checks, 2 gloo ranks on CPU.

Variants, interleaved rep by rep so drift on a shared machine hits all alike (median of ``--reps``):

* ``unchecked``  -- ``FSDPSource(model, check=False, agree=False)``: the baseline;
* ``source``     -- ``FSDPSource(model)``: its own per-rank stream check + first-pass agreement;
* ``checked``    -- ``checked(FSDPSource(model, check=False, agree=False))``: the wrapper every plugin
  applies -- stream check, first-pass agreement, bounded end-of-pass exchange, failure board;
* ``checksums``  -- the same with ``checksums=True`` (per-parameter integrity sums, one sync per pass).

Because a 2% difference is below the noise of a shared 2-core machine, it also measures the check's
parts in isolation, in the same run: ``check_stream`` over the pass's own tensors (per-tensor cost) and
the end-of-pass store exchange (``Board.exchange``), and prints the overhead they add up to as a
fraction of the baseline pass ("computed"), next to the measured ratio.

    python bench/bench_check.py                  # llama-ish, 8 layers, hidden 512 (~60M params)
    python bench/bench_check.py --hidden 1024 --layers 4 --reps 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from worlds import run_world  # noqa: E402


def _model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _worker(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.sources import FSDPSource, checked
    from weightsync.sources.core.check.stream import check_stream
    from weightsync.sources.core.comm.waits import Board, next_tag

    model = _model(args)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    variants = {
        "unchecked": lambda: FSDPSource(model, check=False, agree=False),
        "source": lambda: FSDPSource(model),
        "checked": lambda: checked(FSDPSource(model, check=False, agree=False)),
        "checksums": lambda: checked(FSDPSource(model, check=False, agree=False), checksums=True),
    }
    sources = {k: make() for k, make in variants.items()}
    for src in sources.values():  # warm-up: first-pass agreement, allocator, group creation
        for _ in src.iter_full():
            pass
    times = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            n = 0
            for _name, tensor in sources[k].iter_full():
                n += tensor.numel()
            times[k].append(time.perf_counter() - t0)

    # the parts, in isolation, over this pass's own tensors
    base = sources["unchecked"]
    pairs = list(base.iter_full())
    expected = [m for m in base.metadata if m.owners is None or rank in m.owners]
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        for _ in check_stream(iter(pairs), expected, rank=rank):
            pass
    per_pass_stream = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        Board(next_tag("bench")).exchange("1", ranks=range(world), what="bench", timeout_s=60)
    per_exchange = (time.perf_counter() - t0) / reps
    dist.barrier()
    return ({k: (statistics.median(v), min(v)) for k, v in times.items()}, len(pairs),
            sum(t.numel() * t.element_size() for _, t in pairs), per_pass_stream, per_exchange)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    results = run_world(_worker, args.world, timeout=1800, pg_timeout_s=600, args=args)
    medians, n_tensors, nbytes, stream_s, exchange_s = results[0]
    base, base_min = medians["unchecked"]
    print(f"model: llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
          f"{n_tensors} tensors, {nbytes / 2**20:.1f} MiB per pass; world {args.world}, reps {args.reps}, "
          f"{os.cpu_count()} cpus visible")
    print(f"{'variant':<10} {'median s':>9} {'ratio (median)':>15} {'min s':>8} {'ratio (min)':>12}")
    for k, (med, lo) in medians.items():
        print(f"{k:<10} {med:>9.4f} {med / base:>15.4f} {lo:>8.4f} {lo / base_min:>12.4f}")
    computed = (stream_s + exchange_s) / base
    print(f"parts: check_stream {stream_s * 1e6 / n_tensors:.2f} us/tensor "
          f"({stream_s * 1e3:.3f} ms/pass); end-of-pass exchange {exchange_s * 1e3:.3f} ms")
    print(f"computed checking overhead: {100 * computed:.3f}% of the unchecked pass "
          f"(target < 2%: {'OK' if computed < 0.02 else 'OVER'})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
