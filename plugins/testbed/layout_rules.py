"""The rules a Megatron trainer layout must meet for a model, in one place: ``weightsync check`` /
``export`` (before any rank starts) and ``weightsync plan`` (and ``planner.plan()``) ask the same
function, so a layout ``check`` refuses is never planned, and the refusal names the same rule.

Why one function: ``plan`` used to accept ``--ep 3`` on 128 experts (a plan of a layout that cannot
exist) or crash on it deep in its counts, while ``check`` refused it cleanly. The rules read only
``ConfigFacts`` (plain numbers from the config's dict or object: no torch), so they answer in
milliseconds; a fact the config does not state (``None``) is not checked here.
"""

from __future__ import annotations

from typing import Any, Literal

from .presets import ConfigFacts, UserError

__all__ = ["check_megatron_layout", "facts_of"]


def facts_of(config: Any) -> ConfigFacts:
    """``ConfigFacts`` of a transformers config object (``presets.config_facts`` reads a dict)."""
    heads = getattr(config, "num_attention_heads", None)
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "n_routed_experts", None))
    return ConfigFacts(
        model_type=str(getattr(config, "model_type", "?")),
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        layers=getattr(config, "num_hidden_layers", None),
        experts=experts,
    )


def check_megatron_layout(
    facts: ConfigFacts,
    *,
    tp: int,
    pp: int,
    vpp: int | None,
    ep: int,
    world: int,
    world_flag: str = "nproc",
    spelling: Literal["cli", "kwargs"] = "cli",
) -> None:
    """Raise ``UserError`` (a ``ValueError``) naming the first rule a ``tp x pp (x vpp) x ep`` layout
    over ``world`` ranks breaks for the model ``facts`` describes: TP divides the attention heads and
    the key/value heads, PP x VPP divides the layers, EP divides the experts (and needs experts),
    VPP needs PP >= 2, and the world is a multiple of TP x PP x EP (the rest are data-parallel
    replicas). ``world_flag`` is the option that sets the world (``nproc`` for check, ``world`` for
    plan); ``spelling`` says whether the words name CLI flags (``--tp 3``) or keyword arguments
    (``tp=3``)."""

    def arg(name: str, value: Any) -> str:
        return f"--{name.replace('_', '-')} {value}" if spelling == "cli" else f"{name}={value}"

    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), (world_flag, world)):
        if value < 1:
            raise UserError(f"{arg(name, value)} must be >= 1")
    heads, groups = facts.heads, facts.kv_heads
    if heads is not None and (heads % tp or (groups or heads) % tp):
        raise UserError(
            f"{arg('tp', tp)} must divide the attention heads ({heads}) and key/value heads ({groups}) "
            f"of {facts.model_type}"
        )
    if vpp is not None and (vpp < 1 or pp < 2):
        raise UserError(f"{arg('vpp', vpp)} needs {arg('pp', '>= 2')} and {arg('vpp', '>= 1')} "
                        "(megatron's interleaved schedule)")
    stages = pp * (vpp or 1)
    if facts.layers is not None and facts.layers % stages:
        raise UserError(f"{arg('pp', pp)} x {arg('vpp', vpp or 1)} must divide the {facts.layers} layers")
    experts = facts.experts
    if ep > 1 and (not experts or experts % ep):
        raise UserError(f"{arg('ep', ep)} must divide the number of experts ({experts or 'none: dense model'})")
    unit = tp * pp * ep
    if world % unit:
        product = "--tp x --pp x --ep" if spelling == "cli" else "tp*pp*ep"
        raise UserError(
            f"{arg(world_flag, world)} must be a multiple of {product} = {unit} "
            "(megatron splits the ranks into data-parallel replicas of that size)"
        )
