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
* ``kimi-k25``: a Kimi-K2.5 whose vision tower (hidden ``--vision-hidden``, 4 blocks) holds q/k/v
  apart in memory while its checkpoint fuses them into ``wqkv`` with the rotary permutation undone:
  ``FSDPSource`` reverts that with transformers' own ``PermuteForRope`` + ``Concatenate`` (one
  group held per block). ``no-conv`` is the same model without that one conversion (q/k/v streamed
  as held; every other conversion alike), ``cat`` the time of the ``torch.cat`` per block the
  reversal needs, timed alone (one copy of the tensors involved; transformers' ``PermuteForRope``
  adds a reshape copy of q and k).

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


def _kimi_k25(vision_hidden: int) -> torch.nn.Module:
    from conversion_models import tiny_model

    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_attention_heads=8)
    return tiny_model("kimi_k25", seed=0, fixes=dict(vision_config=vision))


def _without_wqkv(model) -> list:
    """transformers' conversions of ``model`` (as save_pretrained of a from_config model uses
    them) without the vision ``wqkv`` fusion: the control streams everything else alike."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    convs = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in convs if not isinstance(c, PrefixChange) and "wqkv" not in str(c.source_patterns)]


def _cat_seconds(model, reps: int) -> float:
    """One torch.cat of q/k/v per vision block (what the wqkv reversal copies), timed alone."""
    blocks = [m for n, m in model.named_modules() if n.endswith(".attn") and hasattr(m, "q_proj")]
    full = [[getattr(b, p).weight.full_tensor() for p in ("q_proj", "k_proj", "v_proj")] for b in blocks]
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for qkv in full:
            torch.cat(qkv, 0)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


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
    for label in ("many-small", "qwen3-tiny", "kimi-k25"):
        if label == "many-small":
            model = _many_small(args.units, args.per_unit, args.width)
            units = _shard(model, list(model), mesh)
        elif label == "qwen3-tiny":
            model = _qwen3_tiny()
            units = _shard(model, list(model.model.layers), mesh)
        else:
            model = _kimi_k25(args.vision_hidden)
            plain = _kimi_k25(args.vision_hidden)
            plain._weight_conversions = _without_wqkv(plain)  # q/k/v streamed as they are held
            units = _shard(model, [*model.model.vision_tower.layers, *model.model.language_model.layers], mesh)
            _shard(plain, [*plain.model.vision_tower.layers, *plain.model.language_model.layers], mesh)
        n_params = sum(1 for _ in model.parameters())
        sources = {"ModuleSource": ModuleSource(model), "FSDPSource": FSDPSource(model)}
        if label == "kimi-k25":
            sources = {"no-conv": FSDPSource(plain), "FSDPSource": sources["FSDPSource"]}
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
        if label == "kimi-k25":
            results[label]["cat"] = _cat_seconds(model, args.reps)
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
    ap.add_argument("--vision-hidden", type=int, default=512, help="kimi-k25's vision hidden size")
    args = ap.parse_args()
    results = run_world(_worker, args.world, timeout=1800, pg_timeout_s=600, args=args)[0]
    print(f"iter_full pass, {args.world} ranks gloo (CPU), median of {args.reps} (rank 0)")
    print(f"{'model':<12} {'params':>6} {'units':>5} | {'source':<12} {'s/pass':>8} {'ms/param':>8} {'colls':>6}")
    for label, r in results.items():
        if label == "kimi-k25":
            conv, plain = r["seconds"]["FSDPSource"], r["seconds"]["no-conv"]
            print(
                f"{label:<12} {r['params']:>6} {r['units']:>5} | converted {conv:.4f} s, no-conv {plain:.4f} s, "
                f"difference {conv - plain:+.4f} s vs one cat of the q/k/v {r['cat']:.4f} s; "
                f"collectives {r['collectives']['FSDPSource']} vs {r['collectives']['no-conv']}"
            )
            continue
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
