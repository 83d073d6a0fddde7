"""Many senders (``senders="owners"``) through vLLM 0.34's real NCCL engines, on CPU ranks: the
harness ``test_many_senders.py`` and the dry run of ``tests/gpu/part_many_senders.py`` share.

What is vLLM's own and what stands in:

* **Real**: ``NCCLTrainerWeightTransferEngine`` built by ``WeightTransferTrainerFactory.trainer_init``
  (through ``WeightSync``) on every trainer rank -- its broadcast plan, its turns, its per-turn
  ``update_weights`` payloads with ``src``, its ``_checked_iter`` on each broadcaster and its
  ``_discard`` on the others -- and the worker's ``NCCLWeightTransferEngine`` (``parse_init_info``,
  ``init_transfer_engine``, ``update_weights`` -> ``receive_weights``, which checks ``src`` against
  ``rank_offset``).
* **Stand-in** (``GlooNCCL``, CPU only): vLLM's ``PyNcclCommunicator``, i.e. ``broadcast(tensor, src,
  stream)`` over a gloo group of the transfer world (trainer broadcasters + the worker), recording
  what each member sent. ``install_standins`` puts it where the engines open their endpoints, and
  makes the CUDA stream / cache calls the engines make unconditionally no-ops. On GPUs
  (``part_many_senders``) nothing stands in: the communicator is vLLM's.
* The worker's ``start_weight_update`` / ``finish_weight_update`` skip vLLM's reload lifecycle (it
  needs a vLLM model), as ``tests/gpu/receiver.py`` does; the worker runs inside rank 0's process
  (its ``update_weights`` runs on the trainer engine's RPC thread while rank 0 broadcasts), so a
  world needs no extra process. Its model (``Received``) is strict: an unknown name, another shape
  or dtype raises.
"""

from __future__ import annotations

import contextlib
import socket
import types
from typing import Any

import torch
from gloo_comm import GlooCommunicator

__all__ = ["world_2", "world_4", "check_megatron", "check_hsdp", "bitwise_mismatches", "skip_reason", "GlooNCCL", "install_standins", "Received", "InProcessWorker", "NoClient",
           "share_port", "weight_sync", "sent_by_me", "stage_of_layer"]


def skip_reason() -> str | None:
    """None when the installed vLLM's NCCL engine has many senders (0.34+), else why not."""
    try:
        from weightsync.sources.core.comm.senders import many_senders_supported, vllm_version
    except Exception as e:  # noqa: BLE001
        return f"weightsync/vLLM not importable: {e}"
    if many_senders_supported():
        return None
    return f"vLLM {vllm_version()} has a single NCCL sender (many senders need vLLM 0.34+)"


#: vLLM's ``PyNcclCommunicator`` on CPU (``tests/gloo_comm.py``, shared with the GPU harness's dry
#: runs); its ``log`` records ``(src, nbytes)`` of every broadcast this member took part in.
GlooNCCL = GlooCommunicator


def install_standins(timeout_s: float = 60.0) -> None:
    """CPU only: vLLM's dense NCCL engines open ``GlooNCCL`` endpoints in this process; CUDA stream,
    synchronize and cache calls become no-ops (a CPU host has no CUDA driver)."""
    import vllm.distributed.weight_transfer.nccl_engine as ne

    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.empty_cache = lambda *a, **k: None  # type: ignore[assignment]

    def trainer_endpoint(info: Any, rank: int = 0) -> GlooNCCL:
        return GlooNCCL(info.master_address, info.master_port, rank, info.world_size, timeout_s)

    def worker_group(info: Any, parallel_config: Any) -> GlooNCCL:
        rank = info.rank_offset + parallel_config.data_parallel_index * parallel_config.world_size \
            + parallel_config.rank
        return GlooNCCL(info.master_address, info.master_port, rank, info.world_size, timeout_s)

    ne.open_trainer_endpoint = trainer_endpoint  # type: ignore[assignment]
    ne.worker_init_process_group = worker_group  # type: ignore[assignment]


