"""FSDPSource vs vLLM's ModuleSource: seconds and collectives per ``iter_full`` pass, 2 gloo ranks, CPU.

Both sources run on the same FSDP2 model in the same process, rep by rep interleaved (so drift on a
shared machine hits both alike); the figure is the median over ``--reps`` passes after one warm-up
pass each. Collectives are counted in one extra, untimed pass by a dispatcher hook on c10d ops
(independent of the sources' own counters), on rank 0.

Models:

* ``many-small``: ``--units`` FSDP units of ``--per-unit`` tiny Linear layers (weight + bias), the
  default 16 x 32 x 2 = 1,024 parameters -- where per-parameter gathers hurt most. Reference
  measured before: ModuleSource, 1,024 params in 16 units, 2 ranks gloo: 0.86 s per pass.
* ``qwen3-tiny``: a transformers Qwen3 model (hidden 64, 4 layers, vocab 1024), FSDP2 per decoder
  layer + root.

    python bench/bench_fsdp.py
    python bench/bench_fsdp.py --reps 9 --units 32 --per-unit 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from worlds import run_world  # noqa: E402


class _CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func.namespace in ("c10d", "_c10d_functional") and "wait_tensor" not in name and "wrap_tensor" not in name:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _many_small(units: int, per_unit: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(per_unit)])
            for _ in range(units)
        ]
    )


def _qwen3_tiny() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg)


def _shard(model, blocks, mesh):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sum(1 for m in model.modules() if isinstance(m, FSDPModule))


def _timed_pass(source) -> float:
    t0 = time.perf_counter()
    for _name, _t in source.iter_full():
        pass
    return time.perf_counter() - t0


def _counted_pass(source) -> int:
    """Collectives of one pass (a separate, untimed pass: the dispatcher hook slows every op)."""
    with _CountCollectives() as counter:
        for _name, _t in source.iter_full():
            pass
    return counter.n


def _worker(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for label in ("many-small", "qwen3-tiny"):
        if label == "many-small":
            model = _many_small(args.units, args.per_unit, args.width)
            units = _shard(model, list(model), mesh)
        else:
            model = _qwen3_tiny()
            units = _shard(model, list(model.model.layers), mesh)
        n_params = sum(1 for _ in model.parameters())
        sources = {"ModuleSource": ModuleSource(model), "FSDPSource": FSDPSource(model)}
        for s in sources.values():  # warm-up (FSDPSource's first pass also agrees on metadata)
            _timed_pass(s)
        colls = {k: _counted_pass(s) for k, s in sources.items()}
        times = {k: [] for k in sources}
        for _ in range(args.reps):
            for k, s in sources.items():
                dist.barrier()
                times[k].append(_timed_pass(s))
        results[label] = {
            "params": n_params,
            "units": units,
            "seconds": {k: statistics.median(v) for k, v in times.items()},
            "collectives": colls,
        }
    if rank == 0:
        return results
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--per-unit", type=int, default=32, help="Linear layers per unit (2 params each)")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    results = run_world(_worker, args.world, timeout=1800, pg_timeout_s=600, args=args)[0]
    print(f"iter_full pass, {args.world} ranks gloo (CPU), median of {args.reps} (rank 0)")
    print(f"{'model':<12} {'params':>6} {'units':>5} | {'source':<12} {'s/pass':>8} {'ms/param':>8} {'colls':>6}")
    for label, r in results.items():
        for k in ("ModuleSource", "FSDPSource"):
            sec = r["seconds"][k]
            print(
                f"{label:<12} {r['params']:>6} {r['units']:>5} | {k:<12} {sec:>8.4f} "
                f"{1e3 * sec / r['params']:>8.3f} {r['collectives'][k]:>6}"
            )
        speed = r["seconds"]["ModuleSource"] / r["seconds"]["FSDPSource"]
        fewer = r["collectives"]["ModuleSource"] / max(1, r["collectives"]["FSDPSource"])
        print(f"{label:<12} ratio ModuleSource/FSDPSource: time x{speed:.1f}, collectives x{fewer:.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
