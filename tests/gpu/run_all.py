"""Runs every GPU-evidence part, each in its own subprocess under a timeout, within one time budget.

Invariants:
* a part that fails, crashes or times out is recorded and the next part still runs; a part that
  would start with less than ``MIN_PART_S`` of budget left is recorded as not run;
* on timeout the part's whole process group (its receiver process included) is killed;
* every line a part prints is echoed immediately, prefixed with the part's name (the caller tees
  stdout into ``$OUT/gpu.log``);
* the end is a summary table (stdout and ``$OUT/summary.md``) and ``$OUT/results.json`` with every
  part's checks, numbers and skips. Nothing else is written under ``$OUT``.

    python tests/gpu/run_all.py [--out DIR] [--dry-run] [--only ipc_fsdp,bench_ipc] [--budget 500]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
MIN_PART_S = 30

#: (name, script relative to the repo root, arguments, timeout in seconds), most important first.
PARTS = [
    ("env", "tests/gpu/run_all.py", ["--env"], 90),
    ("ipc_fsdp", "tests/gpu/part_ipc.py", ["--source", "module,fsdp"], 150),
    ("streams", "tests/gpu/part_streams.py", [], 90),
    ("ipc_megatron", "tests/gpu/part_ipc.py", ["--source", "megatron"], 150),
    ("ipc_lora", "tests/gpu/part_ipc.py", ["--source", "lora"], 150),
    ("ipc_safetensors", "tests/gpu/part_ipc.py", ["--source", "safetensors"], 150),
    ("oracle_dense", "tests/gpu/part_oracle.py", ["--configs", "qwen3,llama,qwen2"], 150),
    ("bench_ipc", "bench/bench_gpu_ipc.py", [], 180),
    ("bench_megatron", "bench/bench_gpu_megatron.py", [], 120),
    ("bench_fp8", "bench/bench_gpu_fp8.py", [], 240),
    ("oracle_moe", "tests/gpu/part_oracle.py", ["--configs", "qwen3_moe,glm4_moe,gpt_oss"], 240),
    ("oracle_mla", "tests/gpu/part_mla.py", [], 120),
    ("ipc_families", "tests/gpu/part_ipc.py", ["--source", "fsdp,megatron", "--family", "glm4_moe,gpt_oss"], 240),
    # the frontier families (issue 27): IPC round trips, then Megatron-vs-transformers oracles
    ("ipc_frontier", "tests/gpu/part_ipc.py", ["--source", "fsdp,megatron", "--family",
                                               "qwen3_next,qwen3_5_text,qwen3_5_moe_text,deepseek_v32,glm_moe_dsa"], 300),
    ("oracle_dsa", "tests/gpu/part_frontier.py", ["--families", "deepseek_v32,glm_moe_dsa"], 240),
    ("oracle_gdn", "tests/gpu/part_frontier.py", ["--families", "qwen3_next,qwen3_5_text,qwen3_5_moe_text"], 480),
    # delta sync (issue 32): exactness of rounds diffed on CUDA, their cost against a D2D copy, and
    # vLLM's sparse_nccl engines GPU 0 -> GPU 1 (a skip with fewer than 2 GPUs: nvidia-h200-x2)
    ("delta", "tests/gpu/part_delta.py", [], 240),
    ("bench_delta", "bench/bench_delta.py", ["--device", "cuda", "--preset", "qwen3-1.7b", "--steps", "9"], 300),
    # real sizes (issue 41): Qwen3-30B-A3B at full width (12 of 48 layers) and Qwen3-8B, every source's
    # pass and IPC refit against ModuleSource and the copy floor, and delta rounds at 2% changed
    ("bench_sizes_moe", "bench/bench_gpu_sizes.py", ["--shape", "qwen3-30b-a3b", "--layers", "12", "--ipc",
                                                     "--delta", "0.02", "--reps", "3", "--warmup", "1"], 300),
    ("bench_sizes_8b", "bench/bench_gpu_sizes.py", ["--shape", "qwen3-8b", "--ipc", "--delta", "0.02",
                                                    "--reps", "3", "--warmup", "1"], 300),
    ("sparse_nccl", "tests/gpu/part_sparse_nccl.py", [], 180),
    ("sparse_nccl_oldnccl", "tests/gpu/part_sparse_nccl.py", ["--old-nccl-shim"], 180),
    # many senders (issue 40): vLLM 0.34's NCCL engines, each stage / replica / EP rank sending its own
    # tensors (a skip below 3 GPUs, 4-rank scenarios from 4: nvidia-h100-x4)
    ("many_senders", "tests/gpu/part_many_senders.py", [], 300),
    # vLLM's NCCL engines for real on one GPU (issue 51): several NCCL members share GPU 0 under NCCL
    # 2.30+'s multi-rank mode, with the library the ferry brought (.ci/nccl_ferry.py; NCCL_ENV below is
    # set for these parts only). Where the library is missing each is a skip naming the ferry.
    ("nccl_feasible", "tests/gpu/part_nccl_feasible.py", [], 240),
    ("nccl_dense", "tests/gpu/part_ipc.py", ["--transport", "nccl", "--source", "module,fsdp,megatron,safetensors"], 300),
    ("nccl_fp8", "bench/bench_gpu_fp8.py", ["--transport", "nccl"], 200),
    ("nccl_sparse", "tests/gpu/part_sparse_nccl.py", [], 200),
    ("nccl_senders", "tests/gpu/part_many_senders.py", [], 360),
    ("nccl_faults", "tests/gpu/part_nccl_faults.py", [], 240),
    # the image's own NCCL 2.28.9 (no ncclCommSuspend): weightsync must name the library and the symbol
    ("nccl_preflight", "tests/gpu/part_nccl_faults.py", ["--preflight"], 120),
    ("bench_nccl", "bench/bench_gpu_sizes.py", ["--shape", "qwen3-1.7b", "--nccl", "--reps", "3", "--warmup", "1"], 300),
]

#: parts run under the one-GPU NCCL environment (``NCCL_ENV``); ``nccl_preflight`` deliberately not
NCCL_PARTS = {"nccl_feasible", "nccl_dense", "nccl_fp8", "nccl_sparse", "nccl_senders", "nccl_faults", "bench_nccl"}


def nccl_env() -> dict[str, str]:
    """The environment of the ``NCCL_PARTS``: the ferried NCCL 2.31 for vLLM (``VLLM_NCCL_SO_PATH``) and
    for torch's process groups (``LD_PRELOAD``: torch links ``libnccl.so.2`` by soname), the multi-rank
    mode, NVLink multicast off, few CTAs per rank (``WS_NCCL_MAX_CTAS``, default 32). Empty when the
    ferry has not run on this machine: the parts then skip, naming it."""
    lib = os.path.join(os.environ.get("WS_NCCL_STASH", "/tmp/ws-nccl"), "libnccl.so.2")
    if not os.path.exists(lib):
        return {}
    pre = os.environ.get("LD_PRELOAD", "")
    return {"WS_NCCL_SO": lib, "VLLM_NCCL_SO_PATH": lib, "LD_PRELOAD": lib + (":" + pre if pre else ""),
            "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0",
            "NCCL_MAX_CTAS": os.environ.get("WS_NCCL_MAX_CTAS", "32")}


def env_report(json_path: str | None) -> int:
    """Versions and devices, and whether weightsync and vLLM's engines import (the 'env' part)."""
    sys.path.insert(0, HERE)
    from facts import Facts

    facts = Facts("env")
    import platform

    import torch

    facts.number("python", platform.python_version())
    facts.number("torch", torch.__version__)
    facts.number("cuda", f"{torch.version.cuda} available={torch.cuda.is_available()} "
                         f"devices={torch.cuda.device_count()}")
    if torch.cuda.is_available():
        facts.number("gpu", torch.cuda.get_device_name(0))
        try:
            facts.number("nccl (torch)", ".".join(map(str, torch.cuda.nccl.version())))
        except Exception as e:  # noqa: BLE001
            facts.number("nccl (torch)", f"? {e}")
    for mod in ("transformers", "accelerate", "safetensors", "vllm", "megatron.core"):
        try:
            m = __import__(mod, fromlist=["_"])
            facts.number(mod, getattr(m, "__version__", "?"))
        except Exception as e:  # noqa: BLE001
            facts.number(mod, f"IMPORT FAILED {type(e).__name__}: {str(e)[:200]}")
    for what in ("weightsync.sources", "vllm.distributed.weight_transfer.ipc_engine"):
        try:
            mod = __import__(what, fromlist=["_"])
            facts.check(f"import {what}", True, mod.__file__)
        except Exception as e:  # noqa: BLE001
            facts.error(f"import {what}", e)
    for name in ("FSDPSource", "MegatronSource"):
        try:
            import weightsync.sources as ws

            facts.check(f"weightsync.sources.{name} importable", getattr(ws, name) is not None, "ok")
        except Exception as e:  # noqa: BLE001
            facts.error(f"weightsync.sources.{name}", e)
    return facts.finish(json_path)


