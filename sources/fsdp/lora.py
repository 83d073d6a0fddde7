"""PEFT LoRA adapters as a merge on export: the base checkpoint's tensors, never ``lora_A``/``lora_B``.

Invariant: for a PEFT LoRA model, the tensors a source exports are exactly what
``peft_model.merge_and_unload().save_pretrained()`` would write -- same names, shapes and (fp32)
bytes -- computed from the gathered tensors *without touching the model*:

    W_ckpt = W_base + scaling[a] * (B_a @ A_a)          (transposed when ``fan_in_fan_out``)

summed over the layer's active adapters in ``active_adapters`` order, each term added in turn (the
order ``LoraLayer.merge`` adds them). Nothing is written to the model: parameters, ``requires_grad``,
``merged_adapters``, the active/disabled state stay bit-for-bit what they were, however many passes
run. (TRL's ``merge_adapter()`` / push / ``unmerge_adapter()`` mutates the trainer's weights, and in
bf16 the round trip drifts them.)

What this module decides (pure functions of module structure and adapter state; no tensor data, no
collective, so every rank decides the same):

* **Names**: a LoRA layer's ``base_layer`` is transparent (``q_proj.base_layer.weight`` ->
  ``q_proj.weight``); the tuner prefix (``base_model.model.``) goes; ``lora_*`` tensors are inputs of
  a merge, never outputs. A ``ModulesToSaveWrapper`` exports the active adapter's trained copy
  (``norm.modules_to_save.default.weight`` -> ``norm.weight``) and drops ``original_module``.
* **Which adapters**: those ``merge_and_unload()`` merges -- the layer's ``active_adapters`` that it
  holds -- minus any already in ``merged_adapters`` (their delta is already in the base weight; peft
  skips them too). **Disabled adapters** (``with model.disable_adapter():`` or
  ``disable_adapter_layers()``) export what the model then computes: the base weights and the
  original ``modules_to_save`` modules. (``merge_and_unload()`` merges even when adapters are
  disabled; we follow the forward pass instead, since vLLM must serve what the trainer computes.)
  **No active adapter** on a layer exports its base weight. An adapter already merged
  (``merge_adapter()``) is in the stored base weight and goes out as such, disabled or not.
* **Adapter state is fixed per source**: which tensors are gathered depends on it, and every rank
  must gather the same ones. The active adapters and the disabled flags seen at construction are
  re-checked at the start of every pass; a change raises ``AdapterStateError`` before any collective
  (build a new source after ``set_adapter``). ``scaling`` and ``merged_adapters`` are values, read
  afresh at every pass.
* **Unsupported -> error at construction, never wrong weights**: DoRA (``use_dora``) and every other
  LoRA variant, ``lora_bias=True``, LoRA on embeddings / convolutions / quantized or custom layers
  (only ``nn.Linear`` and transformers' GPT-2 ``Conv1D`` bases merge),
  any non-LoRA tuner (IA3, LoKr, ...) or auxiliary wrapper other than ``modules_to_save``
  (``trainable_token_indices``), LoRA or ``modules_to_save`` on a tied weight, and shapes that do not
  compose raise ``UnsupportedAdapterError`` naming the module, the reason and the rank.

Precision: the merge runs in ``promote(W, A, B, float32)`` -- fp32 for fp32/bf16/fp16 parameters --
and rounds once, to the wire dtype, afterwards. For fp32 parameters this is peft's own op order
(``W += transpose(B @ A) * scaling`` in fp32), so the result equals ``merge_and_unload()`` bit for bit,
and with a bf16 wire it equals ``merge_and_unload()`` followed by ``.to(bfloat16)``. For bf16
parameters peft's own merge rounds the delta to bf16 and rounds again when adding it in bf16; we
return peft's merge of the fp32 upcast rounded once, which is elementwise never farther from the
exact merge than peft's bf16 result (where W and the delta nearly cancel, peft's double rounding
can be off by many ulps of the result). The cost: a merged weight and its A/B are gathered in
their own dtype, not pre-cast to the wire dtype (twice the bytes for fp32 bases on a bf16 wire).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..core.ground.errors import AdapterStateError, UnsupportedAdapterError
from ..core.ground.logs import current_rank, get_logger

__all__ = [
    "UnsupportedAdapterError",
    "AdapterStateError",
    "LoraTerm",
    "LoraMerge",
    "LoraPlan",
    "merge_lora",
]

logger = get_logger(__name__)


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's contribution to one base weight: in-memory paths of its A and B weights."""

    adapter: str
    a_path: str
    b_path: str


