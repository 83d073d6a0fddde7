"""Rank functions and helpers for ``test_fsdp.py`` (imported by name in spawned children).

Each ``world_*`` function runs one scenario's checks on one rank and returns plain facts (tensors
on CPU, names, counts); the test module asserts them in the parent against oracles we did not
write: transformers' ``save_pretrained`` files, vLLM's ``ModuleSource`` and vLLM's engines.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from worlds import errors_of  # noqa: F401  (re-exported: the FSDP and LoRA worlds import it from here)

# ---- tiny transformers models -----------------------------------------------------------------

FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_config(family: str, *, tied: bool, layers: int = 2, vocab: int = 127):
    """A tiny config; ``vocab`` odd so dim 0 of the embeddings does not split evenly."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    if family == "llama":
        return LlamaConfig(**kw)
    if family == "qwen2":
        return Qwen2Config(**kw)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **kw)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **kw)
    raise ValueError(family)


def tiny_model(family: str, *, tied: bool, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, tied=tied, **kw))


def tiny_vlm(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen2.5-VL built with ``from_config`` (text tower 2 layers, vision tower 2 blocks)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=127, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
            fullatt_block_indexes=[1],
        ),
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(cfg)


def save_oracle(model: torch.nn.Module, directory: str, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` of an unsharded copy (optionally cast): the naming/bytes oracle."""
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
    m.save_pretrained(directory)


def load_oracle(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def shard(model: torch.nn.Module, mesh, *, layers=None, **kw) -> torch.nn.Module:
    """FSDP2 the torchtitan way: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers if layers is not None else model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def fsdp_unit_count(model: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for m in model.modules() if isinstance(m, FSDPModule))


def stream(source, mode: str = "full") -> list[tuple[str, torch.Tensor]]:
    it = source.iter_full() if mode == "full" else source.iter_local()
    return [(n, t) for n, t in it]


def to_cpu(pairs) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu").clone() for n, t in pairs}


def module_snapshot(model: torch.nn.Module) -> dict[str, tuple]:
    """Storage pointer, device, dtype, type and a value copy of every local tensor."""
    out = {}
    for n, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[n] = (type(p).__name__, local.data_ptr(), str(local.device), local.dtype, local.detach().clone())
    return out


def snapshot_diff(a: dict, b: dict) -> list[str]:
    bad = []
    for n in a.keys() | b.keys():
        if n not in a or n not in b:
            bad.append(f"{n}: present in one snapshot only")
            continue
        ta, pa, da, dta, va = a[n]
        tb, pb, db, dtb, vb = b[n]
        if (ta, pa, da, dta) != (tb, pb, db, dtb) or not torch.equal(va, vb):
            bad.append(f"{n}: {(ta, pa, da, dta)} -> {(tb, pb, db, dtb)} equal={torch.equal(va, vb)}")
    return bad


def meta_facts(metadata) -> list[tuple]:
    from weightsync.sources.core.check.stream import meta_entry

    return [meta_entry(m) for m in metadata]


# ---- collective counting, independent of the source's own counters -------------------------

_DIST_FUNCS = (
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
_FUNCOL_FUNCS = (
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
    "all_gather_into_tensor_coalesced",
    "all_gather_single_coalesced",
)
_QUIET_OPS = ("wait_tensor", "_wrap_tensor_autograd")


class CollectiveSpy(TorchDispatchMode):
    """Counts collectives two independent ways while active:

    * ``calls``: outermost calls of ``torch.distributed`` / functional-collective Python functions
      (patched on the modules, so DTensor's ``funcol.*`` and ``dist.*`` lookups both see them);
    * ``ops``: c10d / _c10d_functional dispatcher ops (every process-group collective reaches the
      dispatcher, whichever Python path issued it).

    With ``forbid=True`` either kind raises instead.
    """

    def __init__(self, forbid: bool = False) -> None:
        super().__init__()
        self.forbid = forbid
        self.calls: list[str] = []
        self.ops: list[str] = []
        self._depth = 0
        self._patches: list[tuple[Any, str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        if ns in ("c10d", "_c10d_functional") and not any(q in str(func) for q in _QUIET_OPS):
            if self.forbid:
                raise AssertionError(f"collective op {func} ran where none is allowed")
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def _wrap(self, mod, name):
        orig = getattr(mod, name, None)
        if orig is None:
            return
        spy = self

        def wrapper(*a, **k):
            if spy._depth == 0:
                if spy.forbid:
                    raise AssertionError(f"collective {mod.__name__}.{name} called where none is allowed")
                spy.calls.append(name)
            spy._depth += 1
            try:
                return orig(*a, **k)
            finally:
                spy._depth -= 1

        self._patches.append((mod, name, orig))
        setattr(mod, name, wrapper)

    def __enter__(self):
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        for name in _DIST_FUNCS:
            self._wrap(dist, name)
            if getattr(c10d, name, None) is not None and c10d is not dist:
                self._wrap(c10d, name)
        for name in _FUNCOL_FUNCS:
            self._wrap(funcol, name)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for mod, name, orig in reversed(self._patches):
                setattr(mod, name, orig)
            self._patches.clear()


@contextlib.contextmanager
def no_collectives():
    with CollectiveSpy(forbid=True) as spy:
        yield spy


def count_pass(source, mode: str = "full") -> tuple[int, int, dict[str, torch.Tensor]]:
    """(python-level collective calls, dispatcher collective ops, tensors) of one pass."""
    with CollectiveSpy() as spy:
        out = to_cpu(stream(source, mode))
    return len(spy.calls), len(spy.ops), out


class FusedExperts(torch.nn.Module):
    """Experts stored the transformers-5 way (3-D ``gate_up_proj`` / ``down_proj``, no ``.weight``)
    in a module transformers knows no conversion for: nothing says which checkpoint names they
    have, so a source must refuse them rather than guess."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, intermediate))


def pack(facts: Any) -> bytes:
    """Facts as bytes: tensors sent through a multiprocessing queue travel as shared-memory
    handles that die with the child, so worlds return ``torch.save`` bytes instead."""
    import io

    buf = io.BytesIO()
    torch.save(facts, buf)
    return buf.getvalue()


def unpack(results: dict[int, bytes]) -> dict[int, Any]:
    import io

    return {r: torch.load(io.BytesIO(b), weights_only=False) for r, b in results.items()}


# ---- worlds -----------------------------------------------------------------------------------


def world_families(rank: int, world_size: int, *, oracle_dir: str) -> dict:
    """FSDP2 on a 1-D mesh for Llama/Qwen2/Qwen3, tied and untied: stream vs save_pretrained,
    metadata without collectives, collective counts vs FSDP units and vs ModuleSource,
    iter_local vs ModuleSource, lifetime of yielded tensors, module untouched."""
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}
    for family in FAMILIES:
        for tied in (True, False):
            key = f"{family}-{'tied' if tied else 'untied'}"
            model = tiny_model(family, tied=tied)
            if rank == 0:
                save_oracle(model, os.path.join(oracle_dir, key))
                save_oracle(model, os.path.join(oracle_dir, key + "-bf16"), torch.bfloat16)
            shard(model, mesh)
            before = module_snapshot(model)
            f: dict[str, Any] = {"units": fsdp_unit_count(model)}

            src = FSDPSource(model)
            with no_collectives():
                meta = src.metadata
            f["meta"] = meta_facts(meta)
            first = stream(src)  # first pass also verifies cross-rank agreement
            f["fp32"] = to_cpu(first)
            f["first_ptrs"] = [t.data_ptr() for _, t in first]
            f["stats"] = src.last_pass.as_dict()
            f["calls"], f["ops"], second = count_pass(src)
            f["stats2"] = src.last_pass.as_dict()
            # Tensors of the first pass are still what they were after another full pass.
            f["kept_equal"] = all(torch.equal(t, second[n]) for n, t in first)

            ms = ModuleSource(model)
            f["ms_calls"], f["ms_ops"], ms_full = count_pass(ms)
            f["ms_full_equal"] = all(torch.equal(ms_full[n], t) for n, t in first)
            f["ms_names"] = [m.name for m in ms.metadata]
            f["ms_local"] = to_cpu(stream(ms, "local"))
            f["local"] = to_cpu(stream(src, "local"))

            bf = FSDPSource(model, dtype=torch.bfloat16)
            f["bf16"] = to_cpu(stream(bf))
            f["bf16_meta_dtypes"] = {m.name: str(m.dtype) for m in bf.metadata}
            f["bf16_stats"] = bf.last_pass.as_dict()
            f["module_changed"] = snapshot_diff(before, module_snapshot(model))
            facts[key] = f
            dist.barrier()
    return pack(facts)


def world_hsdp(rank: int, world_size: int, *, oracle_dir: str) -> dict:
    """HSDP on a (2, 2) mesh -- (Replicate, Shard(0)) -- and FSDP+TP (``_StridedShard``) on 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FSDPSource

    facts: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = tiny_model("qwen3", tied=True)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "hsdp"))
    shard(model, mesh)
    before = module_snapshot(model)
    src = FSDPSource(model)
    with no_collectives():
        facts["meta"] = meta_facts(src.metadata)
    facts["placements"] = sorted({repr(p.placements) for p in model.parameters()})
    facts["full"] = to_cpu(stream(src))
    facts["calls"], facts["ops"], _ = count_pass(src)
    facts["units"] = fsdp_unit_count(model)
    facts["stats2"] = src.last_pass.as_dict()
    facts["local"] = to_cpu(stream(src, "local"))
    facts["ms_local"] = to_cpu(stream(ModuleSource(model), "local"))
    facts["ms_calls"], facts["ms_ops"], _ = count_pass(ModuleSource(model))
    facts["module_changed"] = snapshot_diff(before, module_snapshot(model))

    # FSDP + TP: tensor-parallel attention/MLP on the inner mesh dim, FSDP on the outer.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tiny_model("llama", tied=False, seed=1)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "fsdp_tp"))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh["tp"], plan)
    shard(model, tp_mesh["dp"])
    tsrc = FSDPSource(model, dtype=torch.bfloat16)
    facts["tp_placements"] = sorted({repr(p.placements) for p in model.parameters()})
    facts["tp_full"] = to_cpu(stream(tsrc))
    facts["tp_meta"] = meta_facts(tsrc.metadata)
    facts["tp_ms_full"] = to_cpu(stream(ModuleSource(model)))
    return pack(facts)


class Untouchable:
    """A client whose every method fails: a non-sender engine must never call it."""

    def __getattr__(self, name):
        raise AssertionError(f"non-sender rank called client.{name}")



def drive_vllm_nccl(src: Any, rank: int, facts: dict) -> None:
    """2 ranks through vLLM's NCCL trainer engine: rank 0 runs the sender's own metadata check
    (``_checked_iter``) over ``src`` into ``facts["nccl_sender"]``; rank 1 is a real non-sender
    engine that drains ``iter_full()`` itself (its tensors and collectives into ``facts``)."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    if rank == 0:
        facts["nccl_sender"] = to_cpu(NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata))
        return
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=rank)
    engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=Untouchable(), source=src)
    facts["nccl_is_sender"] = engine.is_sender
    engine.send_weights()
    facts["nccl_nonsender_tensors"] = src.last_pass.tensors
    facts["nccl_nonsender_collectives"] = src.last_pass.collectives


def world_wrappers(rank: int, world_size: int, *, oracle_dir: str) -> dict:
    """Wrappers (activation checkpointing, torch.compile, a DDP-like ``module.``), CPU offload,
    ignored params, keep_fp32/group_bytes, vLLM's NCCL trainer engine on a non-sender rank, and
    bad input (every rank raises a named error, none hangs)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from vllm.distributed.weight_transfer import ModuleSource

    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}

    # 1) activation checkpointing per layer + FSDP2 + torch.compile(model) + a DDP-like wrapper.
    model = tiny_model("llama", tied=True, seed=2)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "wrapped"))
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    shard(model, mesh)
    compiled = torch.compile(model)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    wrapped = Wrapper(compiled)
    facts["wrapped_inmemory"] = [n for n, _ in wrapped.named_parameters()][:3]
    src = FSDPSource(wrapped)
    facts["wrapped_full"] = to_cpu(stream(src))
    facts["wrapped_calls"], facts["wrapped_ops"], _ = count_pass(src)
    facts["wrapped_units"] = fsdp_unit_count(model)

    # 2) CPU offload: shards live on CPU; the gather stages them; the module is left as it was.
    model = tiny_model("qwen2", tied=False, seed=3)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "offload"), torch.bfloat16)
    shard(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    before = module_snapshot(model)
    src = FSDPSource(model, dtype=torch.bfloat16)
    facts["offload_full"] = to_cpu(stream(src))
    facts["offload_calls"], facts["offload_ops"], _ = count_pass(src)
    facts["offload_units"] = fsdp_unit_count(model)
    facts["offload_changed"] = snapshot_diff(before, module_snapshot(model))
    facts["offload_ms_full"] = to_cpu(stream(ModuleSource(model)))

    # 3) a parameter FSDP ignores stays a plain tensor and is sent as such.
    model = tiny_model("qwen3", tied=False, seed=4)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "ignored"))
    ignored = {model.model.norm.weight, model.model.layers[0].input_layernorm.weight}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored & set(layer.parameters()))
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    facts["ignored_types"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    src = FSDPSource(model)
    facts["ignored_full"] = to_cpu(stream(src))

    # 4) keep_fp32 and group_bytes on the same model.
    kp = FSDPSource(model, dtype=torch.bfloat16, keep_fp32=[r"norm\.weight$"], group_bytes=4096)
    facts["keep_meta"] = {m.name: str(m.dtype) for m in kp.metadata}
    facts["keep_full"] = to_cpu(stream(kp))
    facts["keep_calls"], _, _ = count_pass(kp)
    facts["nokeep_calls"], _, _ = count_pass(src)

    # 5) vLLM's NCCL trainer engine: rank 1 is a non-sender and drains iter_full() itself;
    #    rank 0 drives the sender's own metadata check (_checked_iter) over the same source.
    model = tiny_model("qwen3", tied=True, seed=5)
    if rank == 0:
        save_oracle(model, os.path.join(oracle_dir, "nccl"), torch.bfloat16)
    shard(model, mesh)
    src = FSDPSource(model, dtype=torch.bfloat16)
    drive_vllm_nccl(src, rank, facts)

    # 6) MoE by default: transformers-5 fused experts go out per expert, as save_pretrained
    #    writes them, with no option passed.
    moe = tiny_model("qwen3_moe", tied=False, seed=6)
    if rank == 0:
        save_oracle(moe, os.path.join(oracle_dir, "moe"))
    shard(moe, mesh)
    src = FSDPSource(moe)
    facts["moe_default_full"] = to_cpu(stream(src))
    facts["moe_default_layout"] = getattr(src.expert_transform, "layout", None)
    facts["dense_expert_transform"] = FSDPSource(model).expert_transform

    # 6b) a VLM built with from_config (Qwen2.5-VL: in memory model.language_model.* / model.visual.*,
    #     save_pretrained writes model.* / visual.* by a mapping keyed on the class name, which
    #     fully_shard renames) and the same model loaded with from_pretrained: both as saved.
    vlm = tiny_vlm(seed=7)
    vlm_dir = os.path.join(oracle_dir, "vlm")
    if rank == 0:
        save_oracle(vlm, vlm_dir)
    dist.barrier()
    vlm_loaded = type(vlm).from_pretrained(vlm_dir)
    facts["vlm_inmemory"] = [n for n, _ in vlm.named_parameters()]
    for key, m in (("vlm_config", vlm), ("vlm_pretrained", vlm_loaded)):
        for blk in m.model.visual.blocks:
            fully_shard(blk, mesh=mesh)
        for layer in m.model.language_model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m.model, mesh=mesh)
        fully_shard(m, mesh=mesh)
        facts[key + "_class"] = type(m).__name__
        facts[key] = to_cpu(stream(FSDPSource(m)))
        facts[key + "_bf16"] = to_cpu(stream(FSDPSource(m, dtype=torch.bfloat16)))

    #    bad input: every rank raises a named error before any gather, none hangs. Fused experts
    #    in a model transformers has no conversion mapping for (llama + a custom experts module).
    unmappable = tiny_model("llama", tied=False, seed=6)
    cfg = unmappable.config
    unmappable.model.layers[0].mlp.experts = FusedExperts(4, cfg.hidden_size, cfg.intermediate_size)
    shard(unmappable, mesh)
    facts["err_moe"] = errors_of(lambda: FSDPSource(unmappable).metadata)
    facts["err_moe_iter"] = errors_of(lambda: FSDPSource(unmappable).iter_full())
    facts["err_moe_fused"] = errors_of(FSDPSource, unmappable, expert_layout="fused")
    facts["err_layout"] = errors_of(FSDPSource, moe, expert_layout="stacked")
    facts["err_dtype"] = errors_of(FSDPSource, model, dtype=torch.int8)
    facts["err_regex"] = errors_of(FSDPSource, model, keep_fp32=["("])
    facts["err_group"] = errors_of(FSDPSource, model, group_bytes=0)
    facts["err_module"] = errors_of(FSDPSource, {"w": torch.zeros(1)})
    # Ranks built with different wire dtypes: both raise CrossRankMismatchError, none hangs.
    diverging = FSDPSource(model, dtype=torch.bfloat16 if rank == 0 else torch.float16)
    facts["err_diverge"] = errors_of(diverging.iter_full)
    dist.barrier()

    # 7) a rank that stops iterating mid-pass: the other raises a named timeout, never hangs.
    from worlds import tell_peers, wait_for_peers

    quitter = FSDPSource(model, timeout_s=3.0)
    if rank == 1:
        it = quitter.iter_full()
        next(it)
        it.close()
        wait_for_peers("rank 0 gave up on the quitter")  # alive (no collective) while rank 0 waits out its bound
    else:
        facts["err_quit"] = errors_of(quitter.iter_full)
        tell_peers("rank 0 gave up on the quitter")
    return pack(facts)


def receiver_model() -> torch.nn.Module:
    """The loopback receiver's model: same architecture, different init (seed 9), unwrapped, bf16
    (the loopback receiver, like a bf16 vLLM server, takes the wire dtype as declared)."""
    return tiny_model("qwen3", tied=False, seed=9).to(torch.bfloat16)


def world_loopback(rank: int, world_size: int, *, oracle_dir: str, port: int, url: str) -> dict:
    """FSDPSource driven end to end through weightsync's loopback engine (vLLM's trainer factory,
    4-phase protocol over gloo) into a receiver process: wrapped trainer model (activation
    checkpointing + torch.compile), fp32 trainer, bf16 on the wire, bf16 receiver."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.sources import FSDPSource

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_model("qwen3", tied=False, seed=0)
    if rank == 0:
        save_oracle(model, oracle_dir, torch.bfloat16)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    shard(model, mesh)
    source = FSDPSource(torch.compile(model), dtype=torch.bfloat16)
    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=60)
    from weightsync.plugins.loopback.receiver import ReceiverClient

    client = ReceiverClient(url) if rank == 0 else Untouchable()
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights()
    facts = {
        "engine": type(engine).__name__,
        "tensors": source.last_pass.tensors,
        "collectives": source.last_pass.collectives,
        "units": fsdp_unit_count(model),
    }
    dist.barrier()
    return pack(facts)


# ---- CUDA (2 GPUs, NCCL): streams and real CPU offload ---------------------------------------


def cuda_streams_rank(rank: int, world_size: int, port: int, queue) -> None:
    """One rank of the 2-GPU check (mp.spawn target). Rank 0 consumes the source the way vLLM's
    packed NCCL producer does -- resumed inside a side stream, a different one per tensor -- while
    rank 1 stays on the default stream; the shards were just updated in place on the default
    stream behind a long kernel. The stream must show the updated values (the source waited for
    the default stream) and match ``full_tensor()``; with CPUOffloadPolicy the shards live on the
    host and are staged to the GPU for the gather, and stay on the host."""
    import datetime

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", store=dist.TCPStore("127.0.0.1", port, world_size, is_master=False),  # parent hosts it
            rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank),
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        from weightsync.sources import FSDPSource

        mesh = init_device_mesh("cuda", (world_size,))
        facts: dict[str, Any] = {}
        for variant in ("gpu", "offload"):
            model = tiny_model("qwen3", tied=False, seed=0)
            ref = {n: t.detach().clone() for n, t in model.state_dict().items()}  # unsharded oracle
            if variant == "gpu":
                model = model.cuda()
                shard(model, mesh)
            else:
                shard(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
            before = module_snapshot(model)
            src = FSDPSource(model, dtype=torch.bfloat16)
            side = [torch.cuda.Stream() for _ in range(3)]

            def consume() -> dict[str, torch.Tensor]:
                it = src.iter_full()
                got, k = {}, 0
                while True:
                    if rank == 0:
                        with torch.cuda.stream(side[k % 3]):
                            item = next(it, None)
                            if item is not None:
                                got[item[0]] = item[1].float().cpu()  # consumed on that stream
                    else:
                        item = next(it, None)
                        if item is not None:
                            got[item[0]] = item[1].float().cpu()
                    if item is None:
                        return got
                    k += 1

            # Warm pass: host-side setup done and the caching allocator holds blocks for these
            # streams, so the measured pass allocates without cudaMalloc (which can synchronize
            # the device and hide a missing stream wait).
            consume()
            torch.cuda.synchronize()
            with torch.no_grad():
                if variant == "gpu":
                    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time ahead of the update
                for p in model.parameters():
                    p._local_tensor.add_(1.0)
            got = consume()
            want = {n: (t.float() + 1.0).to(torch.bfloat16).float().cpu() for n, t in ref.items()}
            facts[variant] = {
                "names_equal": sorted(got) == sorted(want),
                "bad": [n for n in want if not torch.equal(got.get(n, torch.empty(0)), want[n])],
                "devices": sorted({str(p._local_tensor.device) for p in model.parameters()}),
                "storage_kept": all(
                    before[n][1] == (p._local_tensor.data_ptr()) for n, p in model.named_parameters()
                ),
                "collectives": src.last_pass.collectives,
                "units": fsdp_unit_count(model),
            }
        queue.put((rank, "ok", facts))
    except BaseException as e:  # noqa: BLE001
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
