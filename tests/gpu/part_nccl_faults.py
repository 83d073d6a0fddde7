"""GPU evidence over real NCCL (issue 51): faults in the middle of a broadcast, and the preflight on an
NCCL vLLM cannot use.

Default (part ``nccl_faults``; trainer and vLLM worker on GPU 0 under NCCL's multi-rank mode, or on
two GPUs; ``nccl_one_gpu.place``):

1. **A sender raising mid-broadcast**, unpacked and packed: ``WeightSync`` over vLLM's
   ``NCCLTrainerWeightTransferEngine`` into vLLM's ``NCCLWeightTransferEngine`` in a receiver process
   (``receiver.py``, a transformers model of the same config), the source raising after half its
   tensors. vLLM's worker waits in a broadcast for every tensor the update info declared, and NCCL
   has no timeout: weightsync completes the turn with zeros (``plugins/sync/dense_pass.py``). Checked:
   ``sync`` raises the source's error within seconds; the worker got every declared tensor and
   finished without a ``weight_version``; the next sync delivers ``save_pretrained``'s bytes of the
   trainer's model and commits.
2. **A sender process killed mid-broadcast** (SIGKILL while its source is yielding): nothing of
   weightsync's runs on the worker, so this records what vLLM's worker engine does with a dead peer
   in a broadcast -- whether its ``update_weights`` returns, raises or stays blocked past
   ``KILLED_WAIT_S`` -- as a number, not a check (``docs/gpu.md`` says what a user must do).

``--preflight`` (part ``nccl_preflight``, run *without* the ferried library: the device image's NCCL
2.28.9, which lacks ``ncclCommSuspend``): two trainer ranks (gloo between them) and a receiver process.
vLLM disables its ``PyNcclCommunicator`` on such a library (0.33 silently; 0.34 raises at
``trainer_init``). Checked: every trainer rank raises before any byte moves, and every rank's error
names the library file and the missing symbol; the worker received nothing.

    python tests/gpu/part_nccl_faults.py [--preflight] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from facts import Facts, log  # noqa: E402
from flaky_source import FlakySource  # noqa: E402

#: how long the killed-sender scenario waits for vLLM's worker to come out of the broadcast
KILLED_WAIT_S = 45.0
#: packed buffer: several chunks for the tiny model
PACKED_BYTES = 1_100_000


def _info(packed: bool):
    from receiver import free_port
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0,
                               packed=packed, packed_buffer_size_bytes=PACKED_BYTES)


def raising_sender(facts: Facts, trainer_dev: str, worker_dev: str) -> None:
    """Scenario 1 of the module docstring."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from hf_side import build_hf, digest, saved_digests, tiny_config
    from nccl_one_gpu import patch_vllm_stream
    from receiver import start_receiver

    from weightsync.plugins.sync.driver import WeightSync

    patch_vllm_stream()
    cfg = tiny_config("qwen3")
    model = build_hf(cfg, device=trainer_dev, dtype=torch.bfloat16, seed=11)
    saved = saved_digests(model)
    client = start_receiver("nccl", worker_dev)
    try:
        for packed in (False, True):
            tag = "packed" if packed else "unpacked"
            client.call("build", (cfg, torch.bfloat16, 100 + packed, True))
            src = FlakySource(model)
            names = [m.name for m in src.metadata]
            ws = WeightSync(src, _info(packed), client, pause=None, timeout_s=60)
            try:
                client.call("reset")
                ws.sync(1)
                src.fail_after = len(names) // 2
                client.call("reset")
                t0 = time.perf_counter()
                try:
                    ws.sync(2)
                    err = "no error"
                except Exception as e:  # noqa: BLE001 - the failure under test
                    err = f"{type(e).__name__}: {e}"
                took = time.perf_counter() - t0
                facts.check(f"{tag}: a sender raising after {src.fail_after} of {len(names)} tensors: sync raises "
                            "the source's error within seconds (no NCCL hang)",
                            "injected" in err and took < 20, f"{took:.2f}s: {err[:200]}")
                rep = client.call("report")
                got = [n for n, _ in rep["received"]]
                zero = {n: digest(torch.zeros_like(dict(model.named_parameters())[n])) for n in names}
                zeros = [n for n, d in rep["received"] if d == zero[n]]
                facts.check(f"{tag}: the worker got every declared tensor, the unsent ones as zeros",
                            got == names and set(zeros) >= set(names[src.fail_after:]),
                            f"{len(got)}/{len(names)} received, {len(zeros)} zero")
                versions = client.call("versions")
                facts.check(f"{tag}: the failed update finished without committing a weight_version",
                            versions[-2:] == ["1", None], versions)
                src.fail_after = None
                client.call("reset")
                ws.sync(3)
                rep = client.call("report")
                got = dict(tuple(x) for x in rep["received"])
                diff = sorted(n for n in saved if saved[n] != got.get(n))
                facts.check(f"{tag}: the next sync delivers save_pretrained's bytes of the trainer's model and "
                            "commits", not diff and client.call("versions")[-1] == "3",
                            f"{len(saved)} tensors" if not diff else f"differ: {diff[:5]}")
            finally:
                with ThreadPoolExecutor(max_workers=1) as pool:
                    fut = pool.submit(client.call, "shutdown_engine")
                    ws.shutdown()
                    fut.result(timeout=120)
    finally:
        client.close()


