"""GPU evidence, the part that fails first when the one-GPU NCCL environment breaks (issue 51):
2, 3 and 4 processes in one vLLM ``PyNcclCommunicator`` (over vLLM's ``StatelessProcessGroup``, the
path vLLM's NCCL weight-transfer engines open), every rank but the last broadcasting a 1 GiB bf16
tensor in turn, every receiver checking the bytes against the pattern it computes itself.

Placement (``nccl_one_gpu.place``): one GPU per process where there are enough, else all on GPU 0
under NCCL 2.30+'s ``NCCL_MULTI_RANK_GPU_ENABLE=1`` with the ferried library; a skip otherwise.
Numbers: the NCCL version vLLM loaded, the transport NCCL chose (``NCCL_DEBUG=INFO`` lines), each
broadcast's time and GB/s, and a D2D copy of the same 1 GiB for scale, at the ``NCCL_MAX_CTAS`` the
other NCCL parts use.

    python tests/gpu/part_nccl_feasible.py [--sizes 2,3,4] [--gib 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from facts import Facts  # noqa: E402


def _pattern(sender: int, numel: int, device: str) -> Any:
    """The bytes sender ``sender`` broadcasts: distinct per sender, no run of equal values."""
    import torch

    x = torch.arange(numel, device=device, dtype=torch.int64)
    return ((x * (2 * sender + 3) + sender) % 65521).to(torch.int16).view(torch.bfloat16)


def _member(rank: int, world: int, port: int, device: str, numel: int, queue: Any) -> None:
    try:
        import torch

        sys.path.insert(0, HERE)
        from nccl_one_gpu import loaded_nccl, patch_vllm_stream
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        torch.cuda.set_device(device)
        patch_vllm_stream()
        pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=world)
        comm = PyNcclCommunicator(pg, device=torch.device(device))
        out: dict[str, Any] = {"nccl": loaded_nccl(comm), "ok": [], "ms": {}}
        if comm.disabled:
            raise RuntimeError(f"vLLM disabled its communicator: {loaded_nccl(comm)}")
        buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.current_stream()
        for sender in range(world - 1):
            for rep in range(3):  # the first is warm-up (connection setup)
                if rank == sender:
                    buf.copy_(_pattern(sender, numel, device))
                else:
                    buf.fill_(0)
                torch.cuda.synchronize()
                pg.barrier()
                t0 = time.perf_counter()
                comm.broadcast(buf, src=sender, stream=stream)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                if rep:
                    out["ms"].setdefault(sender, []).append(ms)
            if rank != sender:
                out["ok"].append((sender, bool(torch.equal(buf.view(torch.int16),
                                                           _pattern(sender, numel, device).view(torch.int16)))))
        pg.barrier()
        comm.destroy() if hasattr(comm, "destroy") else None
        queue.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


def _world(world: int, numel: int, timeout_s: float) -> dict[int, Any]:
    import multiprocessing as mp

    from nccl_one_gpu import place, run_processes
    from receiver import free_port

    devices = place(world)
    assert devices is not None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, devices[r], numel, q)) for r in range(world)]
    return run_processes(procs, q, timeout_s, f"{world} processes on {devices}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,3,4", help="communicator sizes to try")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per broadcast")
    ap.add_argument("--dry-run", action="store_true", help="(no CPU form: NCCL needs CUDA) a skip")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("nccl_feasible", dry_run=args.dry_run)
    if args.dry_run:
        facts.skip("NCCL on one GPU", "dry run: NCCL needs CUDA")
        return facts.finish(args.json)
    import torch

    from nccl_one_gpu import place, why_not

    sizes = [int(s) for s in args.sizes.split(",") if s]
    if place(max(sizes)) is None:
        facts.skip("NCCL members sharing GPUs", why_not(max(sizes)))
        return facts.finish(args.json)
    for k in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS", "NCCL_NVLS_ENABLE", "VLLM_NCCL_SO_PATH"):
        facts.number(k, os.environ.get(k, "(unset)"))
    numel = int(args.gib * 2**30) // 2
    nbytes = numel * 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    copies = []
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i:
            copies.append((time.perf_counter() - t0) * 1e3)
    del src, dst
    torch.cuda.empty_cache()
    copy_ms = min(copies)
    facts.number("d2d copy of the same bytes (best ms)", round(copy_ms, 3))
    for world in sizes:
        try:
            res = _world(world, numel, timeout_s=240)
        except Exception as e:  # noqa: BLE001 - the next size still runs
            facts.error(f"{world} processes", e)
            continue
        facts.number(f"{world} processes: vLLM loaded", res[0]["nccl"])
        bad = [(r, s) for r, v in res.items() for s, ok in v["ok"] if not ok]
        expected = sum(world - 1 for _ in range(world - 1))
        got = sum(len(v["ok"]) for v in res.values())
        facts.check(f"{world} processes, {place(world)}: each of {world - 1} senders' {args.gib:g} GiB arrives on "
                    "every other member bit for bit", not bad and got == expected,
                    f"{got} copies checked" if not bad else f"differ (receiver, sender): {bad}")
        for sender in range(world - 1):
            ms = min(res[sender]["ms"][sender])
            facts.number(f"{world} processes: broadcast from {sender} best ms / GB/s / x copy",
                         f"{ms:.1f} / {nbytes / ms / 1e6:.1f} / {ms / copy_ms:.1f}")
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
