"""Rank functions for ``test_delta.py``: ``DeltaSource`` rounds on multi-rank CPU worlds.

Each world keeps a receiver (a dict of full tensors on rank 0) fed only delta rounds and returns
facts the parent asserts: after every round the receiver equals a dense pass of the same source
bitwise, and each round's patch set equals the set of elements whose wire bytes changed between
the dense passes before and after (both computed by the source's own ``iter_full``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_worlds import errors_of, shard, stream, tiny_model, to_cpu

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t.view(_INT[t.element_size()]) if t.dtype.is_floating_point else t


def changed_set(before: dict, after: dict) -> set[tuple[str, int]]:
    """``(name, flat index)`` of every element whose bytes differ (the oracle of "minimal")."""
    out = set()
    for n, a in after.items():
        diff = (bits(a) != bits(before[n])).nonzero().view(-1).tolist()
        out.update((n, i) for i in diff)
    return out


def apply(recv: dict, deltas) -> tuple[set[tuple[str, int]], int, list]:
    """Apply deltas to ``recv``; the set of elements they carried, their wire bytes, the whole ones."""
    carried, nbytes, whole = set(), 0, []
    for d in deltas:
        nbytes += d.nbytes
        if d.indices is None:
            recv[d.name] = d.values.reshape(d.full_shape).to("cpu").clone()
            carried.update((d.name, i) for i in range(d.values.numel()))
            whole.append(d.name)
            continue
        idx = d.indices.to("cpu").long()
        assert d.indices.dtype == torch.int32 and d.indices.dim() == 1 and d.values.dim() == 1
        assert idx.unique().numel() == idx.numel(), f"{d.name}: repeated indices"
        if d.name not in recv:
            recv[d.name] = torch.full(d.full_shape, float("nan"), dtype=d.values.dtype)
        recv[d.name].view(-1)[idx] = d.values.to("cpu")
        carried.update((d.name, i) for i in idx.tolist())
    return carried, nbytes, whole


def equal(a: dict, b: dict) -> list[str]:
    """Names that differ (missing, shape, dtype or any byte)."""
    bad = sorted(set(a) ^ set(b))
    for n in set(a) & set(b):
        if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype or not torch.equal(bits(a[n]), bits(b[n])):
            bad.append(n)
    return bad


def perturb(model: torch.nn.Module, *, frac: float, seed: int, scale: float = 0.05, skip: str = "~",
            only: str = "", same: bool = False) -> None:
    """Change about ``frac`` of every local shard's elements (each rank its own shard; ``same``: the same
    noise on every rank, for replicas that must stay equal). ``only``: parameters whose name has it."""
    g = torch.Generator().manual_seed(seed * 100 + (0 if same else dist.get_rank()))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if skip in n or only not in n:
                continue
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            mask = torch.rand(local.shape, generator=g) < frac
            local.add_(mask.to(local.dtype) * scale * (1 + local.abs()))


class RoundLog:
    """Runs rounds on every rank and records, on rank 0, the checks of each."""

    def __init__(self, source, delta, recv: dict) -> None:
        self.source, self.delta, self.recv = source, delta, recv
        self.facts: list[dict] = []
        self.dense = to_cpu(stream(source))

    def round(self, label: str, *, whole_ok: bool = False, patches: bool = False, stop_after: int | None = None) -> dict:
        before = self.dense
        if patches:
            it = self.delta.iter_patches()
        else:
            it = self.delta.iter_deltas(whole_when_cheaper=whole_ok)
        got = []
        for d in it:
            got.append(d)
            if stop_after is not None and len(got) >= stop_after:
                it.close()
                break
        after = self.dense = to_cpu(stream(self.source))
        fact = {"label": label, "stats": self.delta.last_round.as_dict(), "yielded": len(got)}
        if dist.get_rank() == 0:
            if patches:
                from vllm.model_executor.model_loader.checkpoint_weight_patch import (
                    CheckpointWeightPatch, load_checkpoint_weight_patches)
                carried = {(p.name, i) for p in got for i in p.indices.long().tolist()}
                fact["wire_bytes"] = sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size() for p in got)
                model = Receiver(self.recv)
                load_checkpoint_weight_patches(model, [
                    CheckpointWeightPatch(p.name, tuple(p.full_shape), p.values.dtype, p.values.to("cpu"), p.indices.to("cpu"))
                    for p in got])
                fact["whole"] = []
            else:
                carried, fact["wire_bytes"], fact["whole"] = apply(self.recv, got)
            fact["changed_oracle"] = len(changed_set(before, after))
            if stop_after is None:
                fact["minimal"] = carried == changed_set(before, after) if not self.delta.last_round.anchor else \
                    len(carried) == sum(t.numel() for t in after.values())
                fact["mismatch"] = equal(self.recv, after)
        self.facts.append(fact)
        return fact


class Receiver(torch.nn.Module):
    """A receiver whose ``load_weights`` copies by checkpoint name (what vLLM's NaN-masked apply wraps)."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        self.tensors = tensors

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            self.tensors[name].copy_(t)
            names.add(name)
        return names


def world_fsdp(rank: int, world_size: int) -> dict:
    """Dense qwen3 (fp32 params, bf16 wire) and Qwen3-MoE (bf16 params, fused experts sent per expert),
    FSDP2 per layer and at the root, small exchange groups: every behaviour of a round."""
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.sources import DeltaError, DeltaSource, FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict = {}

    # -- dense: fp32 parameters, bf16 wire
    model = shard(tiny_model("qwen3", tied=False), mesh)
    src = FSDPSource(model, dtype=torch.bfloat16)
    delta = DeltaSource(src, group_bytes=8 << 10)
    log = RoundLog(src, delta, {})
    out["groups"] = len(delta._groups)
    log.round("anchor")
    log.round("no change")
    perturb(model, frac=0.02, seed=1)
    log.round("delta")
    perturb(model, frac=0.02, seed=2)
    log.round("patches", patches=True)
    perturb(model, frac=0.02, seed=3)
    log.round("stopped", stop_after=2)
    log.round("after stop")
    perturb(model, frac=0.02, seed=4)
    delta.reset()
    log.round("after reset")
    with torch.no_grad():  # every element of one tensor changes: whole is cheaper there
        p = dict(model.named_parameters())["model.layers.0.self_attn.q_norm.weight"]
        p._local_tensor.add_(1.0)
    perturb(model, frac=0.01, seed=5)
    log.round("whole ok", whole_ok=True)
    # a NaN on rank 1's shard only: every rank raises, naming the tensor; the next round is an anchor
    with torch.no_grad():
        p = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
        saved = p._local_tensor[0, 0].clone()
        if rank == 1:
            p._local_tensor[0, 0] = float("nan")
    out["nan_error"] = errors_of(lambda: list(delta.iter_deltas()))
    out["anchor_after_nan"] = delta.anchor_next
    with torch.no_grad():
        p._local_tensor[0, 0] = saved
    perturb(model, frac=0.02, seed=6)
    log.round("after nan")
    out["dense_facts"] = log.facts
    out["snapshot_bytes"] = delta.snapshot_bytes
    out["shard_bytes"] = sum(p._local_tensor.numel() * 2 for p in model.parameters())

    # -- MoE: bf16 parameters, fused experts sent per expert (the transform cuts each rank's experts)
    moe = shard(tiny_model("qwen3_moe", tied=True).to(torch.bfloat16), mesh)
    msrc = FSDPSource(moe)
    mdelta = DeltaSource(msrc, group_bytes=16 << 10, anchor_every=3)
    mlog = RoundLog(msrc, mdelta, {})
    mlog.round("anchor")
    perturb(moe, frac=0.02, seed=7)
    mlog.round("delta")
    perturb(moe, frac=0.02, seed=8)
    mlog.round("delta 2")
    perturb(moe, frac=0.02, seed=9)
    mlog.round("anchor_every")
    out["moe_facts"] = mlog.facts

    # -- the fallbacks and replicas: HSDP (Replicate, Shard(0)) on a (2, 1) mesh answers from one
    #    replica; experts sharded on dim 1 and a LoRA-merged base are gathered, rank 0 diffs them
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    hsdp_mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    hsdp = shard(tiny_model("qwen3", tied=True, seed=3), hsdp_mesh)
    moe1 = tiny_model("qwen3_moe", tied=False, seed=4)
    for layer in moe1.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 3 else Shard(0))
    fully_shard(moe1, mesh=mesh)
    torch.manual_seed(5)
    lora = get_peft_model(tiny_model("qwen3", tied=False, seed=5), LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    lora = shard(lora, mesh, layers=lora.base_model.model.model.layers)
    cases = {}
    for label, m, kw in (("hsdp", hsdp, {"same": True}), ("experts dim 1", moe1, {}),
                         ("lora", lora, {"only": "lora_B"})):
        s2 = FSDPSource(m, dtype=torch.bfloat16)
        d2 = DeltaSource(s2)
        lg = RoundLog(s2, d2, {})
        lg.round("anchor")
        perturb(m, frac=0.05, seed=21, **kw)
        lg.round("delta")
        cases[label] = {"facts": lg.facts, "sent": d2.last_round.collective_bytes, "tensors": len(d2.metadata)}
    out["fallbacks"] = cases
    out["moe_names"] = sorted(mlog.recv) if rank == 0 else None
    return out


def world_generic(rank: int, world_size: int) -> dict:
    """Sources without ``iter_pieces``: vLLM's ``ModuleSource`` over a plain replica on every rank, and
    ``FP8Source(FSDPSource)``: diffed on rank 0 after their own pass."""
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.base import ModuleSource

    from weightsync.sources import DeltaSource, FP8Source, FSDPSource

    out: dict = {}
    plain = tiny_model("llama", tied=True).to(torch.bfloat16)
    src = ModuleSource(plain)
    delta = DeltaSource(src)
    log = RoundLog(src, delta, {})
    log.round("anchor")
    with torch.no_grad():
        torch.manual_seed(11)  # same on every rank: replicas stay equal
        for p in plain.parameters():
            p.add_((torch.rand(p.shape) < 0.02).to(p.dtype) * 0.1)
    log.round("delta")
    log.round("no change")
    out["module_facts"] = log.facts

    # a checkpoint folder as the source: rewritten between rounds, diffed on rank 0
    import tempfile

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import SafetensorsSource

    folder = [tempfile.mkdtemp(prefix="ws-delta-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    save_safetensors(ModuleSource(plain), folder[0], overwrite=True)
    ssrc = SafetensorsSource(folder[0])
    sdelta = DeltaSource(ssrc)
    slog = RoundLog(ssrc, sdelta, {})
    slog.round("anchor")
    with torch.no_grad():
        torch.manual_seed(13)
        for p in plain.parameters():
            p.add_((torch.rand(p.shape) < 0.01).to(p.dtype) * 0.1)
    save_safetensors(ModuleSource(plain), folder[0], overwrite=True)  # the next checkpoint
    slog.source = SafetensorsSource(folder[0])  # a folder rewritten under a source is refused: a new one,
    sdelta.swap(slog.source)                    # the same receiver and snapshots
    slog.round("delta")
    out["swap_error"] = errors_of(lambda: sdelta.swap(ModuleSource(torch.nn.Linear(2, 2))))
    out["safetensors_facts"] = slog.facts

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(tiny_model("qwen3", tied=False), mesh)
    fsrc = FP8Source(FSDPSource(model, dtype=torch.bfloat16))
    fdelta = DeltaSource(fsrc)
    flog = RoundLog(fsrc, fdelta, {})
    flog.round("anchor")
    perturb(model, frac=0.02, seed=12)
    flog.round("delta")
    out["fp8_facts"] = flog.facts
    return out


def _fake_source(mode: str):
    """A two-tensor source whose ``iter_pieces`` cuts rows between 2 ranks -- correctly (``ok``), or
    with rank 1 leaving a row out (``gap``), placing a box outside its tensor (``outside``), or
    yielding its names out of metadata order (``order``)."""
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from weightsync.sources.core.layouts.pieces import Piece, marker

    full = {"a": torch.arange(16, dtype=torch.float32).view(4, 4), "b": torch.arange(6, dtype=torch.float32) / 7}

    class Fake(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in full.items()]

        def iter_full(self):
            yield from full.items()

        def iter_pieces(self):
            r = dist.get_rank()
            a = full["a"][2 * r: 2 * r + 2]
            if mode == "gap" and r == 1:
                a = a[:1]
            off = (2 * r + (5 if mode == "outside" and r == 1 else 0), 0)
            items = [Piece("a", off, a), Piece("b", (0,), full["b"]) if r == 0 else marker("b")]
            if mode == "order" and r == 1:
                items.reverse()
            yield from items

    return Fake(), full


def world_bad_pieces(rank: int, world_size: int) -> dict:
    """Every rank raises, naming the tensor, when any rank's pieces do not fit the metadata."""
    from weightsync.sources import DeltaSource

    out = {}
    for mode in ("ok", "gap", "outside", "order"):
        src, full = _fake_source(mode)
        delta = DeltaSource(src)
        recv: dict = {}
        out[mode] = errors_of(lambda: apply(recv, list(delta.iter_deltas())))
        if mode == "ok":
            out["ok_equal"] = equal(recv, {n: t.clone() for n, t in full.items()}) if rank == 0 else []
    return out


def world_group_agreement(rank: int, world_size: int) -> dict:
    """``DeltaSource(group_bytes=None)`` on ranks that disagree on CUDA (rank 1 told it has CUDA, or
    rank 0): every rank groups by rank 0's choice from the first round on, and the rounds are exact;
    explicit values that differ are refused on every rank, naming ``group_bytes``."""
    from unittest import mock

    from weightsync.sources import DeltaSource

    out: dict = {}
    for cuda_rank in (1, 0):
        with mock.patch.object(torch.cuda, "is_available", lambda: rank == cuda_rank):
            src, full = _fake_source("ok")
            delta = DeltaSource(src)
            before = delta.group_bytes
            recv: dict = {}
            apply(recv, list(delta.iter_deltas()))
            full["a"][1, 2] += 1.0  # a change, then a delta round
            carried, _, _ = apply(recv, list(delta.iter_deltas()))
        got = [None] * world_size
        dist.all_gather_object(got, (delta.group_bytes, delta._groups))  # noqa: SLF001
        out[f"cuda_on_{cuda_rank}"] = {
            "before": before, "after": delta.group_bytes, "all": got,
            "equal": equal(recv, {n: t.clone() for n, t in full.items()}) if rank == 0 else [],
            "carried": sorted(carried) if rank == 0 else None,
        }
    src, _ = _fake_source("ok")
    mine = DeltaSource(src, group_bytes=(8 << 10) if rank == 0 else (16 << 10))
    out["explicit_mismatch"] = errors_of(lambda: list(mine.iter_deltas()))
    src, _ = _fake_source("ok")
    same = DeltaSource(src, group_bytes=None if rank == 0 else (64 << 20))  # rank 0's default (no CUDA)
    out["explicit_same"] = errors_of(lambda: list(same.iter_deltas()))
    return out
