"""Diagnostic (not a part): where weightsync's FP8 codes differ from vLLM's compiled quantizer on an fp32
(2048, 6144) input (bench_fp8's edge case), and the Triton code Inductor generated for it."""

from __future__ import annotations

import glob
import os

import torch


def main() -> None:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.sources import quantize_blocks

    g = torch.Generator(device="cpu").manual_seed(0)
    for shape, scaled in (((2048, 6144), True), ((2048, 6144), False), ((1024, 1024), False), ((4096, 4096), False)):
        x = torch.randn(shape, generator=g) * 2
        if scaled:
            x[:128, :128] = 0
            x[128:256, :128] *= 1e-40
            x[:128, -100:] *= 1e30
        x = x.cuda()
        rq, rs = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
        q, s = quantize_blocks(x, (128, 128))
        sd = (s != rs)
        qd = (q.view(torch.uint8) != rq.view(torch.uint8))
        print(f"[f32] {shape} scaled={scaled}: scales differ in {int(sd.sum())} of {s.numel()} blocks; "
              f"codes differ in {int(qd.sum())}", flush=True)
        xb = x.view(shape[0] // 128, 128, shape[1] // 128, 128).abs().amax(dim=(1, 3))
        r448 = torch.tensor(1.0, device="cuda") / torch.tensor(448.0, device="cuda")
        for (i, j) in sd.nonzero().tolist()[:4]:
            a = xb[i, j]
            c = a.clamp(min=1e-4)
            print(f"[f32]   block {i},{j}: amax {a.item()!r} vllm sf {rs[i, j].item()!r} ours {s[i, j].item()!r} "
                  f"a/448 {(c / 448.0).item()!r} a*r448 {(c * r448).item()!r} "
                  f"a/448(t) {(c / torch.tensor(448.0, device='cuda')).item()!r}", flush=True)
        for (i, j) in qd.nonzero().tolist()[:6]:
            bi, bj = i // 128, j // 128
            sf = rs[bi, bj]
            v = x[i, j]
            print(f"[f32]   code {i},{j}: x {v.item()!r} sf {sf.item()!r} same_sf {bool(s[bi, bj] == sf)} "
                  f"vllm {rq[i, j].view(torch.uint8).item()} ours {q[i, j].view(torch.uint8).item()} "
                  f"x*(1/sf) {(v * (1.0 / sf)).item()!r} x/sf {(v / sf).item()!r}", flush=True)
    seen = 0
    for f in sorted(glob.glob(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/ind") + "/**/*.py", recursive=True)):
        src = open(f).read()
        if "triton" in src and ("float8" in src or "fp8" in src):
            for line in src.splitlines():
                t = line.strip()
                if t.startswith(("tmp", "x", "r0", "xnumel", "rnumel", "def triton", "@triton")) or "tl.store" in t \
                        or "div" in t or "rcp" in t:
                    print("[ind]", os.path.basename(f)[:12], t[:170], flush=True)
            seen += 1
            if seen >= 6:
                break
    print(f"[ind] {seen} inductor files with fp8", flush=True)


if __name__ == "__main__":
    main()