class Received(torch.nn.Module):
    """The worker's model: what arrived, by checkpoint name. Strict about names, shapes, dtypes
    declared at ``expect``; starts filled with NaN so only what a round delivers can match."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, torch.Tensor] = {}
        self.loaded: list[str] = []

    def expect(self, metas: list[Any], device: torch.device | str = "cpu") -> None:
        self.held = {m.name: torch.full(tuple(m.shape), float("nan"), dtype=m.dtype, device=device) for m in metas}
        self.loaded = []

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, t in weights:
            dst = self.held.get(name)
            if dst is None:
                raise KeyError(f"Received: unknown checkpoint name {name!r}")
            if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                raise ValueError(f"Received: {name!r} is {tuple(t.shape)} {t.dtype}, expected {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(t)
            self.loaded.append(name)
            done.add(name)
        return done


class InProcessWorker:
    """A ``VLLMWeightSyncClient`` on rank 0 whose inference side is vLLM's real worker
    ``NCCLWeightTransferEngine`` in this process (one worker). Records each ``update_weights``
    payload's ``src`` and names, and each committed ``weight_version``."""

    def __init__(self, device: str = "cpu") -> None:
        import contextlib

        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        class Worker(NCCLWeightTransferEngine):
            def start_weight_update(self) -> None:  # the reload lifecycle needs a vLLM model
                pass

            def finish_weight_update(self) -> None:
                pass

        self.model = Received()
        self.device = torch.device(device)
        #: on a GPU, the worker's calls run with its own device current (its communicator, streams
        #: and buffers live there), whatever thread the trainer engine calls from -- and on a stream of
        #: its own: where the worker shares rank 0's GPU (NCCL's multi-rank mode, tests/gpu/nccl_one_gpu.py)
        #: the receive must not queue behind rank 0's matching broadcast on one stream
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._on = self._enter if self.device.type == "cuda" else contextlib.nullcontext
        pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
        self.engine = Worker(WeightTransferConfig(backend="nccl"), vcfg, torch.device(device), self.model)
        self.updates: list[tuple[int, list[str]]] = []
        self.versions: list[str | None] = []
        self.init_payloads: list[dict] = []

    @contextlib.contextmanager
    def _enter(self) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield

    def nccl_world_size(self) -> int:
        return 1 + 1  # one trainer sender + one worker, as VLLMHTTPClient counts

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.init_payloads.append(dict(init_info))
        with self._on():
            self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.updates.append((int(update_info.get("src", 0)), list(update_info.get("names", []))))
        with self._on():
            self.engine.update_weights(update_info)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()
        self.versions.append(weight_version)

    def expect(self, metas: list[Any]) -> None:
        self.model.expect(metas, self.device)


class NoClient:
    """The client of a rank other than 0: vLLM's engine never calls it there."""

    def _never(self, *a: Any, **k: Any) -> None:
        raise AssertionError("a non-zero trainer rank called the vLLM client")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _never


def share_port() -> int:
    """A free port picked on rank 0 and broadcast to every rank (the transfer world's rendezvous)."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            box[0] = s.getsockname()[1]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def weight_sync(source: Any, client: Any, *, packed: bool | None = None, timeout_s: float = 60.0) -> Any:
    """A ``WeightSync`` over vLLM's NCCL engine for this rank: transfer world = broadcasters + 1 worker."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from weightsync.plugins.sync.driver import WeightSync
    from weightsync.sources.toolkit import broadcast_ranks

    group = broadcast_ranks(source.metadata)
    if packed is None:  # vLLM's default on GPUs; its packed path needs CUDA streams
        packed = torch.cuda.is_available()
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=share_port(),
                               world_size=len(group) + 1, rank=dist.get_rank(), packed=packed)
    return WeightSync(source, info, client, pause=None, timeout_s=timeout_s)


def sent_by_me(sync: Any) -> tuple[int, int]:
    """``(tensors, bytes)`` this rank broadcast as a source in the last sync (0, 0: not a broadcaster)."""
    comm = getattr(sync.engine, "model_update_group", None)
    if comm is None:
        return 0, 0
    mine = [n for s, n in comm.log if s == comm.rank]
    comm.log.clear()
    return len(mine), sum(mine)


def stage_of_layer(layer: int, layers: int, pp: int, vpp: int = 1) -> int:
    """The pipeline stage holding global ``layer`` (Megatron's even split, virtual chunks round robin)."""
    chunk = layer // (layers // (pp * vpp))
    return chunk % pp


# ---- the scenarios (every rank runs them; ``world_2`` / ``world_4`` return packed facts) ---------------

def bitwise_mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    for n in set(got) & set(want):
        a, b = got[n].cpu(), want[n].cpu()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
            bad.append(n)
    return sorted(bad)