def _killed_trainer(conn: Any, queue: Any, device: str) -> None:
    """The trainer of scenario 2: one sync whose source slows down mid-stream (it gets killed there)."""
    try:
        import torch
        from hf_side import build_hf, tiny_config
        from nccl_one_gpu import patch_vllm_stream
        from receiver import PipeClient

        from weightsync.plugins.sync.driver import WeightSync

        torch.cuda.set_device(device)
        patch_vllm_stream()
        model = build_hf(tiny_config("qwen3"), device=device, dtype=torch.bfloat16, seed=11)
        src = FlakySource(model, signal_queue=queue, slow_after=3)
        WeightSync(src, _info(False), PipeClient(conn, None, 300), pause=None).sync(1)
        queue.put(("returned", None))
    except BaseException as e:  # noqa: BLE001
        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def killed_sender(facts: Facts, trainer_dev: str, worker_dev: str) -> None:
    """Scenario 2 of the module docstring."""
    import multiprocessing as mp

    import torch
    from hf_side import tiny_config
    from receiver import _receiver_main

    ctx = mp.get_context("spawn")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    a, b = ctx.Pipe()
    worker = ctx.Process(target=_receiver_main, args=(b, "nccl", worker_dev), daemon=True)
    worker.start()
    q = ctx.Queue()
    trainer = None
    try:
        a.send(("build", (tiny_config("qwen3"), torch.bfloat16, 5, True)))
        if not a.poll(180) or a.recv()[0] != "ok":
            raise RuntimeError("the worker did not build its model")
        trainer = ctx.Process(target=_killed_trainer, args=(a, q, trainer_dev), daemon=True)
        trainer.start()
        what, detail = q.get(timeout=240)
        if what != "mid-stream":
            raise RuntimeError(f"the trainer never got mid-stream: {what} {detail}")
        time.sleep(1.0)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(timeout=30)
        t0 = time.perf_counter()
        # the worker answers update_weights on the pipe the dead trainer held (this process has its end)
        answered = None
        while time.perf_counter() - t0 < KILLED_WAIT_S:
            if a.poll(1.0):
                answered = a.recv()
                break
        took = time.perf_counter() - t0
        if answered is None:
            outcome = f"still blocked in the broadcast {KILLED_WAIT_S:.0f}s after its trainer was SIGKILLed"
        else:
            outcome = f"answered after {took:.1f}s: {answered[0]} {str(answered[1])[:300]}"
        log(f"[nccl_faults] killed sender: vLLM's worker engine {outcome}")
        facts.number("a sender killed mid-broadcast: vLLM's worker engine", outcome)
        facts.check("a sender killed mid-broadcast: the trainer process is gone (SIGKILL)",
                    trainer.exitcode == -signal.SIGKILL, trainer.exitcode)
    finally:
        for p in (trainer, worker):
            if p is not None and p.is_alive():
                p.kill()
                p.join(timeout=30)


