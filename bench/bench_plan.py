"""``weightsync plan``'s CPU time estimate beside the measured pass, and the fit behind its CPU constants.

For each case a Qwen3-shaped transformers model (fp32 masters) is FSDP2-sharded over 2 gloo ranks (each
decoder layer, then the root) and ``FSDPSource(dtype=bfloat16)`` runs one warm-up pass and ``--reps``
timed passes on every rank (median of rank 0's). ``plan(config, world=2, device="cpu")`` predicts the
same pass: its ``trainer_gathers`` + ``host_per_tensor`` parts (the CPU estimate has no engine per
tensor: a source pass is all it models on its own). Printed per case: measured, estimate, ratio, and
whether the counts (tensors, collectives, bytes received) equal the pass's own ``PassStats``.

``--fit`` solves for the two CPU constants the source pass depends on most -- seconds per tensor and
bytes received per second -- by least squares over the cases (the per-collective latency stays the
assumed constant), prints them, and the estimate each case would get with them: the figures
``plugins/planner/constants.py`` cites for ``cpu_source_per_tensor`` and ``cpu_gather_rate``.

``--layout megatron`` runs ``MegatronSource(mode="full")`` at TP2 instead (rank 0 receives its
peer's shards point to point): the FSDP-fitted constants applied to a layout they were not fitted on.

    python bench/bench_plan.py
    python bench/bench_plan.py --fit --reps 7
    python bench/bench_plan.py --layout megatron
    python bench/bench_plan.py --gpu-results

``--gpu-results`` runs nothing: it prints ``plan``'s GPU estimate beside each real-size IPC case the
H100 measured in session 12 (``GPU_CASES``, copied from ``bench/results/gpu-2026-12-06-s12.md``), for
the same configs (Qwen3-1.7B / 8B / 30B-A3B at 12 layers, FSDP2 world 1, packed and unpacked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from worlds import run_world  # noqa: E402

#: (label, hidden, layers, vocab): per-tensor-bound (many small layers) to byte-bound (wide layers)
CASES = (
    ("h64 l32 v1024", 64, 32, 1024),
    ("h256 l8 v8192", 256, 8, 8192),
    ("h512 l4 v16384", 512, 4, 16384),
    ("h1024 l2 v8192", 1024, 2, 8192),
)


def _config(hidden: int, layers: int, vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab,
                       tie_word_embeddings=False, max_position_embeddings=128)


def _rank(rank: int, world_size: int, *, cfg_dir: str, reps: int, layout: str) -> dict:
    import torch

    from weightsync.plugins.testbed.presets import build_model, load_config

    config = load_config(None, cfg_dir)
    if layout == "megatron":  # MegatronSource(mode="full") at TP = world size
        from weightsync.plugins.testbed.megatron import MegatronParallel, build_megatron_gpt
        from weightsync.sources import MegatronSource

        chunks = build_megatron_gpt(config, MegatronParallel(tp=world_size), seed=0)
        src = MegatronSource(chunks[0], hf_config=config, dtype=torch.bfloat16, mode="full")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.sources import FSDPSource

        model = build_model(config, seed=0)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        src = FSDPSource(model, dtype=torch.bfloat16)
    for _ in src.iter_full():
        pass
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in src.iter_full():
            pass
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "stats": src.last_pass.as_dict()}


#: (label, bench_gpu_sizes shape or "qwen3-1.7b", layers, expert_layout, packed, measured best seconds):
#: FSDPSource through vLLM 0.34's IPC engines, one H100 (bench/results/gpu-2026-12-06-s12.md)
GPU_CASES = (
    ("qwen3-1.7b unpacked", "qwen3-1.7b", None, None, False, 40.047e-3),
    ("qwen3-1.7b packed", "qwen3-1.7b", None, None, True, 23.133e-3),
    ("qwen3-8b unpacked", "qwen3-8b", None, None, False, 61.1e-3),
    ("qwen3-8b packed", "qwen3-8b", None, None, True, 56.1e-3),
    ("30b-a3b l12 per-expert unpacked", "qwen3-30b-a3b", 12, "per_expert", False, 334.2e-3),
    ("30b-a3b l12 per-expert packed", "qwen3-30b-a3b", 12, "per_expert", True, 289.8e-3),
    ("30b-a3b l12 fused unpacked", "qwen3-30b-a3b", 12, "fused", False, 26.5e-3),
    ("30b-a3b l12 fused packed", "qwen3-30b-a3b", 12, "fused", True, 55.3e-3),
)


def gpu_results() -> None:
    """Print plan's GPU estimate beside each measured case; exit 1 if any is off by more than 30%."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
    import bench_gpu_sizes
    from hf_side import bench_config

    from weightsync.plugins.planner import plan

    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-plan-gpu-") as tmp:
        for label, shape, layers, lay, packed, measured in GPU_CASES:
            cfg = bench_config() if shape == "qwen3-1.7b" else bench_gpu_sizes.config(shape, layers, False)
            d = os.path.join(tmp, label.replace(" ", "-"))
            cfg.save_pretrained(d)
            p = plan(d, backend="ipc", device="gpu", expert_layout=lay, ipc_packed=packed)
            r = p.total_s / measured
            worst = max(worst, abs(r - 1))
            print(f"{label:34s} measured {measured * 1e3:7.1f} ms  estimate {p.total_s * 1e3:7.1f} ms  "
                  f"estimate/measured {r:5.2f}  ({p.sources[-1].tensors} tensors)")
    print(f"worst |estimate/measured - 1| = {worst:.2f} (target <= 0.30)")
    sys.exit(0 if worst <= 0.30 else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fit", action="store_true", help="fit cpu_source_per_tensor and cpu_gather_rate")
    ap.add_argument("--layout", choices=("fsdp", "megatron"), default="fsdp",
                    help="megatron: MegatronSource at TP2 instead (the constants fitted on FSDP, not refitted)")
    ap.add_argument("--gpu-results", action="store_true",
                    help="print the GPU estimate beside the recorded H100 IPC cases (runs no pass)")
    args = ap.parse_args()
    if args.gpu_results:
        return gpu_results()
    from weightsync.plugins.planner import plan
    from weightsync.plugins.planner.constants import constant

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for label, hidden, layers, vocab in CASES:
            d = os.path.join(tmp, label.replace(" ", "-"))
            _config(hidden, layers, vocab).save_pretrained(d)
            real = run_world(_rank, 2, timeout=600, cfg_dir=d, reps=args.reps, layout=args.layout)[0]
            p = plan(d, world=2, device="cpu") if args.layout == "fsdp" else plan(d, layout="megatron", tp=2, device="cpu")
            est = p.time_s["trainer_gathers"] + p.time_s["host_per_tensor"]
            c, s = p.sources[0].per_rank[0], real["stats"]
            same = (c.tensors, c.collectives, c.bytes_received) == (s["tensors"], s["collectives"], s["bytes_received"])
            rows.append((label, real["seconds"], est, c))
            print(f"{label:16s} measured {real['seconds'] * 1e3:8.1f} ms  estimate {est * 1e3:8.1f} ms  "
                  f"estimate/measured {est / real['seconds']:5.2f}  {c.tensors} tensors, {c.collectives} gathers, "
                  f"{c.bytes_received / 1e6:.1f} MB received; counts {'equal' if same else 'DIFFER'}")
    if not args.fit:
        return
    import torch

    lat = constant("cpu_collective_latency").value
    a = torch.tensor([[float(c.tensors), float(c.bytes_received)] for _, _, _, c in rows], dtype=torch.float64)
    y = torch.tensor([m - c.collectives * lat for _, m, _, c in rows], dtype=torch.float64)
    x = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
    per_tensor, per_byte = float(x[0]), float(x[1])
    print(f"fit: cpu_source_per_tensor {per_tensor * 1e6:.1f} us, cpu_gather_rate {1 / per_byte / 1e9:.3f} GB/s "
          f"(collective latency held at {lat * 1e6:.0f} us)")
    for label, m, _, c in rows:
        e = c.tensors * per_tensor + c.bytes_received * per_byte + c.collectives * lat
        print(f"  {label:16s} with the fit: estimate/measured {e / m:5.2f}")


if __name__ == "__main__":
    main()