@dataclass(frozen=True)
class LoraMerge:
    """One base weight and the LoRA terms merged into it.

    ``layer`` is the ``LoraLayer`` itself: ``scaling[adapter]``, ``fan_in_fan_out`` and
    ``merged_adapters`` are read from it at every pass (values, not structure).
    """

    module: str  # de-wrapped module path, for messages
    layer: nn.Module
    terms: tuple[LoraTerm, ...]

    def scalings(self) -> list[float | None]:
        """Per term: its scaling, or None when the adapter is already merged into the base."""
        merged = set(getattr(self.layer, "merged_adapters", ()) or ())
        return [None if t.adapter in merged else float(self.layer.scaling[t.adapter]) for t in self.terms]


def merge_lora(
    base: torch.Tensor,
    terms: Sequence[tuple[torch.Tensor, torch.Tensor, float | None]],
    *,
    fan_in_fan_out: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``base + sum_k scaling_k * (B_k @ A_k)`` (``.T`` when ``fan_in_fan_out``), in
    ``promote(base, A, B, float32)``, rounded once to ``out_dtype``. Terms with scaling None are
    skipped. Never writes to its inputs; returns a fresh contiguous tensor."""
    acc = torch.promote_types(base.dtype, torch.float32)
    for a, b, _ in terms:
        acc = torch.promote_types(acc, torch.promote_types(a.dtype, b.dtype))
    w = base.to(dtype=acc, copy=True)
    for a, b, scaling in terms:
        if scaling is None:
            continue
        delta = b.to(acc) @ a.to(acc)
        if fan_in_fan_out:
            delta = delta.T
        w += delta * scaling
    return w.to(out_dtype).contiguous()


#: Why a LoRA layer class other than ``lora.Linear`` cannot be merged, by class name.
_LAYER_KINDS = {
    "Embedding": "LoRA on an embedding",
    "Conv1d": "LoRA on a convolution",
    "Conv2d": "LoRA on a convolution",
    "Conv3d": "LoRA on a convolution",
}


def own_type(m: nn.Module) -> type:
    """``type(m)``, looking through the class ``fully_shard`` swaps in (``FSDP<cls>(FSDPModule, cls)``)."""
    cls = type(m)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _is_linear(base: nn.Module) -> bool:
    """nn.Linear (weight [out, in]) or transformers' GPT-2-style Conv1D (weight [in, out], which peft
    merges with ``fan_in_fan_out=True``); the shape check in ``LoraPlan`` ties layout to the flag."""
    if own_type(base) is nn.Linear:
        return True
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return own_type(base) is Conv1D


def _peft_in(module: nn.Module) -> bool:
    """Cheap pre-check (no peft import): does any submodule come from peft?"""
    return any(type(m).__module__.startswith("peft.") for m in module.modules())


class LoraPlan:
    """How a PEFT LoRA model maps onto its base checkpoint (see the module docstring).

    ``hf_model``: the transformers model inside the tuner (``peft_model.base_model.model``): the
    root for checkpoint naming (tied weights, conversions, ``_keys_to_ignore_on_save``).
    ``rename(path)``: de-wrapped in-memory path -> checkpoint name, or None for tensors that are not
    exported (``lora_*``, ``original_module``, inactive ``modules_to_save`` copies).
    ``merges``: in-memory path of a base weight -> its ``LoraMerge`` (only layers with terms).
    ``lora_layers`` / ``modules_to_save``: what was found, by module path (counted in the log).
    """

    def __init__(self, module: nn.Module, *, rank: int | None = None) -> None:
        from peft.tuners.lora import LoraLayer, LoraModel
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        from ..core.hf.naming import checkpoint_name, wrapper_paths

        self._rank = rank
        wrappers = wrapper_paths(module)
        mods = [(p, checkpoint_name(p, wrappers), m) for p, m in module.named_modules(remove_duplicate=False)]

        tuners = [(d, m) for _, d, m in mods if isinstance(m, BaseTuner)]
        if not tuners:
            raise self._err("<root>", "a PEFT model without a tuner model (prompt learning?); "
                            "only LoRA merges are exported")
        if len({id(m) for _, m in tuners}) > 1:
            raise self._err(tuners[1][0] or "<root>", "more than one PEFT tuner model in one module")
        tpath, tuner = tuners[0]
        if not isinstance(tuner, LoraModel):
            raise self._err(tpath or "<root>", f"PEFT tuner {type(tuner).__name__} is not LoRA; "
                            "only LoRA merges are exported")
        self.hf_model: nn.Module = tuner.model
        self._hf_prefix = f"{tpath}.model" if tpath else "model"

        # Every tensor path and which object it is (for tie detection).
        owner_paths: dict[int, set[str]] = {}
        for p, t in module.named_parameters(remove_duplicate=False):
            owner_paths.setdefault(id(t), set()).add(checkpoint_name(p, wrappers))

        self._transparent: set[str] = set()  # in-memory rel paths whose 'base_layer' child is skipped
        #: module paths (relative to ``hf_model``) of the LoRA layers
        self.lora_layers: set[str] = set()
        #: module path (relative to ``hf_model``) of each ``modules_to_save`` wrapper -> the adapter
        #: copy exported (None: ``original_module``)
        self.modules_to_save: dict[str, str | None] = {}
        self._state: list[tuple[str, nn.Module, tuple]] = []
        self.merges: dict[str, LoraMerge] = {}
        seen: set[int] = set()
        for raw, dpath, m in mods:
            if id(m) in seen:
                continue
            inside = dpath == self._hf_prefix or dpath.startswith(self._hf_prefix + ".")
            if isinstance(m, AuxiliaryTrainingWrapper):
                seen.add(id(m))
                if not isinstance(m, ModulesToSaveWrapper):
                    raise self._err(dpath, f"{type(m).__name__} (e.g. trainable_token_indices) is not supported; "
                                    "only LoRA and modules_to_save are exported")
                if not inside:
                    raise self._err(dpath, "modules_to_save wrapper outside the tuner's model")
                rel = self._rel(dpath)
                use = self._mts_choice(m)
                for n, t in m.named_parameters(remove_duplicate=False):
                    others = owner_paths.get(id(t), set()) - {f"{dpath}.{n}"}
                    if others and not n.startswith("modules_to_save."):
                        raise self._err(dpath, f"modules_to_save on a tied weight ({n} is also {sorted(others)[0]}): "
                                        "the trained copy would untie it; export cannot match the model")
                self.modules_to_save[rel] = use
                self._state.append((dpath, m, self._state_of(m)))
                continue
            if not isinstance(m, BaseTunerLayer):
                continue
            seen.add(id(m))
            if not isinstance(m, LoraLayer):
                raise self._err(dpath, f"PEFT layer {type(m).__name__} is not a LoRA layer")
            if own_type(m) is not LoraLinear:
                kind = own_type(m).__name__
                why = _LAYER_KINDS.get(kind, f"LoRA layer type {own_type(m).__module__}.{kind}")
                raise self._err(dpath, f"{why} is not supported (only peft.tuners.lora.Linear over a "
                                "linear layer merges exactly)")
            if not inside:
                raise self._err(dpath, "LoRA layer outside the tuner's model")
            self._add_linear(raw, dpath, m, owner_paths)

    # ---- discovery helpers ----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return current_rank() if self._rank is None else self._rank

    def _err(self, module: str, reason: str) -> UnsupportedAdapterError:
        return UnsupportedAdapterError(f"rank {self.rank}: PEFT module {module!r}: {reason}")

    def _rel(self, dpath: str) -> str:
        return "" if dpath == self._hf_prefix else dpath[len(self._hf_prefix) + 1 :]

    @staticmethod
    def _state_of(m: nn.Module) -> tuple:
        return (tuple(m.active_adapters), bool(m.disable_adapters))

    @staticmethod
    def _mts_choice(m: nn.Module) -> str | None:
        """The copy a ModulesToSaveWrapper's forward uses: the first active adapter's, or None
        (``original_module``) when disabled / no active adapter / an active adapter it lacks."""
        active = list(m.active_adapters)
        if m.disable_adapters or not active or any(a not in m.modules_to_save for a in active):
            return None
        return active[0]

    def _add_linear(self, raw: str, dpath: str, m: nn.Module, owner_paths: dict[int, set[str]]) -> None:
        rel = self._rel(dpath)
        self.lora_layers.add(rel)
        self._transparent.add(rel)
        base, braw, brel = m, raw, rel
        while hasattr(base, "base_layer"):
            base = base.base_layer
            braw, brel = f"{braw}.base_layer", f"{brel}.base_layer"
            self._transparent.add(brel)
        self._transparent.discard(brel)  # the innermost base layer itself is a real module
        if not _is_linear(base):
            raise self._err(dpath, f"LoRA over {own_type(base).__name__} is not supported (only nn.Linear and "
                            "transformers' Conv1D)")
        self._state.append((dpath, m, self._state_of(m)))
        if m.disable_adapters:
            return
        w = base.weight
        others = owner_paths.get(id(w), set()) - {f"{self._hf_prefix}.{brel}.weight"}
        terms = []
        for a in m.active_adapters:
            if a not in m.lora_A:
                continue  # adapter does not target this layer: merge_and_unload skips it too
            if a in getattr(m, "lora_variant", {}) or m.use_dora.get(a, False):
                if m.use_dora.get(a, False):
                    what = "DoRA (use_dora=True)"
                else:
                    what = f"LoRA variant {type(m.lora_variant[a]).__name__}"
                raise self._err(dpath, f"adapter {a!r} uses {what}, whose merge is not W + scaling * B @ A")
            if m.lora_bias.get(a, False):
                raise self._err(dpath, f"adapter {a!r} has lora_bias=True (a trained bias delta) -- not supported")
            if others:
                raise self._err(dpath, f"LoRA on a tied weight (also {sorted(others)[0]}): merging would change both")
            A, B = m.lora_A[a].weight, m.lora_B[a].weight
            out_f, in_f = (w.shape[1], w.shape[0]) if m.fan_in_fan_out else tuple(w.shape)
            if A.dim() != 2 or B.dim() != 2 or A.shape[1] != in_f or B.shape[0] != out_f or A.shape[0] != B.shape[1]:
                raise self._err(dpath, f"adapter {a!r}: A {tuple(A.shape)} / B {tuple(B.shape)} do not compose with "
                                f"the base weight {tuple(w.shape)} (fan_in_fan_out={m.fan_in_fan_out})")
            terms.append(LoraTerm(a, f"{raw}.lora_A.{a}.weight", f"{raw}.lora_B.{a}.weight"))
        if terms:
            self.merges[f"{braw}.weight"] = LoraMerge(dpath, m, tuple(terms))

    # ---- names ----------------------------------------------------------------------------------

    def rename(self, name: str) -> str | None:
        """Checkpoint name of the de-wrapped in-memory tensor path ``name``; None: not exported."""
        if not name.startswith(self._hf_prefix + "."):
            return name
        parts = self._rel(name).split(".")
        out: list[str] = []
        prefix = ""
        i = 0
        while i < len(parts):
            seg = parts[i]
            if prefix in self._transparent:
                if seg != "base_layer":
                    return None  # lora_A / lora_B / lora_dropout / magnitude vectors ...
                prefix = f"{prefix}.{seg}" if prefix else seg
                i += 1
                continue
            if prefix in self.modules_to_save:
                use = self.modules_to_save[prefix]
                if seg == "original_module" and use is None:
                    prefix, i = f"{prefix}.{seg}", i + 1
                    continue
                if seg == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == use:
                    prefix, i = f"{prefix}.{seg}.{use}", i + 2
                    continue
                return None
            out.append(seg)
            prefix = f"{prefix}.{seg}" if prefix else seg
            i += 1
        return ".".join(out)

    # ---- per pass ---------------------------------------------------------------------------------

    def check_state(self) -> None:
        """Raise ``AdapterStateError`` if active adapters / disabled flags changed since construction."""
        for dpath, m, was in self._state:
            now = self._state_of(m)
            if now != was:
                raise AdapterStateError(
                    f"rank {self.rank}: PEFT module {dpath!r}: adapter state changed since the source was "
                    f"built (active adapters, disabled) {was} -> {now}; which tensors are gathered depends "
                    "on it, so build a new source after set_adapter / enable_adapter_layers"
                )

    @classmethod
    def for_module(cls, module: nn.Module, *, rank: int | None = None) -> "LoraPlan | None":
        """The plan for a PEFT model, or None when ``module`` holds no PEFT module (no peft import)."""
        if not _peft_in(module):
            return None
        plan = cls(module, rank=rank)
        logger.info(
            "PEFT LoRA: %d base weight(s) merged on export (%d LoRA layer(s), %d modules_to_save)",
            len(plan.merges), len(plan.lora_layers), len(plan.modules_to_save),
        )
        return plan