def megatron_case(rank: int, *, tmp: str, case: str, tp: int, pp: int, vpp: int | None, fail: int | None = None,
                  device: str = "cpu", worker_device: str = "cpu") -> dict:
    """One Megatron sync of a tiny Qwen3; with ``fail`` (a rank), a sync in which that rank fails
    mid-stream -- a sender after 3 tensors (then a good sync), or a TP helper at its 3rd piece: its
    sender hears it when its point-to-point wait times out, and gloo closes that pair, so the
    process group must be rebuilt before another sync (no further sync here: run it last)."""
    import torch.distributed as dist
    from megatron_worlds import hf_config, hf_model, import_hf, init_parallel, megatron_model, saved_checkpoint

    from weightsync.sources import MegatronSource

    init_parallel(tp=tp, pp=pp, vpp=vpp)
    layers = 4
    cfg = hf_config("qwen3", layers=layers)
    hf = hf_model(cfg, seed=3)
    model = megatron_model(cfg)
    import_hf(model, dict(hf.state_dict()), cfg)
    model = [c.to(device) for c in model] if isinstance(model, list) else model.to(device)
    oracle = saved_checkpoint(hf, f"{tmp}/{case}") if rank == 0 else None
    # a failing helper is heard by its sender when the point-to-point wait times out (gloo's p2p
    # waits cannot poll the failure board): keep that bound short here
    src = MegatronSource(model, hf_config=cfg, senders="owners", **({"timeout_s": 10.0} if fail is not None else {}))
    client = InProcessWorker(worker_device) if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.expect(src.metadata)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}}
    sync.sync(1)
    facts["sent"], facts["sent_bytes"] = sent_by_me(sync)
    facts["stats"] = src.last_pass.as_dict()
    if rank == 0:
        facts["mismatch"] = bitwise_mismatches(client.model.held, oracle)
        facts["updates"] = [(s, list(n)) for s, n in client.updates]
        facts["payload_rank_offset"] = client.init_payloads[0]["rank_offset"]
    if fail is not None:
        orig, orig_piece, calls = src._full_pass, src._units.shard, []

        def failing():
            for i, pair in enumerate(orig()):
                if i == 3:
                    raise RuntimeError("injected: this sender fails mid-stream")
                yield pair

        def failing_piece(unit, stats):
            calls.append(unit)
            if len(calls) == 3:
                raise RuntimeError("injected: this helper fails mid-stream")
            return orig_piece(unit, stats)

        helper = not any(m.owners[0] == fail for m in src.metadata)
        if rank == fail:
            if helper:
                src._units.shard = failing_piece
            else:
                src._full_pass = failing
        try:
            sync.sync(2)
            facts["fail_outcome"] = "returned"
        except Exception as e:  # noqa: BLE001 - the fact under test
            facts["fail_outcome"] = f"{type(e).__name__}: {e}"
        facts["sent_in_failed"], _ = sent_by_me(sync)
        if rank == fail:
            del (src._units if helper else src).__dict__["shard" if helper else "_full_pass"]
        if rank == 0:
            facts["after_fail_mismatch"] = len(bitwise_mismatches(client.model.held, oracle))
            client.expect(src.metadata)  # NaN again: the next sync must deliver everything
        if not helper:
            sync.sync(3)
            facts["resent"], _ = sent_by_me(sync)
            if rank == 0:
                facts["next_mismatch"] = bitwise_mismatches(client.model.held, oracle)
        if rank == 0:
            facts["versions"] = client.versions
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    if fail is None or not helper:
        dist.barrier()
    return facts


