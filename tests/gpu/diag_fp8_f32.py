"""Diagnostic (not a part): where weightsync's FP8 codes differ from vLLM's compiled quantizer on bench_fp8's
edge cases, called in bench_fp8's own order (Inductor's compiled code depends on the shapes it saw before)."""

from __future__ import annotations

import os

import torch


def _cases() -> list[tuple[torch.Tensor, str]]:
    """bench_gpu_fp8's edge cases, generated exactly as it does."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = []
    for shape in [(1, 1), (7, 300), (128, 128), (129, 257), (1000, 130), (2048, 6144), (384, 2048),
                  (300, 208), (130, 1040)]:
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, generator=g) * 2
            if shape[0] >= 256:
                x[:128, :128] = 0
                x[128:256, :128] *= 1e-40
                x[:128, -100:] *= 1e30
            cases.append((x.to(dt).cuda(), f"{shape} {str(dt)[6:]}"))
    return cases


def main() -> None:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.sources import quantize_blocks

    for x, what in _cases():
        for ue in (False, True):
            rq, rs = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue)
            q, s = quantize_blocks(x, (128, 128), scale_fmt="ue8m0" if ue else None)
            sd = s != rs
            qd = q.view(torch.uint8) != rq.view(torch.uint8)
            if not (sd.any() or qd.any()):
                continue
            print(f"[f32] {what} ue8m0={ue}: scales differ in {int(sd.sum())} of {s.numel()}; codes in {int(qd.sum())}",
                  flush=True)
            for i, j in sd.nonzero().tolist()[:4]:
                print(f"[f32]   scale {i},{j}: vllm {rs[i, j].item()!r} ours {s[i, j].item()!r}", flush=True)
            for i, j in qd.nonzero().tolist()[:8]:
                bi, bj = i // 128, j // 128
                v, sf = x[i, j].float(), rs[bi, bj]
                inv = torch.tensor(1.0, device="cuda") / sf
                print(f"[f32]   code {i},{j}: x {v.item()!r} ({v.view(torch.int32).item():#x}) sf {sf.item()!r} "
                      f"same_sf {bool(s[bi, bj] == sf)} vllm {rq[i, j].view(torch.uint8).item():#x} "
                      f"ours {q[i, j].view(torch.uint8).item():#x} x*inv {(v * inv).item()!r} "
                      f"({(v * inv).view(torch.int32).item():#x}) x/sf {(v / sf).item()!r}", flush=True)


def history() -> None:
    """The failing case alone in a fresh process (Inductor compiles it for its static shape), then again
    after bench_fp8's sequence of shapes (Inductor has recompiled with dynamic shapes): does vLLM's
    quantizer give the same bytes both times, and which equals weightsync's?"""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.sources import quantize_blocks

    cases = _cases()
    x = next(c for c, what in cases if what == "(2048, 6144) float32")
    q, s = quantize_blocks(x, (128, 128))
    a_q, a_s = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
    b_q = b_s = o_q = None
    for c, what in cases:  # bench_fp8's order: vLLM then weightsync, each with and without UE8M0
        for ue in (False, True):
            r = per_block_cast_to_fp8(c, [128, 128], use_ue8m0=ue)
            o = quantize_blocks(c, (128, 128), scale_fmt="ue8m0" if ue else None)
            if what == "(2048, 6144) float32" and not ue:
                (b_q, b_s), o_q = r, o[0]
    print(f"[hist] in the sequence, weightsync vs weightsync first: codes "
          f"{int((o_q.view(torch.uint8) != q.view(torch.uint8)).sum())}", flush=True)

    def diff(p, r):
        return int((p.view(torch.uint8) != r.view(torch.uint8)).sum())

    print(f"[hist] alone vs ours: codes {diff(a_q, q)} scales {int((a_s != s).sum())}; after the sequence vs "
          f"ours: codes {diff(b_q, q)} scales {int((b_s != s).sum())}; alone vs after: codes {diff(a_q, b_q)}",
          flush=True)


if __name__ == "__main__":
    history() if os.environ.get("DIAG_HISTORY") else main()
