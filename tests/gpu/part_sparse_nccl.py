"""GPU evidence, delta sync engine to engine: ``WeightSync(DeltaSource(FSDPSource(model)))`` through vLLM
0.33's real ``sparse_nccl`` engines, trainer on GPU 0, worker on GPU 1 (needs two GPUs).

Trainer (this process, ``cuda:0``): a tiny Qwen3 model in fp32 under FSDP2 (1-rank mesh), Adam at an
RL learning rate, ``DeltaSource(FSDPSource(model, dtype=bfloat16))`` driven by ``WeightSync`` with
vLLM's ``SparseNCCLTrainerInitInfo`` -- so ``WeightTransferTrainerFactory`` builds vLLM's
``SparseNCCLTrainerWeightTransferEngine``, whose rendezvous, update info, per-patch NCCL broadcasts
(indices, then values) and chunk lifecycle are vLLM's. Worker (a spawned process, ``cuda:1``):
vLLM's ``SparseNCCLWeightTransferEngine``, unmodified, over ``sparse_side.CheckpointTensors`` (one
tensor per checkpoint name, a final same-shaped ``copy_``: what vLLM's sparse apply supports), with
``mtp_validation`` stubbed as ``ipc_roundtrip.py`` / ``receiver.py`` do. The client calls the
worker engine's methods over a pipe (``receiver.PipeClient``).

1. **Preflight** (DESIGN §2: with an NCCL older than vLLM 0.33 expects, ``PyNcclCommunicator``
   disables itself and every broadcast returns at once; ``send_weights`` "succeeds", the worker keeps
   garbage). The trainer and worker open vLLM's communicator through the engines' own rendezvous
   (``trainer_init`` / ``init_transfer_engine``), the trainer broadcasts a known tensor and the
   worker returns what arrived: it must be that tensor, bit for bit; otherwise the part FAILS naming
   the NCCL versions and does not run the rounds. Control: with ``disabled`` set on both
   communicators (exactly the old-NCCL mode) the same probe must see nothing arrive, and weightsync's
   ``check_engine`` must raise ``SilentTransportError``.
2. **Rounds**, each ``ws.sync(step)``: anchor; two delta rounds after Adam steps; a no-change round; a
   failed round (an Adam step, then the worker's ``load_weights`` fails halfway through a chunk and
   one of its tensors is scrambled: a worker in an unknown state, as vLLM documents) -- ``sync``
   raises, the next round must be an anchor; that automatic anchor; one more delta round. After
   every completed round the worker's tensors equal a dense ``iter_full`` pass of the trainer's
   ``FSDPSource`` bitwise (sha256 of every tensor's bytes).

``--old-nccl-shim`` (part ``sparse_nccl_oldnccl``, whose name every check line carries; opt-in): on an NCCL older than
vLLM 0.33 binds (2.28.9 on the device image lacks ``ncclCommSuspend`` / ``ncclCommResume``), let
vLLM's NCCL wrapper load it without those two symbols (``sparse_side.install_old_nccl_shim``; vLLM
calls them only after ``has_symbol``) instead of disabling the communicator. Everything else is
unchanged, the preflight probe included: this is engine-to-engine evidence on the old library, and
the strict part ``sparse_nccl`` stays the verdict on whether vLLM works there as shipped.

Placement (``nccl_one_gpu.place``): GPU 0 and GPU 1, or both on GPU 0 under NCCL 2.30+'s multi-rank
mode with the ferried library (part ``nccl_sparse``); a SKIP (not a failure) otherwise. ``--dry-run`` (CPU): the same code with two
stand-ins only (``sparse_side.install_cpu_standins``): vLLM's ``PyNcclCommunicator`` replaced by a
gloo group between the two processes with the same ``broadcast`` / ``disabled`` surface, and the CUDA
stream / device-sync calls vLLM makes unconditionally turned into no-ops; the NCCL run itself is
reported as a skip.

    python tests/gpu/part_sparse_nccl.py [--old-nccl-shim] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402

#: Adam's learning rate: an RL-like step, most of it absorbed by the bf16 wire
ADAM_LR = 1e-5
#: indices + values bytes per ``send_weight_chunk``: small, so a round takes several chunks
CHUNK_BYTES = 64 << 10
#: the preflight's known tensor: distinct values, none of them the worker's fill (-1)
PROBE_NUMEL = 4099


def _nccl_versions(comm: Any) -> str:
    import torch

    torch_nccl = "?"
    try:
        torch_nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
    except Exception as e:  # noqa: BLE001
        torch_nccl = f"? ({e})"
    return (f"torch's NCCL {torch_nccl}; vLLM communicator: available={getattr(comm, 'available', None)} "
            f"disabled={getattr(comm, 'disabled', None)} nccl_version={getattr(comm, 'nccl_version', None)} "
            f"library={'loaded' if getattr(comm, 'nccl', None) is not None else 'NOT loaded'}")


def _probe(comm: Any, client: Any, device: str) -> tuple[bool, str]:
    """Broadcast a known tensor on the trainer's communicator while the worker receives on its own;
    (arrived bit for bit, detail)."""
    import torch

    known = (torch.arange(PROBE_NUMEL, dtype=torch.float32) * 0.5 + 3.0).to(device)
    with ThreadPoolExecutor(max_workers=1) as pool:  # both sides must be inside the broadcast together
        fut = pool.submit(client.call, "probe_recv", (PROBE_NUMEL, "float32"))
        stream = torch.cuda.current_stream() if device.startswith("cuda") else None
        comm.broadcast(known, src=0, stream=stream)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        got = fut.result(timeout=120)
    same = bool(torch.equal(got.view(torch.int32), known.cpu().view(torch.int32)))
    untouched = int((got == -1).sum())
    return same, f"{PROBE_NUMEL} fp32 sent, {'arrived bit for bit' if same else f'{untouched} still the fill -1'}"


def _shutdown_both(trainer_shutdown: Any, client: Any) -> None:
    """Destroy the trainer's and the worker's communicators at the same time (NCCL's destroy may
    flush with its peer: one side alone must not wait on the other)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(client.call, "shutdown_engine")
        try:
            trainer_shutdown()
        finally:
            fut.result(timeout=120)


