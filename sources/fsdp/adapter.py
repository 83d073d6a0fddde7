"""``LoRAAdapterSource``: only a PEFT LoRA adapter's tensors, gathered from a sharded model, in
the names, shapes and dtype PEFT itself saves (``get_peft_model_state_dict`` /
``PeftModel.save_pretrained``) -- what vLLM's LoRA serving loads (``/v1/load_lora_adapter``).

Invariants (tested multi-rank in ``tests/test_lora_adapter.py`` against PEFT's ``save_pretrained`` of
the unsharded model):

* **Names** are PEFT's saved keys: the in-memory path of each ``lora_A`` / ``lora_B`` weight relative
  to the ``PeftModel`` (``base_model.model.<module>.lora_A.weight``), wrapper segments
  (``torch.compile``, activation checkpointing, DDP-style ``module``) removed and the adapter name
  dropped, exactly as ``get_peft_model_state_dict`` drops it. Order: the module's ``state_dict`` order.
* **Shapes** are global (a DTensor's full shape); **dtype** is the parameter's own (PEFT writes what
  the model holds) unless ``dtype=`` asks for another float dtype (cast on the shard, before it moves).
* **Metadata** is computed from module structure and global shapes only: no collective, identical
  on every rank. Every rank iterates every tensor (``owners`` None): ``iter_full`` is collective.
* **Gathers**: only adapter tensors move, one all-gather per FSDP unit and mesh (``plan.plan_steps``:
  a decoder layer's A/B of every target module in one collective), HSDP over its shard axis;
  FSDP+TP layouts (``_StridedShard``, ``Shard(1)``) through ``full_tensor()``. Base weights never move.
* **What is refused, at construction, on every rank** (``UnsupportedAdapterError`` naming the rank,
  the module and the reason; module structure only, so every rank decides the same): a model
  without a PEFT LoRA adapter (a merged model -- ``merge_and_unload()`` -- has nothing to send:
  use ``FSDPSource``), one holding several ``PeftModel`` objects (which to send?), an adapter
  already merged into the base weights (``merge_adapter()``: serving base + adapter would apply it
  twice), disabled adapters, several active adapters without ``adapter=``, DoRA, ``lora_bias``,
  other LoRA variants, LoRA on anything but a linear layer (embeddings, convolutions),
  ``modules_to_save`` / ``trainable_token_indices`` (vLLM serves none of them: merge and send the
  model instead), non-LoRA tuners.
* **Adapter state is fixed per source**: active adapter, disabled flags and merged adapters are
  re-checked at the start of every pass, before any collective (``AdapterStateError``).
* **Cross-rank agreement**: the first pass verifies that every rank holds the same metadata and the
  same adapter configuration (``verify_metadata_agreement``) before the first gather.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from ..core.check.stream import DEFAULT_TIMEOUT_S, check_stream, verify_metadata_agreement
from ..core.ground.errors import AdapterStateError, UnsupportedAdapterError
from ..core.ground.logs import current_rank, get_logger
from ..core.ground.stats import PassStats
from .gather import BatchedGather, GatherShard
from .lora import own_type
from .plan import fsdp_units, is_member, plan_steps
from .shards import fallback_full, local_of

__all__ = ["LoRAAdapterSource", "AdapterModule", "ADAPTER_DTYPES"]

logger = get_logger(__name__)

#: Floating dtypes an adapter file may carry (safetensors + vLLM's LoRA loader cast them to the
#: server's ``lora_dtype``); anything else is refused.
ADAPTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AdapterModule:
    """One LoRA target: its module path in the base model (``model.layers.0.self_attn.q_proj``),
    rank, the base layer's ``(out_features, in_features)`` and the adapter's dtype."""

    module: str
    rank: int
    out_features: int
    in_features: int
    dtype: torch.dtype


class LoRAAdapterSource(WeightSource):
    """The LoRA adapter of a (sharded) PEFT model, in PEFT's saved names (module docstring).

    Args:
        module: the ``PeftModel`` (``get_peft_model(...)``), plain or ``fully_shard``-ed (FSDP2,
            HSDP, FSDP+TP), possibly wrapped (``torch.compile``, activation checkpointing, DDP), or a
            module holding exactly one (a ``LightningModule``); names are relative to the ``PeftModel``.
        adapter: which adapter to send (default: the one active adapter).
        dtype: dtype of the sent tensors (None: the parameters' own, as PEFT saves them); one of
            ``ADAPTER_DTYPES``.
        check: check each pass's stream against ``metadata`` on this rank.
        agree: verify on the first pass that every rank holds the same metadata and config.
        rank: this trainer rank (default: the default process group's rank).
        timeout_s: bound on the agreement and on each gather (gloo).
    """

    #: the dtypes an adapter may be sent in (``ADAPTER_DTYPES``)
    DTYPES = ADAPTER_DTYPES

    def __init__(
        self,
        module: nn.Module,
        *,
        adapter: str | None = None,
        dtype: torch.dtype | None = None,
        check: bool = True,
        agree: bool = True,
        rank: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module= must be a torch.nn.Module, got {type(module).__name__}")
        self._rank = rank
        if dtype is not None and dtype not in ADAPTER_DTYPES:
            raise ValueError(
                f"rank {self.rank}: LoRAAdapterSource(dtype={dtype}): an adapter is sent as one of "
                f"{[str(d) for d in ADAPTER_DTYPES]}"
            )
        self._module = module
        self.dtype = dtype
        self.check = check
        self.agree = agree
        self.timeout_s = timeout_s
        self._agreed = False
        self.last_pass = PassStats()
        self._discover(adapter)

    # ---- discovery (module structure only) ----------------------------------------------------

    @property
    def rank(self) -> int:
        return current_rank() if self._rank is None else self._rank

    def _err(self, module: str, reason: str) -> UnsupportedAdapterError:
        return UnsupportedAdapterError(f"rank {self.rank}: PEFT module {module!r}: {reason}")

    def _discover(self, adapter: str | None) -> None:
        from ..core.hf.naming import checkpoint_name, wrapper_paths

        try:
            from peft import PeftModel
            from peft.tuners.lora import LoraLayer, LoraModel
            from peft.tuners.lora.layer import Linear as LoraLinear
            from peft.tuners.tuners_utils import BaseTunerLayer
            from peft.utils.other import AuxiliaryTrainingWrapper
        except ImportError as e:  # pragma: no cover - peft is a test dependency
            raise UnsupportedAdapterError(f"rank {self.rank}: LoRAAdapterSource needs peft: {e}") from e

        wrappers = wrapper_paths(self._module)
        mods = [(p, checkpoint_name(p, wrappers), m) for p, m in self._module.named_modules()]
        roots = [(d, m) for _, d, m in mods if isinstance(m, PeftModel)]
        if not roots:
            if any(isinstance(m, BaseTunerLayer) for _, _, m in mods):
                raise self._err("<root>", "LoRA layers without a PeftModel (inject_adapter_in_model?): "
                                "pass the PeftModel get_peft_model returned, whose names PEFT saves")
            raise self._err("<root>", f"{type(self._module).__name__} holds no PEFT adapter -- a merged model "
                            "(merge_and_unload()) or a plain one has no adapter to send; send the whole "
                            "model with FSDPSource instead")
        if len(roots) > 1:
            raise self._err("<root>", f"{len(roots)} PeftModels inside {type(self._module).__name__} "
                            f"({[d or '<root>' for d, _ in roots]}): pass the one whose adapter to send")
        root_path, peft_model = roots[0]
        tuner = peft_model.base_model
        if not isinstance(tuner, LoraModel):
            raise self._err("<root>", f"PEFT tuner {type(tuner).__name__} is not LoRA; only LoRA adapters "
                            "are served by vLLM")
        active = list(tuner.active_adapters)
        if adapter is None:
            if len(active) != 1:
                raise self._err("<root>", f"{len(active)} active adapters {active}: vLLM serves one adapter per "
                                "request; pass adapter= to say which one to send")
            adapter = active[0]
        if adapter not in peft_model.peft_config:
            raise self._err("<root>", f"adapter {adapter!r} does not exist (adapters: "
                            f"{sorted(peft_model.peft_config)})")
        self.adapter = adapter
        self.peft_config = peft_model.peft_config[adapter]
        cfg = self.peft_config
        if getattr(cfg, "modules_to_save", None):
            raise self._err("<root>", f"modules_to_save={list(cfg.modules_to_save)}: vLLM serves LoRA A/B only "
                            "(modules_to_save is refused by its loader); merge and send the whole model "
                            "with FSDPSource instead")
        self._hf_model = tuner.model
        prefix = f"{root_path}." if root_path else ""
        self._params: list[tuple[str, nn.Module, nn.Parameter]] = []  # (peft name, owner, param at build)
        self.modules: list[AdapterModule] = []
        self._layers: list[tuple[str, nn.Module]] = []
        for _, dpath, m in mods:
            if prefix and not dpath.startswith(prefix):
                continue
            rel = dpath[len(prefix):]
            if isinstance(m, AuxiliaryTrainingWrapper):
                raise self._err(rel, f"{type(m).__name__} (modules_to_save / trainable_token_indices): vLLM "
                                "serves LoRA A/B only; merge and send the whole model with FSDPSource instead")
            if not isinstance(m, BaseTunerLayer):
                continue
            if not isinstance(m, LoraLayer):
                raise self._err(rel, f"PEFT layer {type(m).__name__} is not a LoRA layer")
            holds = adapter in getattr(m, "r", {})  # lora_A, or lora_embedding_A for embeddings
            if getattr(m, "merged_adapters", None):
                raise self._err(rel, f"adapter(s) {list(m.merged_adapters)} are merged into the base weight "
                                "(merge_adapter()): serving the base + the adapter would apply it twice; "
                                "unmerge_adapter() first, or send the merged model with FSDPSource")
            if m.disable_adapters:
                raise self._err(rel, "adapters are disabled (disable_adapter() / disable_adapter_layers()): the "
                                "trainer computes the base model; enable them before sending the adapter")
            if not holds:
                continue
            if own_type(m) is not LoraLinear:
                raise self._err(rel, f"LoRA layer type {own_type(m).__name__} (embedding / convolution / "
                                "quantized) is not supported: only LoRA on linear layers is sent")
            if m.use_dora.get(adapter, False):
                raise self._err(rel, f"adapter {adapter!r} uses DoRA (use_dora=True): vLLM refuses DoRA adapters")
            if adapter in getattr(m, "lora_variant", {}):
                raise self._err(rel, f"adapter {adapter!r} uses LoRA variant "
                                f"{type(m.lora_variant[adapter]).__name__}, which vLLM does not serve")
            if m.lora_bias.get(adapter, False):
                raise self._err(rel, f"adapter {adapter!r} has lora_bias=True: vLLM refuses LoRA biases")
            a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
            out_f, in_f = int(m.out_features), int(m.in_features)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[1] != in_f or b.shape[0] != out_f:
                raise self._err(rel, f"adapter {adapter!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not compose "
                                f"with the base layer (out {out_f}, in {in_f})")
            if a.dtype != b.dtype:
                raise self._err(rel, f"adapter {adapter!r}: A is {a.dtype}, B is {b.dtype}")
            base_rel = rel.removeprefix("base_model.model.")
            self.modules.append(AdapterModule(base_rel, int(a.shape[0]), out_f, in_f, a.dtype))
            self._layers.append((rel, m))
            for which, p in (("lora_A", a), ("lora_B", b)):
                self._params.append((f"{rel}.{which}.weight", getattr(m, which)[adapter], p))
        if not self._params:
            raise self._err("<root>", f"adapter {adapter!r} targets no LoRA layer of this model")
        for name, _, p in self._params:
            wd = self.dtype or p.dtype
            if wd not in ADAPTER_DTYPES:
                raise self._err(name, f"dtype {p.dtype} is not one an adapter file carries "
                                f"({[str(d) for d in ADAPTER_DTYPES]}); pass dtype=")
        self._state = self._state_now()
        logger.info("rank %d: LoRA adapter %r: %d module(s), %d tensor(s), %d bytes", self.rank, adapter,
                    len(self.modules), len(self._params), self.nbytes)

    def _state_now(self) -> tuple:
        return tuple(
            (rel, tuple(m.active_adapters), bool(m.disable_adapters), tuple(m.merged_adapters))
            for rel, m in self._layers
        )

    def check_state(self) -> None:
        """Raise ``AdapterStateError`` if active adapters / disabled flags / merged adapters changed
        since construction (before any collective)."""
        now = self._state_now()
        if now != self._state:
            diff = next((a, b) for a, b in zip(self._state, now) if a != b)
            raise AdapterStateError(
                f"rank {self.rank}: PEFT module {diff[0][0]!r}: adapter state (active, disabled, merged) "
                f"changed since the source was built: {diff[0][1:]} -> {diff[1][1:]}; build a new source"
            )

    # ---- metadata (no collective) -------------------------------------------------------------

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.dtype or p.dtype, tuple(p.shape)) for n, _, p in self._params]

    @property
    def nbytes(self) -> int:
        """Bytes of the adapter's tensors as sent (the safetensors payload, headers excluded)."""
        return sum(p.numel() * (self.dtype or p.dtype).itemsize for _, _, p in self._params)

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model inside the tuner (base names, embeddings)."""
        return self._hf_model

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it: the adapter's
        ``LoraConfig`` with ``inference_mode`` true, ``base_model_name_or_path`` from the model,
        sets as (sorted) lists, and ``auto_mapping`` when the config has no ``task_type``."""
        cfg = copy.deepcopy(self.peft_config)
        if cfg.base_model_name_or_path is None:
            cfg.base_model_name_or_path = self._hf_model.__dict__.get("name_or_path", None) or None
        cfg.inference_mode = True
        out = cfg.to_dict()
        for k, v in list(out.items()):
            if isinstance(v, set):
                out[k] = sorted(v)
        if cfg.task_type is None:
            cls = type(self._hf_model)
            cls = own_type(self._hf_model) if cls.__name__.startswith("FSDP") else cls
            out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        return json.loads(json.dumps(out, default=str))

    # ---- passes -------------------------------------------------------------------------------

    def _start_pass(self) -> PassStats:
        stats = self.last_pass.start()
        self.check_state()
        if self.agree and not self._agreed:
            facts = [ParamMeta(f"[config] {json.dumps(self.adapter_config(), sort_keys=True)[:4000]}",
                               torch.uint8, (0,))]
            verify_metadata_agreement(self.metadata + facts, timeout_s=self.timeout_s, what="LoRA adapter metadata")
            self._agreed = True
        return stats

    def _resolve(self) -> list[torch.Tensor]:
        """The adapter parameters as registered now (FSDP2 re-registers them when it unshards)."""
        return [owner._parameters["weight"] for _, owner, _ in self._params]

    def _raw(self, stats: PassStats) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = self._resolve()
        for (name, _, _), t in zip(self._params, tensors):
            if not is_member(t):
                raise UnsupportedAdapterError(
                    f"rank {self.rank}: {name}: this rank is not on the mesh of the tensor (pipeline "
                    "parallel?); every rank must hold a shard of every adapter tensor"
                )
        wds = [m.dtype for m in self.metadata]
        steps = plan_steps(tensors, wds, fsdp_units(self._module), None)
        names = [m.name for m in self.metadata]
        for step in steps:
            if step.kind == "plain":
                i = step.indices[0]
                yield names[i], tensors[i].detach().to(dtype=wds[i]).contiguous()
            elif step.kind == "full":
                i = step.indices[0]
                yield names[i], fallback_full(tensors[i], wds[i], step.device, stats)
            else:
                mesh, axis = step.mesh, step.axis
                if mesh.size(axis) == 1:
                    for i in step.indices:
                        yield names[i], local_of(tensors[i]).to(device=step.device, dtype=wds[i]).contiguous()
                    continue
                shards = [GatherShard(names[i], local_of(tensors[i]), tuple(tensors[i].shape), wds[i])
                          for i in step.indices]
                gather = BatchedGather(shards, group=mesh.get_group(axis), n=mesh.size(axis),
                                       index=mesh.get_local_rank(axis), device=step.device, stats=stats,
                                       timeout_s=self.timeout_s)
                yield from gather  # (name, full tensor), in step order

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every adapter tensor, full, in metadata order (collective on every rank)."""
        stats = self._start_pass()
        raw = self._raw(stats)
        stream = check_stream(raw, self.metadata, rank=self.rank) if self.check else raw
        try:
            for name, tensor in stream:
                stats.yielded(tensor.numel() * tensor.element_size())
                yield name, tensor
        finally:
            stream.close()
            raw.close()
        stats.stop()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{PEFT name: full tensor}`` -- ``get_peft_model_state_dict`` of the unsharded model
        (collective: call on every rank)."""
        return {n: t for n, t in self.iter_full()}

    def __repr__(self) -> str:
        return f"LoRAAdapterSource(adapter={self.adapter!r}, tensors={len(self._params)}, dtype={self.dtype})"