def _run_part(name: str, argv: list[str], timeout: float, json_path: str) -> dict:
    # every part is one rank on an in-process store (HashStore): no port to pick, none to race for
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name in NCCL_PARTS:
        env.update(nccl_env())
    print(f"===== {name}: {' '.join(argv[1:])} (timeout {timeout:.0f}s) =====", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv + ["--json", json_path], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"{name}| {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    status = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status, rc = "TIMEOUT", None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    reader.join(timeout=10)
    try:  # a part that leaves children behind (receiver) gets them killed too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    seconds = round(time.perf_counter() - t0, 1)
    doc = None
    if os.path.exists(json_path):
        with open(json_path) as f:
            doc = json.load(f)
    if status is None:
        if doc is None:
            status = "CRASH"
        else:
            status = "PASS" if (rc == 0 and doc.get("ok")) else "FAIL"
    return {"part": name, "status": status, "rc": rc, "seconds": seconds, "result": doc}


def _summary(rows: list[dict], dry_run: bool, total_s: float) -> str:
    lines = [f"# weightsync GPU evidence{' (DRY RUN on CPU)' if dry_run else ''}", "",
             f"total {total_s:.0f}s", "",
             "| part | status | checks passed | skips | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        doc = r.get("result") or {}
        checks = doc.get("checks", [])
        lines.append(f"| {r['part']} | {r['status']} | {sum(c['ok'] for c in checks)}/{len(checks)} | "
                     f"{len(doc.get('skips', []))} | {r.get('seconds', '')} |")
    fails = [(r["part"], c) for r in rows for c in (r.get("result") or {}).get("checks", []) if not c["ok"]]
    if fails:
        lines += ["", "## Failed checks", ""]
        lines += [f"- **{p}**: {c['name']}: {c['detail'][:400]}" for p, c in fails]
    skips = [(r["part"], s) for r in rows for s in (r.get("result") or {}).get("skips", [])]
    if skips:
        lines += ["", "## Skipped", ""]
        lines += [f"- {p}: {s['name']}: {s['reason'][:300]}" for p, s in skips]
    nums = [(r["part"], k, v) for r in rows if r["part"] != "env"
            for k, v in (r.get("result") or {}).get("numbers", {}).items()]
    if nums:
        lines += ["", "## Numbers", "", "| part | what | value |", "|---|---|---|"]
        lines += [f"| {p} | {k} | {v} |" for p, k, v in nums]
    env = next((r for r in rows if r["part"] == "env"), None)
    if env and env.get("result"):
        lines += ["", "## Environment", ""]
        lines += [f"- {k}: {v}" for k, v in env["result"]["numbers"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-out"))
    ap.add_argument("--dry-run", action="store_true", help="every part on CPU (gloo, loopback)")
    ap.add_argument("--only", default=None, help="comma list of part names")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("WS_GPU_BUDGET_S", 450)),
                    help="seconds for all parts together")
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env:
        return env_report(args.json)
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    t_start = time.perf_counter()
    rows: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="ws-gpu-")
    for name, script, extra, timeout in PARTS:
        if only and name not in only:
            continue
        left = args.budget - (time.perf_counter() - t_start)
        if left < MIN_PART_S:
            rows.append({"part": name, "status": "NOT RUN (budget)", "seconds": 0, "result": None})
            print(f"===== {name}: not run, {left:.0f}s of budget left =====", flush=True)
            continue
        argv_ = [sys.executable, os.path.join(ROOT, script), *extra]
        if args.dry_run and name != "env":
            argv_.append("--dry-run")
        rows.append(_run_part(name, argv_, min(timeout * (3 if args.dry_run else 1), left),
                              os.path.join(tmp, f"{name}.json")))
        print(f"===== {name}: {rows[-1]['status']} in {rows[-1]['seconds']}s =====", flush=True)
    total = time.perf_counter() - t_start
    summary = _summary(rows, args.dry_run, total)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"dry_run": args.dry_run, "seconds": round(total, 1), "parts": rows}, f, indent=1, default=str)
    print("\n" + summary, flush=True)
    return 0 if rows and all(r["status"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