def moe_ep2_case(rank: int, *, tmp: str, device: str = "cpu", worker_device: str = "cpu") -> dict:
    """Qwen3-MoE at EP2 (2 ranks, 4 experts, 2 per rank): owners vs rank 0 through the same engines."""
    import torch.distributed as dist
    from moe_megatron import build_gpt, init_parallel, load_full_checkpoint, megatron_checkpoint, moe_config
    from transformers import AutoConfig

    from weightsync.sources import MegatronSource

    init_parallel(ep=2)
    hf = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2,
                              moe_intermediate_size=12, num_experts=4, intermediate_size=40, head_dim=4)
    model = build_gpt(hf, moe_config(hf, ep=2)).to(device)
    with torch.no_grad():  # a trainer's data-parallel replicas hold the same dense weights (build_gpt draws per rank)
        for n, p in model.named_parameters():
            if ".experts." not in n:
                dist.broadcast(p.data, src=0)
    import os

    os.makedirs(f"{tmp}/moe_ckpt", exist_ok=True)
    megatron_checkpoint(model, f"{tmp}/moe_ckpt")
    facts: dict = {}
    got: dict[str, dict[str, torch.Tensor]] = {}
    for senders in ("owners", "rank0"):
        src = MegatronSource(model, hf_config=hf, senders=senders)
        client = InProcessWorker(worker_device) if rank == 0 else NoClient()
        sync = weight_sync(src, client)
        if rank == 0:
            client.expect(src.metadata)
        sync.sync(1)
        facts[senders] = {"sent": sent_by_me(sync)[0], "stats": src.last_pass.as_dict(),
                          "owners": {m.name: m.owners for m in src.metadata}}
        if rank == 0:
            got[senders] = {n: t.cpu() for n, t in client.model.held.items()}
            facts[senders]["updates"] = [(s, sorted(n)) for s, n in client.updates]
        sync.shutdown()
        if rank == 0:
            client.engine.shutdown()
    if rank == 0:
        facts["vs_rank0"] = bitwise_mismatches(got["owners"], got["rank0"])
        # Megatron's own checkpoint (dist_checkpointing, resharded by torch's DCP reader): experts and routers
        ck = load_full_checkpoint(f"{tmp}/moe_ckpt")
        bad = []
        for layer in range(2):
            def ck_of(suffix):
                key = f"decoder.layers.{layer}.{suffix}"
                return ck[key] if key in ck else ck[f"decoder.layers.{suffix}"][layer]
            fc1, fc2 = ck_of("mlp.experts.experts.linear_fc1.weight"), ck_of("mlp.experts.experts.linear_fc2.weight")
            F = fc2.shape[-1]
            pre = f"model.layers.{layer}.mlp."
            want = {pre + "gate.weight": ck_of("mlp.router.weight")}
            for e in range(4):
                want.update({f"{pre}experts.{e}.gate_proj.weight": fc1[e, :F], f"{pre}experts.{e}.up_proj.weight": fc1[e, F:],
                             f"{pre}experts.{e}.down_proj.weight": fc2[e]})
            bad += [n for n, t in want.items() if not torch.equal(got["owners"][n], t.cpu().to(got["owners"][n].dtype))]
        facts["vs_megatron_ckpt"] = bad
        facts["ckpt_names"] = 2 * (1 + 12)
    dist.barrier()
    return facts


def fp8_and_refusals_case(rank: int, *, tmp: str, device: str = "cpu", worker_device: str = "cpu") -> dict:
    """FP8Source over a PP2 MegatronSource(senders="owners") through the engines (weights and their
    scales sent by the weight's stage), and what is refused, on every rank: DeltaSource over many
    senders, mode="local" with owners, FSDPSource(senders="owners") under plain FSDP."""
    import torch.distributed as dist
    from fsdp_worlds import shard, tiny_model
    from megatron_worlds import hf_config, hf_model, import_hf, init_parallel, megatron_model
    from torch.distributed.device_mesh import init_device_mesh
    from worlds import errors_of

    from weightsync.sources import DeltaSource, FP8Source, FSDPSource, MegatronSource, SafetensorsSource

    init_parallel(pp=2)
    cfg = hf_config("qwen3", layers=4, hidden_size=128, intermediate_size=256, vocab=256)
    hf = hf_model(cfg, seed=4)
    model = megatron_model(cfg)
    import_hf(model, dict(hf.state_dict()), cfg)
    model = model.to(device)
    if rank == 0:
        hf.save_pretrained(f"{tmp}/fp8")
    dist.barrier()
    src = FP8Source(MegatronSource(model, hf_config=cfg, senders="owners"))
    client = InProcessWorker(worker_device) if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.expect(src.metadata)
    sync.sync(1)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}, "sent": sent_by_me(sync)[0]}
    # the oracle: the same quantizer over the save_pretrained folder, no engine (collective: every rank)
    want = dict(FP8Source(SafetensorsSource(f"{tmp}/fp8")).iter_full())
    if rank == 0:
        facts["mismatch"] = bitwise_mismatches(client.model.held, want)
        facts["fp8"] = sum(1 for t in client.model.held.values() if t.dtype == torch.float8_e4m3fn)
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    facts["delta"] = errors_of(DeltaSource, MegatronSource(model, hf_config=cfg, senders="owners"))
    facts["local"] = errors_of(MegatronSource, model, hf_config=cfg, mode="local", senders="owners")
    facts["bad_value"] = errors_of(MegatronSource, model, hf_config=cfg, senders="all")
    plain = shard(tiny_model("qwen3", tied=False).to(device), init_device_mesh(torch.device(device).type, (2,)))
    facts["plain_fsdp"] = errors_of(FSDPSource, plain, senders="owners")
    dist.barrier()
    return facts