def _preflight_rank(rank: int, world: int, port: int, device: str, queue: Any) -> None:
    """One trainer rank of ``--preflight``: ``WeightSync(ModuleSource)`` over vLLM's NCCL engine; rank 0
    drives a receiver process, rank 1 holds no client. Reports the error it raised."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    client = None
    try:
        import datetime

        import torch
        import torch.distributed as dist
        from hf_side import build_hf, tiny_config
        from many_senders_worlds import NoClient
        from receiver import start_receiver
        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from weightsync.plugins.sync.driver import WeightSync

        torch.cuda.set_device(device)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        cfg = tiny_config("qwen3")
        model = build_hf(cfg, device=device, dtype=torch.bfloat16, seed=11)
        if rank == 0:
            client = start_receiver("nccl", device)
            client.call("build", (cfg, torch.bfloat16, 3, True))
        box = [0]
        if rank == 0:
            from receiver import free_port

            box[0] = free_port()
        dist.broadcast_object_list(box, src=0)
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=box[0], world_size=2, rank=rank,
                                   packed=False)
        ws = WeightSync(ModuleSource(model), info, client if rank == 0 else NoClient(), pause=None, timeout_s=60)
        t0 = time.perf_counter()
        try:
            ws.sync(1)
            err = "no error"
        except Exception as e:  # noqa: BLE001 - the failure under test
            notes = " ".join(getattr(e, "__notes__", []))
            err = f"{type(e).__name__}: {e} {notes}"
        out = {"error": err, "seconds": round(time.perf_counter() - t0, 2)}
        if rank == 0:
            out["received"] = len(client.call("report")["received"])
        queue.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
    finally:
        if client is not None:
            client.close()


def preflight(facts: Facts) -> None:
    """``--preflight`` of the module docstring."""
    import multiprocessing as mp

    from receiver import free_port

    from weightsync.plugins.sync.preflight import nccl_library_report

    report = nccl_library_report()
    facts.number("the NCCL vLLM loads here", report)
    if "has every symbol" in report:
        facts.skip("preflight on an old NCCL", f"this NCCL has every symbol vLLM binds ({report}): run the part "
                   "without the ferried library (the device image's NCCL 2.28.9)")
        return
    ctx = mp.get_context("spawn")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_preflight_rank, args=(r, 2, port, "cuda:0", q)) for r in range(2)]
    from nccl_one_gpu import run_processes

    out = run_processes(procs, q, 240, "the preflight's two trainer ranks")
    lib_file = report.split("(", 1)[1].split(",", 1)[0] if "(" in report else "?"
    for rank in (0, 1):
        value = out[rank]
        err = value["error"]
        facts.check(f"rank {rank}: sync raises before any byte moves, naming the library file and the missing "
                    "symbol", err != "no error" and lib_file in err and "ncclCommSuspend" in err,
                    f"{value['seconds']}s: {err[:600]}")
    facts.check("the worker received nothing", out[0]["received"] == 0, out[0]["received"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preflight", action="store_true", help="the old-NCCL preflight (part nccl_preflight)")
    ap.add_argument("--dry-run", action="store_true", help="(NCCL needs CUDA) a skip")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("nccl_preflight" if args.preflight else "nccl_faults", dry_run=args.dry_run)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    if args.dry_run:
        facts.skip("NCCL faults", "dry run: NCCL needs CUDA (the CPU form is tests/test_driver.py's "
                   "test_a_single_nccl_sender_failing_mid_stream_completes_its_turn)")
        return facts.finish(args.json)
    import torch

    from receiver import _stub_mtp_validation

    _stub_mtp_validation()
    try:
        if args.preflight:
            preflight(facts)
            return facts.finish(args.json)
        from nccl_one_gpu import place, why_not

        where = place(2)
        if where is None:
            facts.skip("NCCL faults", why_not(2))
            return facts.finish(args.json)
        torch.cuda.set_device(0)
        from part_ipc import _init_dist

        _init_dist(where[0])
        raising_sender(facts, *where)
        killed_sender(facts, *where)
    except Exception as e:  # noqa: BLE001
        facts.error("nccl_faults" if not args.preflight else "nccl_preflight", e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
