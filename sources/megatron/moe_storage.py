"""Where megatron-core keeps one rank's MoE tensors, and one expert put back together from its shards.

What ``MegatronMoEExporter`` reads on a rank, found without a collective:

* the rank's MoE MLP modules by global layer (``moe_modules``: decoder layers and the decoder blocks
  of multi-token-prediction layers, which megatron numbers after the decoder's);
* routed experts in one of three storage formats (``expert_format``): ``SequentialMLP``
  ``local_experts.{j}.linear_fc{1,2}.weight``; ``TEGroupedMLP`` ``linear_fc1.weight{j}`` /
  ``linear_fc2.weight{j}`` (same shapes); legacy ``GroupedMLP`` ``weight1`` ``[H, E_local * 2F/etp]``
  and ``weight2`` ``[E_local * F/etp, H]``, input-by-output (its forward views them as
  ``[E_local, H, 2F/etp]`` / ``[E_local, F/etp, H]``). ``local_expert_weights`` gives every format in
  ``[out, in]`` orientation, as views; ``local_expert_biases`` the biases (``add_bias_linear``, which
  megatron-core allows only at ETP 1: ``linear_fc1.bias`` ``[2F]`` = ``[gate; up]`` like the rows,
  ``linear_fc2.bias`` ``[H]``; TE: ``bias{j}``);
* the Megatron parameter names the exporter claims, for the source's binding check
  (``megatron_moe_suffixes``).

Each ETP rank holds rows ``[gate_r; up_r]`` of an expert's ``linear_fc1`` and column block ``r`` of
its ``linear_fc2``; ``expert_full`` / ``expert_biases`` rebuild HF's ``(gate, up, down)`` from them
with at most one copy each (the per-expert memory bound of the exporter depends on it).
"""

from __future__ import annotations

import torch

from ..core.ground.errors import UnmappedParameterError

__all__ = [
    "expert_biases",
    "expert_format",
    "expert_full",
    "local_expert_biases",
    "local_expert_weights",
    "megatron_moe_suffixes",
    "moe_modules",
]


def expert_format(experts: torch.nn.Module) -> str:
    """``"sequential"`` | ``"te_grouped"`` | ``"grouped"`` for a Megatron experts module."""
    if hasattr(experts, "local_experts"):
        return "sequential"
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
        return "grouped"
    fc1 = getattr(experts, "linear_fc1", None)
    if fc1 is not None and hasattr(fc1, "weight0"):
        return "te_grouped"
    raise UnmappedParameterError(
        f"unknown Megatron experts module {type(experts).__name__}: expected SequentialMLP "
        "(local_experts), TEGroupedMLP (linear_fc1.weight{j}) or GroupedMLP (weight1/weight2)"
    )


def local_expert_weights(experts: torch.nn.Module, j: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [2F/etp, H], fc2 [H, F/etp])`` of local expert ``j`` in ``[out, in]`` orientation.

    Views where the storage allows (no copy); legacy ``GroupedMLP`` pieces are transposed views.
    """
    fmt = expert_format(experts)
    if fmt == "sequential":
        e = experts.local_experts[j]
        return e.linear_fc1.weight, e.linear_fc2.weight
    if fmt == "te_grouped":
        return getattr(experts.linear_fc1, f"weight{j}"), getattr(experts.linear_fc2, f"weight{j}")
    n = experts.num_local_experts
    w1 = experts.weight1.view(n, hidden, -1)[j].t()  # [2F/etp, H]
    w2 = experts.weight2.view(n, -1, hidden)[j].t()  # [H, F/etp]
    return w1, w2


def local_expert_biases(experts: torch.nn.Module, j: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(fc1 bias [2F], fc2 bias [H])`` of local expert ``j`` (``add_bias_linear``), else Nones."""
    fmt = expert_format(experts)
    if fmt == "sequential":
        e = experts.local_experts[j]
        return e.linear_fc1.bias, e.linear_fc2.bias
    if fmt == "te_grouped":
        return getattr(experts.linear_fc1, f"bias{j}", None), getattr(experts.linear_fc2, f"bias{j}", None)
    return None, None  # legacy GroupedMLP: megatron-core builds it without biases


def megatron_moe_suffixes(num_local_experts: int, fmt: str) -> list[str]:
    """Layer-relative Megatron parameter names the exporter may read of one MoE MLP's routed experts
    (weights and, under ``add_bias_linear``, biases) and of its router's linear bias, for binding
    checks. A model without biases simply has no such parameters; the exporter checks that their
    presence matches the checkpoint (``hf_layer``)."""
    router = ["mlp.router.bias"]
    if fmt == "sequential":
        return router + [
            f"mlp.experts.local_experts.{j}.linear_fc{k}.{w}"
            for j in range(num_local_experts)
            for k in (1, 2)
            for w in ("weight", "bias")
        ]
    if fmt == "te_grouped":
        return router + [
            f"mlp.experts.linear_fc{k}.{w}{j}" for j in range(num_local_experts) for k in (1, 2) for w in ("weight", "bias")
        ]
    if fmt == "grouped":
        return router + ["mlp.experts.weight1", "mlp.experts.weight2"]
    raise ValueError(f"unknown expert format {fmt!r}")


def expert_biases(fc1_bias: torch.Tensor, fc2_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(gate bias, up bias, down bias)`` of one expert (ETP 1: ``[gate; up]`` halves of fc1's)."""
    gate, up = torch.chunk(fc1_bias, 2, dim=0)
    return gate, up, fc2_bias


def expert_full(fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Full ``(gate, up, down)`` of one expert from its ETP shards (``[gate_r; up_r]`` rows of fc1,
    column block ``r`` of fc2; ``core/layouts/tp.py``'s GLU/row invariants), with at most one copy
    each: with one shard, gate/up are contiguous row views and down is the shard itself (zero copy);
    with several, one ``torch.cat`` of views per output (``GLU_LAYOUT.concat`` would copy twice,
    which is what the per-expert memory bound cannot afford)."""
    if len(fc1) == 1:
        gate, up = torch.chunk(fc1[0], 2, dim=0)
        return gate, up, fc2[0].contiguous()
    halves = [torch.chunk(p, 2, dim=0) for p in fc1]
    return (
        torch.cat([h[0] for h in halves], dim=0),
        torch.cat([h[1] for h in halves], dim=0),
        torch.cat(fc2, dim=1),
    )


def moe_modules(chunks: list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """global layer (0-based, from ``layer_number``) -> local MoE MLP module (has ``.router``); the
    decoder layers of multi-token-prediction layers count too (megatron numbers them after the
    decoder's: ``num_layers + i``)."""
    out: dict[int, torch.nn.Module] = {}
    for chunk in chunks:
        mtp = getattr(getattr(chunk, "mtp", None), "layers", None) or []
        blocks = [getattr(m, "transformer_layer", None) for m in mtp]
        for layer in [*getattr(chunk.decoder, "layers", []), *[b for b in blocks if b is not None]]:
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and hasattr(mlp, "router") and hasattr(mlp, "experts"):
                out[int(layer.layer_number) - 1] = mlp
    return out