def world_2(rank: int, world_size: int, *, tmp: str, device: str = "cpu", worker_device: str = "cpu") -> bytes:
    """2 trainer ranks: FP8 over PP2 + refusals, PP2 (+ a failed sender), PP2 x VPP2, EP2. ``device``
    "cpu": gloo stand-in for PyNccl (``install_standins``); else each rank's GPU, vLLM's communicator."""
    if device == "cpu":
        install_standins()
    dev = dict(device=device, worker_device=worker_device)
    facts = {
        "fp8": fp8_and_refusals_case(rank, tmp=tmp, **dev),
        "pp2": megatron_case(rank, tmp=tmp, case="pp2", tp=1, pp=2, vpp=None, fail=1, **dev),
        "vpp": megatron_case(rank, tmp=tmp, case="vpp", tp=1, pp=2, vpp=2, **dev),
        "ep2": moe_ep2_case(rank, tmp=tmp, **dev),
    }
    from fsdp_worlds import pack

    return pack(facts)


def expected_sender(name: str, *, layers: int, pp: int, tp: int, vpp: int = 1) -> int:
    """The rank that must send ``name``: its stage's first rank (Megatron's default rank order puts
    stage s's first rank of replica 0 at s * tp * dp; dp = 1 here)."""
    if name.startswith("model.layers."):
        stage = stage_of_layer(int(name.split(".")[2]), layers, pp, vpp)
    elif name.startswith("model.embed_tokens"):
        stage = 0
    else:  # final norm, lm_head
        stage = pp - 1
    return stage * tp


def check_megatron(facts: dict, *, world: int, tp: int, pp: int, vpp: int = 1) -> None:
    r0 = facts[0]
    assert r0["mismatch"] == [], r0["mismatch"][:5]
    names = list(r0["owners"])
    want = {n: expected_sender(n, layers=4, pp=pp, tp=tp, vpp=vpp) for n in names}
    assert {n: o[0] for n, o in r0["owners"].items()} == want
    senders = sorted(set(want.values()))
    # each sender broadcast exactly its own tensors (counted at the communicator) ...
    for r in range(world):
        assert facts[r]["sent"] == sum(1 for s in want.values() if s == r), (r, facts[r]["sent"])
    # ... and the worker got them in turns, each turn's src the sender's place in the group
    assert [(s, sorted(ns)) for s, ns in r0["updates"]] == [
        (senders.index(r), sorted(n for n in names if want[n] == r)) for r in senders
    ]
    assert r0["payload_rank_offset"] == len(senders)
    # rank 0 holds only its own stage: nothing from another stage moved to it
    own = [n for n in names if want[n] == 0]
    if tp == 1:
        assert r0["stats"]["bytes_received"] == 0
    else:
        assert 0 < r0["stats"]["bytes_received"] < sum(1 for _ in own) * 10**9
    assert r0["stats"]["tensors"] == len(own)


