"""GPU evidence, many senders (issue 40): the scenarios of ``tests/test_many_senders.py`` through vLLM
0.34's real NCCL trainer and worker engines **and its real PyNcclCommunicator**, one process per
trainer rank on its own GPU, vLLM's worker engine in rank 0's process on another GPU.

Scenarios (``tests/many_senders_worlds.py``, the same code the CPU test runs; checks
``check_megatron`` / ``check_hsdp`` and the EP2 / FP8 checks below):

* 2 trainer ranks (GPUs 0, 1; worker on GPU 2): FP8Source over a PP2 MegatronSource plus the
  refusals; MegatronSource PP2 (every tensor byte-equal to ``save_pretrained``, each sender's
  broadcasts counted, a sender failing mid-stream raises on every rank and the next sync works --
  under NCCL a hang would show here, the CPU stand-in has timeouts); PP2 x VPP2; EP2 (Qwen3-MoE).
* 4 trainer ranks (GPUs 0-3; worker on GPU 1, which only the non-sending rank 1 uses): Megatron
  PP2 x TP2, FSDP2 under HSDP 2 x 2 (plain, LoRA merged, MoE). Senders are ranks 0 and 2.

GPUs: the transfer communicator holds each sender and the worker; NCCL before 2.30 refuses two members
of one communicator on one GPU, so two senders and a worker need 3 GPUs, the 4-rank scenarios 4. Under
NCCL 2.30+'s multi-rank mode with the ferried library (part ``nccl_senders``, ``nccl_one_gpu.place``)
every rank and the worker share GPU 0. Otherwise a SKIP naming what is missing.
A vLLM with a single NCCL sender (0.33): a SKIP naming the version.

``--dry-run`` (CPU): the same scenarios on gloo ranks (``tests/worlds.run_world``) with the CPU
stand-in for PyNcclCommunicator (``many_senders_worlds.install_standins``); the NCCL run is a skip.

    python tests/gpu/part_many_senders.py [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # tests/: the scenarios and their helpers

from facts import Facts  # noqa: E402


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, kwargs: dict, queue: Any,
           device: str) -> None:
    """One trainer rank on ``device`` (its own GPU, or GPU 0 shared under NCCL's multi-rank mode):
    NCCL for tensors, gloo for objects (Megatron's groups and weightsync's bounded control groups are
    created from this default group)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        from nccl_one_gpu import patch_vllm_stream

        torch.cuda.set_device(device)
        patch_vllm_stream()
        timeout = datetime.timedelta(seconds=180)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world, timeout=timeout)
        queue.put((rank, "ok", fn(rank, world, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _gpu_world(fn: Callable[..., Any], world: int, timeout_s: float, devices: list[str],
               **kwargs: Any) -> dict[int, Any]:
    """``fn`` on ``world`` spawned processes, rank r on ``devices[r]``; raises with every rank's error or a
    hang."""
    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    procs = [ctx.Process(target=_child, args=(fn, r, world, store.port, kwargs, q, devices[r])) for r in range(world)]
    from nccl_one_gpu import run_processes

    return run_processes(procs, q, timeout_s, f"world of {world}")


def _checks(facts: Facts, res2: dict | None, res4: dict | None) -> None:
    from many_senders_worlds import check_hsdp, check_megatron

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            facts.check(name, True, "ok")
        except AssertionError as e:
            facts.check(name, False, f"{e}"[:1500])

    if res2 is not None:
        check("megatron PP2: byte-equal, each stage's first rank sent its own, rank 0 received nothing",
              lambda: check_megatron({r: f["pp2"] for r, f in res2.items()}, world=2, tp=1, pp=2))
        check("megatron PP2 x VPP2", lambda: check_megatron({r: f["vpp"] for r, f in res2.items()}, world=2, tp=1, pp=2, vpp=2))

        def failed_sender() -> None:
            pp2 = {r: f["pp2"] for r, f in res2.items()}
            for r in (0, 1):
                assert "injected: this sender fails mid-stream" in pp2[r]["fail_outcome"], (r, pp2[r]["fail_outcome"])
            assert pp2[0]["next_mismatch"] == [] and pp2[0]["versions"] == ["1", None, "3"]

        check("a sender failing mid-stream raises on every rank (no NCCL hang), the next sync works", failed_sender)

        def ep2() -> None:
            f = {r: res2[r]["ep2"] for r in (0, 1)}
            assert f[0]["vs_megatron_ckpt"] == [] and f[0]["vs_rank0"] == []
            assert f[1]["owners"]["sent"] > 0 and f[0]["owners"]["stats"]["bytes_received"] == 0

        check("megatron EP2: EP rank 1's experts leave from rank 1", ep2)

        def fp8() -> None:
            f = res2[0]["fp8"]
            assert f["mismatch"] == [] and f["fp8"] > 0

        check("FP8Source over many senders: byte-equal to FP8Source over save_pretrained", fp8)
    if res4 is not None:
        check("megatron PP2 x TP2", lambda: check_megatron({r: f["pp2tp2"] for r, f in res4.items()}, world=4, tp=2, pp=2))
        for kind in ("plain", "lora", "moe"):
            check(f"FSDP2 HSDP 2x2 {kind}: each replica sends its share",
                  lambda kind=kind: check_hsdp({r: res4[r][f"hsdp_{kind}"] for r in range(4)}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo ranks, stand-in for vLLM's PyNccl communicator")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("many_senders", dry_run=args.dry_run)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    from many_senders_worlds import skip_reason, world_2, world_4

    reason = skip_reason()
    if reason is not None:
        facts.skip("many senders through vLLM's NCCL engines", reason)
        return facts.finish(args.json)
    tmp = tempfile.mkdtemp()
    res2 = res4 = None
    try:
        if args.dry_run:
            from fsdp_worlds import unpack
            from worlds import run_world

            facts.skip("many senders over NCCL", "dry run: vLLM's engines on CPU ranks with a gloo stand-in for "
                       "PyNcclCommunicator; NCCL needs 4 GPUs (bash .ci/gpu --only many_senders on nvidia-h100-x4)")
            res2 = unpack(run_world(world_2, 2, tmp=tmp, timeout=400))
            res4 = unpack(run_world(world_4, 4, tmp=tmp, timeout=400))
        else:

            from fsdp_worlds import unpack

            from nccl_one_gpu import place, why_not

            # 2 sending trainer ranks + 1 vLLM worker (in rank 0's process): 3 GPUs, or GPU 0 for all
            # under NCCL's multi-rank mode; the 4-rank scenarios put 4 trainer ranks on 4 GPUs or on GPU 0
            three = place(3)
            if three is None:
                facts.skip("many senders over NCCL", why_not(3) + ": run bash .ci/gpu --only nccl_senders after the "
                           "ferry, or many_senders on nvidia-h100-x4")
                return facts.finish(args.json)
            facts.number("placement (2 ranks + worker)", three)
            res2 = {r: unpack({0: v})[0] for r, v in _gpu_world(world_2, 2, 300, three[:2], tmp=tmp, device="cuda",
                                                                   worker_device=three[2]).items()}
            four = place(4)
            if four is not None:
                facts.number("placement (4 ranks; worker on rank 1's GPU)", four)
                res4 = {r: unpack({0: v})[0] for r, v in _gpu_world(world_4, 4, 400, four, tmp=tmp, device="cuda",
                                                                       worker_device=four[1]).items()}
            else:
                facts.skip("4-rank scenarios (PP2 x TP2, HSDP 2 x 2)", why_not(4))
    except Exception as e:  # noqa: BLE001
        facts.error("many_senders", e)
    _checks(facts, res2, res4)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