def preflight(client: Any, device: str, facts: Facts) -> bool:
    """Step 1 of the module docstring; True iff NCCL really moves bytes."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

    from sparse_side import free_port

    from weightsync.plugins.sync import check_engine
    from weightsync.sources import SilentTransportError

    client.call("build", [("probe", torch.float32, (1,))])
    info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=None)
    try:
        comm = engine.model_update_group
        versions = _nccl_versions(comm)
        log(f"[sparse_nccl] trainer communicator: {versions}; worker: {client.call('comm')}")
        ok, detail = _probe(comm, client, device)
        facts.check("preflight: a known tensor broadcast on vLLM's trainer communicator arrives on the worker "
                    "bit for bit (an old NCCL makes vLLM's broadcasts silent no-ops)", ok,
                    f"{detail}; {versions}" + ("" if ok else " -- vLLM 0.33 disables PyNcclCommunicator when NCCL "
                                               "lacks a symbol it binds (ncclCommSuspend: NCCL 2.28.9 has none): "
                                               "send_weights would report success while the worker keeps garbage"))
        # control: the old-NCCL mode on purpose -- the probe must notice, and so must check_engine
        was = comm.disabled  # True already where NCCL is too old: restored as found, never forced on
        worker_was = client.call("disable", True)
        comm.disabled = True
        try:
            ctl_ok, ctl_detail = _probe(comm, client, device)
            facts.check("preflight control: with both communicators disabled (the old-NCCL mode) the probe sees "
                        "nothing arrive", not ctl_ok, ctl_detail)
            try:
                check_engine(engine)
                err = "no error"
            except SilentTransportError as e:
                err = f"SilentTransportError: {e}"
            facts.check("preflight control: weightsync's check_engine refuses the disabled communicator "
                        "(SilentTransportError)", err.startswith("SilentTransportError") and "disabled" in err,
                        err[:300])
        finally:
            comm.disabled = was
            client.call("disable", worker_was)
        return ok
    finally:
        _shutdown_both(engine.shutdown, client)


def rounds(client: Any, device: str, facts: Facts) -> None:
    """Step 2 of the module docstring."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerInitInfo,
        SparseNCCLTrainerWeightTransferEngine,
    )

    from hf_side import build_hf, digest, tiny_config
    from sparse_side import free_port

    from weightsync.plugins.sync import WeightSync
    from weightsync.sources import DeltaSource, FSDPSource

    cfg = tiny_config("qwen3")
    model = build_hf(cfg, device=device, dtype=torch.float32, seed=41).train()
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    src = FSDPSource(model, dtype=torch.bfloat16)
    delta = DeltaSource(src)
    metas = [(m.name, m.dtype, tuple(m.shape)) for m in delta.metadata]
    client.call("build", metas)
    info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0)
    ws = WeightSync(delta, info, client, pause=None, chunk_bytes=CHUNK_BYTES)

    def train(k: int) -> None:
        g = torch.Generator().manual_seed(200 + k)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def worker_equals_dense() -> tuple[bool, str]:
        dense = {n: digest(t) for n, t in src.iter_full()}
        got = client.call("digests")
        bad = sorted(n for n in dense if got.get(n) != dense[n])
        return not bad and set(got) == set(dense), (f"{len(dense)} tensors" if not bad else f"differ: {bad[:5]} "
                                                    f"({len(bad)} of {len(dense)})")

    plan = (("anchor", 0), ("delta", 1), ("delta", 2), ("no change", 3), ("failed", 4), ("auto anchor", 5),
            ("delta", 6))
    try:
        for step, (what, k) in enumerate(plan):
            tag = f"round {step + 1} ({what})"
            if what in ("delta", "failed", "auto anchor"):
                train(k)
            if what == "failed":
                client.call("fail_next")
                try:
                    ws.sync(step)
                    err = "no error"
                except Exception as e:  # noqa: BLE001 - the failure under test
                    err = f"{type(e).__name__}: {e}"
                client.call("scramble", metas[-1][0])  # and a tensor no round wrote: an unknown state
                facts.check(f"{tag}: sync raises the worker's apply failure", "injected" in err, err[:300])
                facts.check(f"{tag}: the next round is an anchor (every rank reset the delta)", delta.anchor_next,
                            delta.anchor_next)
                same, detail = worker_equals_dense()
                facts.check(f"{tag}: the worker is left in a state no dense pass has (what the anchor must repair)",
                            not same, detail)
                continue
            rep = ws.sync(step)
            if step == 0:
                facts.check("engine: vLLM's SparseNCCLTrainerWeightTransferEngine built by the factory",
                            isinstance(ws.engine, SparseNCCLTrainerWeightTransferEngine), type(ws.engine).__name__)
            anchor = what in ("anchor", "auto anchor")
            facts.check(f"{tag}: anchor == {anchor}", rep.delta_anchor == anchor, rep.delta_anchor)
            if what == "no change":
                facts.check(f"{tag}: nothing changed, nothing sent",
                            rep.delta_changed == 0 and not rep.delta_sent_bytes,
                            f"changed {rep.delta_changed}, sent {rep.delta_sent_bytes} B")
            elif what == "delta":
                facts.check(f"{tag}: a sparse round at 6 bytes per changed element",
                            0 < rep.delta_changed < rep.delta_elements
                            and rep.delta_sent_bytes == 6 * rep.delta_changed,
                            f"changed {rep.delta_changed}/{rep.delta_elements}, sent {rep.delta_sent_bytes} B "
                            f"in {rep.delta_chunks} chunks")
                facts.number(f"{tag} changed fraction", round(rep.delta_changed / rep.delta_elements, 5))
            else:
                facts.check(f"{tag}: every element sent, in several chunks",
                            rep.delta_changed == rep.delta_elements and rep.delta_chunks > 1,
                            f"{rep.delta_changed}/{rep.delta_elements} in {rep.delta_chunks} chunks")
            same, detail = worker_equals_dense()
            facts.check(f"{tag}: worker tensors == trainer's dense iter_full pass (bitwise)", same, detail)
            facts.number(f"{tag} send_ms", round(rep.send_seconds * 1e3, 2))
    finally:
        _shutdown_both(ws.shutdown, client)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo stand-in for vLLM's NCCL communicator")
    ap.add_argument("--old-nccl-shim", action="store_true",
                    help="load an NCCL < 2.29.7 without ncclCommSuspend/Resume (see the module docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("sparse_nccl" + ("_oldnccl" if args.old_nccl_shim else ""), dry_run=args.dry_run)
    # NVLink multicast stays off in both processes (the device machines' rule; the worker inherits it)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch

    from receiver import preload_checkpoint_weight_patch

    preload_checkpoint_weight_patch()
    if args.dry_run:
        trainer_dev, worker_dev = "cpu", "cpu"
        facts.skip("vLLM sparse_nccl over NCCL, GPU 0 -> GPU 1",
                   "dry run: vLLM's engines run on CPU with a gloo stand-in for PyNcclCommunicator; the NCCL "
                   "transfer needs 2 GPUs (bash .ci/gpu --only sparse_nccl on nvidia-h200-x2)")
        from sparse_side import install_cpu_standins

        install_cpu_standins("trainer")
    else:
        from nccl_one_gpu import patch_vllm_stream, place, why_not

        where = place(2)
        if where is None:
            facts.skip("vLLM sparse_nccl engine to engine",
                       f"{why_not(2)}: run bash .ci/gpu --only nccl_sparse after the ferry, or sparse_nccl on the "
                       "nvidia-h200-x2 kind")
            return facts.finish(args.json)
        trainer_dev, worker_dev = where
        facts.number("placement", f"trainer {trainer_dev}, worker {worker_dev}")
        torch.cuda.set_device(0)
        patch_vllm_stream()
    if args.old_nccl_shim:
        from sparse_side import OLD_NCCL_MISSING, install_old_nccl_shim

        found = install_old_nccl_shim()
        facts.number("old-NCCL shim", f"on: vLLM's NCCL wrapper loads without {', '.join(OLD_NCCL_MISSING)}; "
                                      f"{found}")
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    client = None
    try:
        from part_ipc import _init_dist
        from sparse_side import start_sparse_worker

        _init_dist(trainer_dev)  # the FSDP2 model's 1-rank group (nccl on GPU 0, gloo on CPU)
        client = start_sparse_worker(worker_dev, args.dry_run, old_nccl_shim=args.old_nccl_shim)
        if preflight(client, trainer_dev, facts):
            rounds(client, trainer_dev, facts)
        else:
            facts.skip("rounds", "not run: the preflight found that NCCL does not move bytes (see the failed check)")
    except Exception as e:  # noqa: BLE001
        facts.error("sparse_nccl", e)
    finally:
        if client is not None:
            client.close()
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
