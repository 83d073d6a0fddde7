"""Routed-expert layouts: one MoE layer's experts named and shaped in the two wire layouts vLLM 0.33
and 0.34 load, derived from transformers' own save-time reversal.

Both sources (FSDP2 over transformers-5 models, Megatron-core) end up here, so the expert layout
math lives once (the streaming that uses it -- views, buffers, the per-name transform -- is
``experts.py``):

* ``ExpertLayerSpec`` -- the checkpoint names and shapes of one MoE layer's routed experts:
  ``E`` experts of ``gate``/``up`` ``[I, H]`` and ``down`` ``[H, I]``, plus the two fused names.
  ``expert_names`` derives it for transformers models from transformers' own conversion mapping
  (``revert_weight_conversion``, the function ``save_pretrained`` calls), never from a table here.
* ``per_expert`` wire layout: ``{prefix}.{e}.{gate}`` / ``{up}`` / ``{down}`` -- exactly the names
  ``save_pretrained`` writes (``gate_proj.weight`` ..., Mixtral ``w1/w3/w2.weight``).
* ``fused`` wire layout: ``{prefix}.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
  ``{prefix}.down_proj`` ``[E, H, I]``; Mixtral-named checkpoints use ``w13`` / ``w2``. These are the
  names the routed-expert loader of vLLM 0.33 and 0.34 maps for fused checkpoints
  (``RoutedExperts.make_expert_params_mapping``: ``gate_proj``+``up_proj`` -> ``gate_up_proj``,
  ``w1``+``w3`` -> ``w13``; the down name is the checkpoint's own), chunked in two along dim 1.
* Checkpoints that keep the fused tensors (``saved="fused"``: transformers' reversal leaves them as
  they are -- GPT-OSS): the ``fused`` wire layout is the in-memory tensors under their own names, in
  the layout the transformers experts module declares (``is_transposed``: ``[E, H, 2I]`` /
  ``[E, I, H]``; ``is_concatenated=False``: gate and up alternate along the ``2I`` dim;
  ``has_bias``: ``gate_up_proj_bias`` ``[E, 2I]`` / ``down_proj_bias`` ``[E, H]``). Their
  ``per_expert`` layout is each fused tensor's slice ``[e]`` as ``{prefix}.{e}.{leaf}`` -- the
  per-expert names the gpt_oss loader of vLLM 0.33 and 0.34 streams (``_try_load_streamed_expert``); transformers
  itself never writes them.

Names and shapes only: no tensor data beyond meta tensors and small index probes, no collective,
so every rank derives the same specs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..ground.errors import UnmappedParameterError
from .naming import WRAPPER_SEGMENTS

__all__ = [
    "ExpertLayout",
    "EXPERT_LAYOUTS",
    "Part",
    "ExpertLayerSpec",
    "is_fused_expert_param",
    "expert_names",
    "check_expert_layout",
    "default_expert_layout",
]

ExpertLayout = Literal["per_expert", "fused"]
EXPERT_LAYOUTS: tuple[str, ...] = ("per_expert", "fused")

#: transformers-5 in-memory leaf names of fused routed experts (no ``.weight``; their biases add
#: ``_bias``: ``ExpertLayerSpec.part_of``).
_FUSED_LEAVES = ("gate_up_proj", "down_proj")

#: A fused tensor of one layer's experts: its in-memory leaf name.
Part = Literal["gate_up", "gate_up_bias", "down", "down_bias"]
_LEAF: dict[str, str] = {
    "gate_up": "gate_up_proj", "gate_up_bias": "gate_up_proj_bias", "down": "down_proj", "down_bias": "down_proj_bias",
}
_PART: dict[str, str] = {leaf: part for part, leaf in _LEAF.items()}

#: vLLM's (0.33, 0.34) fused gate/up name per checkpoint (gate, up) leaf pair (routed_experts.py).
_VLLM_FUSED_GATE_UP = {("gate_proj", "up_proj"): "gate_up_proj", ("w1", "w3"): "w13"}


def check_expert_layout(expert_layout: str | None, *, where: str = "expert_layout") -> str | None:
    """Validate a user's ``expert_layout`` option (``None`` = the target checkpoint's layout)."""
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(
            f"{where}={expert_layout!r} is not one of {EXPERT_LAYOUTS} (or None for the layout the "
            "target checkpoint uses)"
        )
    return expert_layout


def default_expert_layout(spec: "ExpertLayerSpec | None" = None) -> ExpertLayout:
    """The layout the target checkpoint uses: ``spec.saved`` -- per expert for Qwen2/3-MoE,
    Mixtral, DeepSeek-V3, GLM-4.5; fused for GPT-OSS -- and per expert without a spec."""
    return spec.saved if spec is not None else "per_expert"


@dataclass(frozen=True)
class ExpertLayerSpec:
    """One MoE layer's routed experts in checkpoint terms.

    ``prefix`` ends in ``.experts`` (e.g. ``model.layers.3.mlp.experts``,
    ``model.layers.3.block_sparse_moe.experts``); ``gate``/``up``/``down`` are the per-expert leaves
    (``gate_proj.weight`` / ``w1.weight`` ...). ``gate`` and ``up`` are ``[intermediate, hidden]``,
    ``down`` is ``[hidden, intermediate]``.

    ``saved="fused"``: the checkpoint holds the in-memory fused tensors as they are (their names
    are ``{prefix}.gate_up_proj`` ...); ``transposed`` / ``interleaved`` / ``bias`` describe that
    in-memory layout (module docstring). The per-expert leaves above are then unused: per-expert
    names are ``{prefix}.{e}.gate_up_proj`` ... (``expert_name(e, part)``).
    """

    prefix: str
    num_experts: int
    hidden: int
    intermediate: int
    gate: str = "gate_proj.weight"
    up: str = "up_proj.weight"
    down: str = "down_proj.weight"
    saved: ExpertLayout = "per_expert"
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        for field_name in ("num_experts", "hidden", "intermediate"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{self.prefix}: {field_name} must be positive, got {getattr(self, field_name)}")
        if self.saved not in EXPERT_LAYOUTS:
            raise ValueError(f"{self.prefix}: saved={self.saved!r} is not one of {EXPERT_LAYOUTS}")
        if self.saved == "per_expert" and (self.transposed or self.interleaved or self.bias):
            raise UnmappedParameterError(
                f"{self.prefix}: a per-expert checkpoint of transposed / interleaved / biased experts "
                "is not supported (transformers writes such experts fused)"
            )

    @property
    def parts(self) -> tuple[Part, ...]:
        """This layer's fused tensors, in transformers' in-memory order."""
        return ("gate_up", "gate_up_bias", "down", "down_bias") if self.bias else ("gate_up", "down")

    def part_of(self, leaf: str) -> Part | None:
        """The fused tensor of this layer whose in-memory leaf name is ``leaf`` (``gate_up_proj``,
        ``down_proj`` and, for biased experts, their ``_bias``), or None when it has no such tensor."""
        part = _PART.get(leaf)
        return part if part is not None and part in self.parts else None

    # -- names -----------------------------------------------------------------------------------
    def expert_name(self, e: int, which: str) -> str:
        """Per-expert wire name: ``which`` is ``gate``/``up``/``down`` (checkpoints stored per
        expert) or a ``Part`` (checkpoints stored fused: vLLM's streamed per-expert names)."""
        if self.saved == "fused":
            return f"{self.prefix}.{e}.{_LEAF[which]}"
        return f"{self.prefix}.{e}.{getattr(self, which)}"

    def fused_name(self, part: Part) -> str:
        if part == "gate_up":
            return self.fused_gate_up
        if part == "down":
            return self.fused_down
        return f"{self.prefix}.{_LEAF[part]}"

    @property
    def fused_gate_up(self) -> str:
        if self.saved == "fused":
            return f"{self.prefix}.gate_up_proj"
        pair = (self.gate.removesuffix(".weight"), self.up.removesuffix(".weight"))
        if pair not in _VLLM_FUSED_GATE_UP:
            raise UnmappedParameterError(
                f"{self.prefix}: vLLM (0.33, 0.34) has no fused name for gate/up leaves {pair}; "
                "use expert_layout='per_expert'"
            )
        return f"{self.prefix}.{_VLLM_FUSED_GATE_UP[pair]}"

    @property
    def fused_down(self) -> str:
        if self.saved == "fused":
            return f"{self.prefix}.down_proj"
        return f"{self.prefix}.{self.down.removesuffix('.weight')}"

    # -- shapes ----------------------------------------------------------------------------------
    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        e, i, h = self.num_experts, self.intermediate, self.hidden
        return (e, h, 2 * i) if self.transposed else (e, 2 * i, h)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        e, i, h = self.num_experts, self.intermediate, self.hidden
        return (e, i, h) if self.transposed else (e, h, i)

    def fused_shape(self, part: Part) -> tuple[int, ...]:
        return {
            "gate_up": self.gate_up_shape, "down": self.down_shape,
            "gate_up_bias": (self.num_experts, 2 * self.intermediate), "down_bias": (self.num_experts, self.hidden),
        }[part]

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's three matrices (and biases) in ``dtype``."""
        n = 3 * self.intermediate * self.hidden + (2 * self.intermediate + self.hidden if self.bias else 0)
        return n * torch.empty((), dtype=dtype).element_size()

    # -- wire entries ----------------------------------------------------------------------------
    def entries(self, layout: ExpertLayout, part: str = "all") -> list[tuple[str, tuple[int, ...]]]:
        """``(name, full shape)`` of every wire tensor, in stream order.

        Stream order (what both sources yield, and their metadata declares): ``per_expert`` with
        ``part="all"`` is expert-major (``e.gate, e.up, e.down`` for e = 0..E-1: a batch of experts
        completes before the next starts); a ``Part`` restricts to the tensors that come from one
        fused parameter (FSDP streams ``gate_up_proj`` then ``down_proj``). ``fused``: ``parts``
        order (``gate_up`` then ``down``; with biases each weight's bias after it).
        """
        i, h = self.intermediate, self.hidden
        out: list[tuple[str, tuple[int, ...]]] = []
        parts = self.parts if part == "all" else (part,)
        if layout == "fused":
            return [(self.fused_name(p), self.fused_shape(p)) for p in parts]
        if self.saved == "fused":
            return [(self.expert_name(e, p), self.fused_shape(p)[1:]) for e in range(self.num_experts) for p in parts]
        for e in range(self.num_experts):
            if part in ("gate_up", "all"):
                out += [(self.expert_name(e, "gate"), (i, h)), (self.expert_name(e, "up"), (i, h))]
            if part in ("down", "all"):
                out.append((self.expert_name(e, "down"), (h, i)))
        return out

    # -- one expert from its gate / up / down pieces --------------------------------------------
    def fill_expert(
        self, slots: dict[str, torch.Tensor], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Copy one expert's ``gate``/``up`` ``[I, H]``, ``down`` ``[H, I]`` (and ``biases``: gate
        ``[I]``, up ``[I]``, down ``[H]``) into its slices of the fused tensors (``slots[part]``,
        e.g. ``fused[e]``), in this spec's in-memory layout: no intermediate tensor."""
        i = self.intermediate
        rows = slots["gate_up"].t() if self.transposed else slots["gate_up"]  # [2I, H] view
        g, u = (rows[0::2], rows[1::2]) if self.interleaved else (rows[:i], rows[i:])
        g.copy_(gate)
        u.copy_(up)
        (slots["down"].t() if self.transposed else slots["down"]).copy_(down)
        if self.bias:
            if biases is None:
                raise ValueError(f"{self.prefix}: these experts have biases; none were given")
            b = slots["gate_up_bias"]
            gb, ub = (b[0::2], b[1::2]) if self.interleaved else (b[:i], b[i:])
            gb.copy_(biases[0])
            ub.copy_(biases[1])
            slots["down_bias"].copy_(biases[2])

    def expert_tensors(
        self, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Expert ``e``'s ``per_expert`` wire tensors from its pieces (``fill_expert``'s), in
        ``entries("per_expert")`` order: the pieces themselves for a per-expert checkpoint; for a
        fused one, each fused tensor's slice ``[e]``, built once."""
        if self.saved == "per_expert":
            return [(self.expert_name(e, "gate"), gate), (self.expert_name(e, "up"), up),
                    (self.expert_name(e, "down"), down)]
        slots = {p: gate.new_empty(self.fused_shape(p)[1:]) for p in self.parts}
        self.fill_expert(slots, gate, up, down, biases)
        return [(self.expert_name(e, p), slots[p]) for p in self.parts]


def is_fused_expert_param(name: str, shape: Sequence[int]) -> bool:
    """A transformers-5 fused routed-expert parameter: ``*.experts.gate_up_proj`` / ``down_proj``,
    3-D (``[E, 2I, H]`` / ``[E, H, I]``)."""
    parts = name.rsplit(".", 2)
    return len(shape) == 3 and len(parts) == 3 and parts[-2] == "experts" and parts[-1] in _FUSED_LEAVES


def _layer_key(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


def expert_names(
    model: torch.nn.Module, fused: dict[str, Sequence[int]]
) -> dict[str, ExpertLayerSpec]:
    """Per-layer expert specs of a transformers model, from transformers' own save-time reversal.

    ``fused`` maps each in-memory fused parameter name (``...experts.gate_up_proj`` and
    ``...experts.down_proj``, wrapper prefixes already removed) to its full shape. Returns
    ``{experts module prefix (in-memory): ExpertLayerSpec (checkpoint names)}``.

    How: ``transformers.core_model_loading.revert_weight_conversion`` -- the function
    ``save_pretrained`` runs -- is applied to (a) meta tensors of the fused shapes, which yields
    the checkpoint names and per-expert shapes without allocating, and (b) an integer probe
    ``[E, R, 1]`` holding each row's flat index, which shows exactly which expert rows each
    checkpoint tensor takes. The spec is accepted only if that matches the layout this file
    streams (expert ``e``: gate = rows ``[0, I)``, up = ``[I, 2I)`` of ``gate_up_proj[e]``,
    down = ``down_proj[e]``); anything else raises ``UnmappedParameterError`` naming the parameter.
    Probes are built once per (shape, name pattern), so cost is independent of the layer count.

    When the reversal returns the fused tensors unchanged (same names, same shapes: GPT-OSS), the
    checkpoint holds them fused: the spec is ``saved="fused"`` with the in-memory layout the
    transformers experts module itself declares (``is_transposed``, ``is_concatenated``,
    ``has_bias``, set by transformers' ``use_experts_implementation``), its shapes checked.
    """
    from transformers.core_model_loading import revert_weight_conversion

    by_module: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in fused.items():
        if not is_fused_expert_param(name, shape):
            raise UnmappedParameterError(f"{name!r} {tuple(shape)} is not a fused routed-expert parameter")
        module, leaf = name.rsplit(".", 1)
        by_module.setdefault(module, {})[leaf] = tuple(int(s) for s in shape)

    specs: dict[str, ExpertLayerSpec] = {}
    probed: dict[tuple, tuple[str, str, str]] = {}
    for module, leaves in by_module.items():
        if set(leaves) != set(_FUSED_LEAVES):
            raise UnmappedParameterError(
                f"{module}: a fused experts module needs both gate_up_proj and down_proj, "
                f"got {sorted(leaves)}"
            )
        kept = _saved_fused(model, module, leaves, revert_weight_conversion)
        if kept is not None:
            specs[module] = kept
            continue
        e, two_i, h = leaves["gate_up_proj"]
        if two_i % 2 or leaves["down_proj"] != (e, h, two_i // 2):
            raise UnmappedParameterError(
                f"{module}: gate_up_proj {leaves['gate_up_proj']} and down_proj {leaves['down_proj']} "
                "are not [E, 2I, H] / [E, H, I]"
            )
        i = two_i // 2
        key = (_layer_key(module), e, i, h)
        if key not in probed:
            probed[key] = _probe_leaves(model, module, e, i, h, revert_weight_conversion)
        gate, up, down = probed[key]
        # Names for this layer: the reversal's renamings (e.g. Mixtral mlp -> block_sparse_moe).
        meta = {
            f"{module}.gate_up_proj": torch.empty(e, two_i, h, device="meta"),
            f"{module}.down_proj": torch.empty(e, h, i, device="meta"),
        }
        out = revert_weight_conversion(model, meta)
        prefix = _common_prefix(module, out, gate)
        spec = ExpertLayerSpec(prefix, e, h, i, gate=gate, up=up, down=down)
        want = {n: s for n, s in spec.entries("per_expert")}
        got = {n: tuple(t.shape) for n, t in out.items()}
        if want != got:
            raise UnmappedParameterError(
                f"{module}: transformers' save-time names/shapes differ from the derived expert spec; "
                f"first difference: {sorted(set(want.items()) ^ set(got.items()))[:2]}"
            )
        specs[module] = spec
    return specs


def _experts_module(model: torch.nn.Module, module: str) -> torch.nn.Module | None:
    """The experts module at checkpoint path ``module`` (wrapper segments of the in-memory path
    skipped), or None."""
    try:
        return model.get_submodule(module)
    except AttributeError:
        pass
    for path, mod in model.named_modules():
        if ".".join(p for p in path.split(".") if p not in WRAPPER_SEGMENTS) == module:
            return mod
    return None


def _saved_fused(model, module: str, leaves: dict[str, tuple[int, ...]], revert) -> ExpertLayerSpec | None:
    """The ``saved="fused"`` spec of ``module`` if it is a transformers experts module (it declares
    its layout: ``use_experts_implementation``'s attributes) whose fused tensors transformers'
    reversal keeps as they are, else None (the per-expert path decides, or refuses). Raises when the
    declared layout does not fit the shapes."""
    mod = _experts_module(model, module)
    if mod is None or not all(hasattr(mod, a) for a in ("is_transposed", "is_concatenated", "has_bias")):
        return None  # no layout declared by transformers: nothing to read it from
    meta = {f"{module}.{leaf}": torch.empty(shape, device="meta") for leaf, shape in leaves.items()}
    out = revert(model, meta)
    if {n: tuple(t.shape) for n, t in out.items()} != {n: tuple(t.shape) for n, t in meta.items()}:
        return None
    transposed = bool(getattr(mod, "is_transposed", False))
    interleaved = not bool(getattr(mod, "is_concatenated", True))
    bias = bool(getattr(mod, "has_bias", False))
    gu, dn = leaves["gate_up_proj"], leaves["down_proj"]
    e, h, two_i = gu if transposed else (gu[0], gu[2], gu[1])
    spec = ExpertLayerSpec(module, e, h, two_i // 2, saved="fused", transposed=transposed, interleaved=interleaved,
                           bias=bias)
    have = {"gate_up": gu, "down": dn}
    for part in ("gate_up_bias", "down_bias") if bias else ():
        t = getattr(mod, _LEAF[part], None)
        have[part] = tuple(t.shape) if isinstance(t, torch.Tensor) else None
    want = {p: spec.fused_shape(p) for p in spec.parts}
    if two_i % 2 or have != want:
        raise UnmappedParameterError(
            f"{module}: transformers saves these experts fused, but their shapes {have} are not the layout "
            f"the module declares (transposed={transposed}, interleaved={interleaved}, bias={bias}): {want}"
        )
    return spec


def _common_prefix(module: str, out: dict[str, torch.Tensor], gate_leaf: str) -> str:
    suffix = f".0.{gate_leaf}"
    cands = [n.removesuffix(suffix) for n in out if n.endswith(suffix)]
    if len(cands) != 1 or not cands[0].endswith(".experts"):
        raise UnmappedParameterError(
            f"{module}: cannot find the checkpoint experts prefix in transformers' reversal {sorted(out)[:4]}"
        )
    return cands[0]


def _probe_leaves(model, module, e, i, h, revert) -> tuple[str, str, str]:
    """(gate leaf, up leaf, down leaf) from reverting index probes; raises unless rows line up."""
    leaves: dict[tuple[str, int], str] = {}
    for fused_leaf, rows in (("gate_up_proj", 2 * i), ("down_proj", h)):
        probe = torch.arange(e * rows, dtype=torch.int64).reshape(e, rows, 1)
        out = revert(model, {f"{module}.{fused_leaf}": probe})
        for name, t in out.items():
            flat = t.reshape(-1)
            first = int(flat[0])
            ex, start = divmod(first, rows)
            ref = torch.arange(first, first + flat.numel(), dtype=torch.int64)
            m = re.fullmatch(rf".*\.experts\.{ex}\.(.+)", name)
            if m is None or not torch.equal(flat, ref) or (start + flat.numel()) > rows:
                raise UnmappedParameterError(
                    f"{module}.{fused_leaf}: transformers saves {name!r} from rows that are not one "
                    "contiguous row range of one expert; this layout is not supported"
                )
            leaves[(fused_leaf, start if fused_leaf == "gate_up_proj" else -1)] = m.group(1)
    try:
        gate, up = leaves[("gate_up_proj", 0)], leaves[("gate_up_proj", i)]
        down = leaves[("down_proj", -1)]
    except KeyError as err:
        raise UnmappedParameterError(
            f"{module}: transformers' reversal does not split gate_up_proj into gate rows [0, {i}) "
            f"and up rows [{i}, {2 * i}) per expert (found {sorted(leaves)})"
        ) from err
    if len(leaves) != 3:
        raise UnmappedParameterError(f"{module}: unexpected per-expert leaves {sorted(leaves.values())}")
    return gate, up, down
