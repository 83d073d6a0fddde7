"""``FP8Config``: which tensors of a Hugging Face checkpoint are FP8, and how -- read from the served
model's ``quantization_config`` (or an FP8 checkpoint folder), or a documented default.

Invariant: ``FP8Config.plan(name, shape)`` is a pure function of a checkpoint name and its full
shape, so every rank derives the same quantized metadata without communicating, before any byte
moves; and it names what an FP8 checkpoint of the same model holds:

* a quantized Linear weight ``<module>.weight`` -> ``<module>.weight`` (``float8_e4m3fn``, same shape)
  followed by ``<module>.weight_scale_inv`` (float32 ``[ceil(N/bN), ceil(K/bK)]``);
* fused experts ``<layer>.experts.gate_up_proj`` ``[E, 2I, H]`` / ``.down_proj`` ``[E, H, I]`` (the
  transformers in-memory layout, ``expert_layout="fused"``) -> the FP8 tensor followed by
  ``<name>_scale_inv``. vLLM 0.33 and 0.34 load that pair: its fused-expert mapping turns
  ``experts.gate_up_proj_scale_inv`` into ``w13_weight_scale_inv`` and splits it in two like the weight
  (``RoutedExperts.load_weights``, block scales share the weight's layout). Its parameter holds the
  gate and the up half's blocks separately (``2 * ceil(I/bN)`` rows), so gate and up are quantized as
  two tensors and their scales concatenated -- the scale follows the concat its weight went through;
  when ``I`` is a block multiple that equals quantizing the fused tensor.
* everything else unchanged.

The default (no config): 2-D ``.weight`` tensors of linear layers -- attention, MLA, dense MLP,
experts, shared experts -- are quantized; embeddings, ``lm_head``, norms, routers / gates and their
score-correction biases, biases, sinks, DSA indexer ``weights_proj``, convolutions and anything 1-D
stay as they are, as in the FP8 checkpoints of the families weightsync maps (DeepSeek-V3, Qwen3-FP8,
GLM-4.5-FP8). ``modules_to_not_convert`` / ``ignored_layers`` add exclusions with transformers'
matching rule (exact name, prefix, suffix or regex). Given an FP8 checkpoint folder, the set of
quantized modules is exactly the set that has a ``weight_scale_inv`` there.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.ground.errors import FP8ConfigError
from .fp8 import RULES, SCALE_FORMATS, scale_shape

__all__ = ["FP8Config", "QuantPlan", "DEFAULT_NOT_CONVERTED"]


#: Leaf module names never quantized by default (``re.search`` on the module path).
DEFAULT_NOT_CONVERTED: tuple[str, ...] = (
    r"(^|\.)embed_tokens$",
    r"(^|\.)lm_head$",
    r"norm$",  # input/post-attention/q/k/kv_a/final norms, indexer k_norm
    r"(^|\.)(mlp|block_sparse_moe)\.gate$",  # MoE routers
    r"(^|\.)router$",
    r"(^|\.)shared_expert_gate$",
    r"(^|\.)weights_proj$",  # DSA indexer head weights: bf16 in DeepSeek-V3.2's FP8 checkpoint
)

_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.(gate_up_proj|down_proj)$")


class QuantPlan(NamedTuple):
    """How one checkpoint tensor travels quantized: its scale's name and shape, and how many equal
    parts along dim -2 are quantized separately (2 for a fused gate/up, else 1)."""

    scale_name: str
    scale_shape: tuple[int, ...]
    parts: int


@dataclass(frozen=True)
class FP8Config:
    """Block-wise FP8 for the wire and for checkpoints (``fmt="e4m3"``, ``float8_e4m3fn``).

    ``block``: ``weight_block_size`` ``(bN, bK)``; ``scale_fmt``: None or ``"ue8m0"``;
    ``rule``: whose numerics (``"vllm"``, default, or ``"transformers"``; see ``quant.fp8``);
    ``not_convert``: ``modules_to_not_convert`` / ``ignored_layers`` patterns (added to the default
    exclusions); ``modules``: when set, exactly the module names to quantize (from a checkpoint).
    """

    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    rule: str = "vllm"
    activation_scheme: str = "dynamic"
    not_convert: tuple[str, ...] = ()
    modules: frozenset[str] | None = None
    #: scale shapes a checkpoint folder declares (name -> shape), compared with the plan's
    expected_scales: Mapping[str, tuple[int, ...]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        block = tuple(int(b) for b in self.block) if self.block is not None else None
        if block is None or len(block) != 2 or min(block) <= 0:
            raise FP8ConfigError(
                f"FP8Config(block={self.block!r}): weight_block_size must be two positive ints; "
                "weightsync sends block-wise FP8 (per-tensor/per-channel schemes are not supported)"
            )
        object.__setattr__(self, "block", block)
        if self.scale_fmt not in SCALE_FORMATS:
            raise FP8ConfigError(f"FP8Config(scale_fmt={self.scale_fmt!r}): must be one of {SCALE_FORMATS}")
        if self.rule not in RULES:
            raise FP8ConfigError(f"FP8Config(rule={self.rule!r}): must be one of {RULES}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise FP8ConfigError(f"FP8Config(activation_scheme={self.activation_scheme!r}): dynamic or static")
        object.__setattr__(self, "not_convert", tuple(self.not_convert or ()))

    # ---- reading --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Any, *, rule: str = "vllm") -> "FP8Config":
        """From a ``quantization_config`` dict, a transformers config (or dict) carrying one, a
        ``config.json`` path, or an FP8 checkpoint folder (then the quantized set is the folder's)."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                return cls.from_checkpoint(path, rule=rule)
            with open(path) as f:
                config = json.load(f)
        if not isinstance(config, Mapping):
            q = getattr(config, "quantization_config", None)
            if q is None:
                raise FP8ConfigError(
                    f"FP8Config.from_hf: {type(config).__name__} has no quantization_config "
                    "(pass the served model's config, or FP8Config() for the default)"
                )
            config = q if isinstance(q, Mapping) else q.to_dict()
        config = dict(config.get("quantization_config", config))
        method = config.get("quant_method")
        if method != "fp8":
            raise FP8ConfigError(f"quantization_config.quant_method={method!r}: weightsync sends 'fp8' only")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise FP8ConfigError(f"quantization_config.fmt={fmt!r}: weightsync sends e4m3 (float8_e4m3fn) only")
        block = config.get("weight_block_size")
        if block is None:
            raise FP8ConfigError(
                "quantization_config has no weight_block_size: that is per-tensor FP8 "
                "(weight_scale), which weightsync does not send; block-wise only"
            )
        skip = list(config.get("modules_to_not_convert") or []) + list(config.get("ignored_layers") or [])
        return cls(
            block=tuple(block), scale_fmt=config.get("scale_fmt"), rule=rule,
            activation_scheme=config.get("activation_scheme", "dynamic"), not_convert=tuple(skip),
        )

    @classmethod
    def from_checkpoint(cls, folder: str, *, rule: str = "vllm") -> "FP8Config":
        """An FP8 checkpoint folder: its ``config.json``'s ``quantization_config``, and exactly the
        modules it holds a ``weight_scale_inv`` for (with those scales' shapes, checked later)."""
        from ..checkpoint.format import read_checkpoint  # noqa: PLC0415 - reader imports safetensors

        with open(os.path.join(folder, "config.json")) as f:
            base = cls.from_hf(json.load(f), rule=rule)
        layout = read_checkpoint(folder)
        scales = {e.name: tuple(e.shape) for _, e in layout.entries() if e.name.endswith("_scale_inv")}
        modules = frozenset(_module_of_scale(n) for n in scales)
        return cls(
            block=base.block, scale_fmt=base.scale_fmt, rule=rule, activation_scheme=base.activation_scheme,
            not_convert=base.not_convert, modules=modules, expected_scales=scales,
        )

    # ---- the plan ---------------------------------------------------------------------------

    def plan(self, name: str, shape: tuple[int, ...]) -> QuantPlan | None:
        """How ``name`` (full shape ``shape``) travels quantized, or None (as it is)."""
        fused = _FUSED_EXPERTS.search(name)
        if fused:
            if len(shape) != 3:
                return None
            module, scale_name = name, name + "_scale_inv"
        elif name.endswith(".weight") and len(shape) == 2:
            module, scale_name = name[: -len(".weight")], name[: -len("weight")] + "weight_scale_inv"
        else:
            return None
        if self.modules is not None:
            if module not in self.modules:
                return None
        elif any(re.search(p, module) for p in DEFAULT_NOT_CONVERTED) or _skipped(module, self.not_convert):
            return None
        parts = 2 if fused and fused.group(2) == "gate_up_proj" else 1
        if parts == 2 and shape[-2] % 2:
            raise FP8ConfigError(f"{name}: a fused gate/up tensor needs an even dim -2, got {tuple(shape)}")
        half = (*shape[:-2], shape[-2] // parts, shape[-1])
        s = scale_shape(half, self.block)
        return QuantPlan(scale_name, (*s[:-2], s[-2] * parts, s[-1]), parts)

    def check_covers(self, names_shapes: Iterable[tuple[str, tuple[int, ...]]], *, rank: int, what: str) -> None:
        """With a checkpoint's module set: every module it quantizes must be one the source sends,
        with the scale shape the checkpoint holds (block size, fused layout). Raises ``FP8ConfigError``
        naming the first difference; a pure function of metadata, so it raises on every rank."""
        if self.modules is None:
            return
        planned: dict[str, tuple[int, ...]] = {}
        for name, shape in names_shapes:
            p = self.plan(name, shape)
            if p is not None:
                planned[_module_of_scale(p.scale_name)] = p.scale_shape
        missing = sorted(self.modules - planned.keys())
        if missing:
            raise FP8ConfigError(
                f"rank {rank}: {what}: the FP8 checkpoint quantizes {len(missing)} module(s) the trainer's "
                f"model does not send, e.g. {missing[0]!r} (is it the same model, with the same expert_layout?)"
            )
        for module, got in planned.items():
            want = (self.expected_scales or {}).get(_scale_name_of(module, self.expected_scales or {}))
            if want is not None and tuple(want) != tuple(got):
                raise FP8ConfigError(
                    f"rank {rank}: {what}: {module}: the FP8 checkpoint's scale has shape {tuple(want)}, "
                    f"quantizing the trainer's tensor with weight_block_size={list(self.block)} gives {tuple(got)}"
                )

    # ---- writing ---------------------------------------------------------------------------

    def to_hf(self, kept_linear: Iterable[str] = ()) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint of this plan carries (vLLM's ``Fp8Config`` and
        transformers' ``FineGrainedFP8Config`` read it); ``kept_linear``: the Linear modules sent
        unquantized, listed by full name (vLLM matches ``modules_to_not_convert`` exactly)."""
        out: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.block),
        }
        if self.scale_fmt is not None:
            out["scale_fmt"] = self.scale_fmt
        # lm_head always: a tied model sends none, yet a loader builds one (never quantized by default)
        kept = sorted(set(kept_linear) | ({"lm_head"} if self.modules is None or "lm_head" not in self.modules else set()))
        if kept:
            out["modules_to_not_convert"] = kept
        return out


def _skipped(module: str, patterns: tuple[str, ...]) -> bool:
    """transformers' ``should_convert_module`` rule, negated (a superset of vLLM's exact match)."""
    for key in patterns:
        try:
            if re.match(f"{key}\\.", module) or re.match(key, module):
                return True
        except re.error:
            pass
        if module == key or module.endswith(key):
            return True
    return False


def _module_of_scale(scale_name: str) -> str:
    if scale_name.endswith(".weight_scale_inv"):
        return scale_name[: -len(".weight_scale_inv")]
    return scale_name[: -len("_scale_inv")]


def _scale_name_of(module: str, scales: Mapping[str, Any]) -> str:
    name = module + ".weight_scale_inv"
    return name if name in scales else module + "_scale_inv"