def hsdp_case(rank: int, mesh, *, tmp: str, kind: str, device: str = "cpu", worker_device: str = "cpu") -> dict:
    """One HSDP sync of a tiny model: ``plain`` (Qwen3, tied), ``lora`` (PEFT LoRA, merged on the
    way out) or ``moe`` (Qwen3-MoE, transformers' fused experts sent per expert)."""
    import copy

    import torch.distributed as dist
    from fsdp_worlds import load_oracle, shard, tiny_model
    
    from weightsync.sources import FSDPSource

    layers = None
    if kind == "plain":
        model = tiny_model("qwen3", tied=True, seed=5, layers=4)
        oracle_model = model
    elif kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(tiny_model("qwen3", tied=False, seed=6, layers=4),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_()  # B starts at zero: a merge that dropped it would still match
        oracle_model = copy.deepcopy(model).merge_and_unload()
        layers = model.base_model.model.model.layers
    else:
        from moe_models import tiny_model as moe_model

        model = moe_model("qwen3_moe", seed=7)
        oracle_model = model
    if rank == 0:
        oracle_model.save_pretrained(f"{tmp}/{kind}")
    oracle = load_oracle(f"{tmp}/{kind}") if rank == 0 else None
    shard(model.to(device), mesh, layers=layers)
    src = FSDPSource(model, senders="owners")
    client = InProcessWorker(worker_device) if rank == 0 else NoClient()
    sync = weight_sync(src, client)
    if rank == 0:
        client.expect(src.metadata)
    sync.sync(1)
    facts: dict = {"owners": {m.name: m.owners for m in src.metadata}, "replicas": src.replicas}
    facts["sent"], facts["sent_bytes"] = sent_by_me(sync)
    facts["stats"] = src.last_pass.as_dict()
    facts["sizes"] = {m.name: m.dtype.itemsize * m.shape.numel() if hasattr(m.shape, "numel")
                      else m.dtype.itemsize * int(torch.Size(m.shape).numel()) for m in src.metadata}
    if rank == 0:
        facts["mismatch"] = bitwise_mismatches(client.model.held, oracle)
        facts["updates"] = [(s, sorted(n)) for s, n in client.updates]
        facts["versions"] = client.versions
    sync.shutdown()
    if rank == 0:
        client.engine.shutdown()
    dist.barrier()
    return facts


def world_4(rank: int, world_size: int, *, tmp: str, device: str = "cpu", worker_device: str = "cpu") -> bytes:
    """4 trainer ranks: Megatron PP2 x TP2, PP2 x DP2 (4 senders: each stage's units split between its
    two data-parallel replicas), FSDP2 under HSDP 2 x 2 (plain, LoRA merged, MoE)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cpu":
        install_standins()
    dev = dict(device=device, worker_device=worker_device)
    facts = {"pp2tp2": megatron_case(rank, tmp=tmp, case="pp2tp2", tp=2, pp=2, vpp=None, **dev),
             "pp2dp2": megatron_case(rank, tmp=tmp, case="pp2dp2", tp=1, pp=2, vpp=None, **dev)}
    mesh = init_device_mesh(torch.device(device).type, (2, 2), mesh_dim_names=("replicate", "shard"))
    for kind in ("plain", "lora", "moe"):
        facts[f"hsdp_{kind}"] = hsdp_case(rank, mesh, tmp=tmp, kind=kind, **dev)
    # last: a failing TP helper leaves a gloo pair closed (see megatron_case); CPU only: over NCCL its
    # sender's receive waits for the process group's watchdog, not for weightsync's timeout_s
    if device == "cpu":
        facts["helper_fails"] = megatron_case(rank, tmp=tmp, case="helper", tp=2, pp=2, vpp=None, fail=3, **dev)
    from fsdp_worlds import pack

    return pack(facts)




def check_hsdp(f: dict) -> None:
    """HSDP 2 x 2: what the receiver got, who sent what, what each rank gathered (asserts)."""
    r0 = f[0]
    assert r0["mismatch"] == [], r0["mismatch"][:5]  # byte for byte what save_pretrained wrote
    assert r0["versions"] == ["1"]
    replicas = [tuple(row) for row in r0["replicas"]]
    assert replicas == [(0, 1), (2, 3)]  # init_device_mesh's (2, 2) grid, rows = replicas
    owners = r0["owners"]
    # every tensor is owned by one replica's shard group, sent by that replica's first rank
    assert {o for o in owners.values()} == {(0, 1), (2, 3)}
    first = {n: o[0] for n, o in owners.items()}
    assert [f[r]["sent"] for r in range(4)] == [
        sum(1 for s in first.values() if s == 0), 0, sum(1 for s in first.values() if s == 2), 0
    ]
    assert [(s, ns) for s, ns in r0["updates"]] == [
        (0, sorted(n for n in first if first[n] == 0)), (1, sorted(n for n in first if first[n] == 2))
    ]
    # no gather across replicas: each replica's ranks yield only their replica's tensors
    for r in range(4):
        assert f[r]["stats"]["tensors"] == sum(1 for o in owners.values() if r in o), r
    # bytes per sender: max <= total / senders + the largest tensor
    sizes = r0["sizes"]
    per = [sum(sizes[n] for n in first if first[n] == s) for s in (0, 2)]
    assert max(per) <= sum(per) / 2 + max(sizes.values()), (per, max(sizes.values()))
