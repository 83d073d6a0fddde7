"""Diagnostic (not a part): FP8 codes of the kernels vs vLLM's (compiled) quantizer on CUDA, whole model."""

from __future__ import annotations

import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def main() -> None:
    from hf_side import bench_config, build_hf
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.sources import quantize_blocks
    from weightsync.sources.quant.fp8 import quantize_many

    model = build_hf(bench_config(), device="cuda", dtype=torch.bfloat16, seed=3)
    ws = [(n, p.detach()) for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    bad_one, bad_many, codes = [], [], 0
    many = quantize_many([w for _, w in ws])
    for (n, w), (mq, ms) in zip(ws, many):
        rq, rs = per_block_cast_to_fp8(w, [128, 128])
        q, s = quantize_blocks(w)
        d = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()) + int((s != rs).sum())
        dm = int((mq.view(torch.uint8) != rq.view(torch.uint8)).sum()) + int((ms != rs).sum())
        codes += q.numel()
        if d:
            bad_one.append((n, d))
        if dm:
            bad_many.append((n, dm))
    print(f"[diag] {len(ws)} weights, {codes} codes: quantize_blocks differs in {len(bad_one)} {bad_one[:4]}; "
          f"quantize_many in {len(bad_many)} {bad_many[:4]}", flush=True)
    for f in glob.glob(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/ind") + "/**/*.py", recursive=True):
        src = open(f).read()
        if "float8" in src or "fp8" in src:
            for line in src.splitlines():
                if any(k in line for k in ("tmp", "div", "rcp", "reciprocal")) and ("/" in line or "div" in line or "*" in line):
                    print("[diag] inductor:", line.strip()[:160], flush=True)


if __name__ == "__main__":
    main()
