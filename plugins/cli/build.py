"""The model and source the CLI runs on CPU ranks, shared by ``weightsync check`` and ``export``.

Invariant: a preset (or config) is **one model whatever the layout**: the transformers model of the
config with seed 0 (``presets.build_model``). ``--layout fsdp``: that model, FSDP2 over every rank
(each decoder layer, then the root) and ``FSDPSource``. ``--layout megatron``: a megatron-core
``GPTModel`` built from the same config at ``--tp/--pp/--vpp/--ep`` (``testbed.megatron``), loaded
with that model's checkpoint tensors (``load_hf_weights``), and
``MegatronSource(mode="full")``: rank 0 owns every tensor. So ``export`` in one layout and
``check --checkpoint`` in the other compare equal bytes. Both honour ``--dtype`` (wire dtype),
``--expert-layout`` and ``--quantize fp8`` (the source wrapped in ``FP8Source``).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightSource

from ..testbed.presets import build_model

__all__ = [
    "build_model_and_source", "build_source", "checkpoint_state", "mtp_layers", "mtp_source", "PolicyAndDraft", "quantized", "shard_fsdp2",
]


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``model.save_pretrained`` writes (checkpoint names: per-expert MoE tensors, no
    tied ``lm_head``), read back from a temporary folder."""
    import glob
    import os
    import tempfile

    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="weightsync-layout-") as tmp:
        model.save_pretrained(tmp)
        for file in sorted(glob.glob(os.path.join(tmp, "*.safetensors"))):
            out.update(load_file(file))
    return out


def build_source(
    args: argparse.Namespace, config: Any, dtype: torch.dtype | None, *, hf_model: torch.nn.Module | None = None
) -> WeightSource:
    """The CLI's source for ``args.layout`` (collective: every rank calls it). ``hf_model`` is the
    already-built unsharded transformers model (default: ``build_model(config, seed=0)``); for
    ``fsdp`` it is sharded in place, for ``megatron`` rank 0 reads its checkpoint tensors."""
    return build_model_and_source(args, config, dtype, hf_model=hf_model)[1]


def build_model_and_source(
    args: argparse.Namespace, config: Any, dtype: torch.dtype | None, *, hf_model: torch.nn.Module | None = None
) -> tuple[list[torch.nn.Module], WeightSource]:
    """``build_source``, also returning this rank's trainer modules (the FSDP2 model, or the
    Megatron model chunks): what ``check --delta`` perturbs between its rounds."""
    expert_layout = getattr(args, "expert_layout", None)
    if getattr(args, "layout", "fsdp") == "megatron":
        import torch.distributed as dist

        from weightsync.sources import MegatronSource

        from ..testbed.megatron import MegatronParallel, build_megatron_gpt, load_hf_weights

        par = MegatronParallel(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
        overrides = {"mtp_num_layers": mtp_layers(config)} if getattr(args, "mtp", False) else None
        chunks = build_megatron_gpt(config, par, seed=0, overrides=overrides)
        state = None
        if dist.get_rank() == 0:
            state = checkpoint_state(hf_model if hf_model is not None else build_model(config, seed=0))
        load_hf_weights(chunks, config, state)
        del state
        model = chunks if args.vpp else chunks[0]
        source = MegatronSource(model, hf_config=config, dtype=dtype, mode="full", expert_layout=expert_layout)
        if overrides:  # --mtp: the policy, then the draft, as one checkpoint's tensors
            return list(chunks), PolicyAndDraft(source, mtp_source(chunks, config, dtype, expert_layout))
        return list(chunks), quantized(args, source)
    from weightsync.sources import FSDPSource

    model = shard_fsdp2(hf_model if hf_model is not None else build_model(config, seed=0))
    return [model], quantized(args, FSDPSource(model, dtype=dtype, expert_layout=expert_layout))


def mtp_layers(config: Any) -> int:
    """``--mtp``: the number of MTP layers the config's family field names (DeepSeek-V3 / GLM
    ``num_nextn_predict_layers``); a config saying 0 (or nothing) is given 1 in place, so the written
    ``config.json`` states the MTP layers the folder holds. Raises ``UserError`` for a family without
    MTP names."""
    from weightsync.sources.toolkit import family_for

    from ..testbed.presets import UserError

    names = family_for(config, check=False).mtp
    if names is None:
        raise UserError(f"--mtp: family {config.model_type!r} has no multi-token-prediction (MTP) layers")
    n = int(getattr(config, names.count, 0) or 0)
    if n < 1:
        setattr(config, names.count, 1)
        n = 1
    return n


def mtp_source(
    chunks: list[torch.nn.Module], config: Any, dtype: torch.dtype | None, expert_layout: str | None = None
) -> WeightSource:
    """``--mtp``: the draft's tensors of this rank's chunks (``MegatronSource(part="mtp")``,
    ``mode="full"``: rank 0 sends), in the released checkpoints' names."""
    from weightsync.sources import MegatronSource

    return MegatronSource(chunks if len(chunks) > 1 else chunks[0], hf_config=config, dtype=dtype, mode="full",
                          part="mtp", expert_layout=expert_layout)


class PolicyAndDraft(WeightSource):
    """``--mtp``: the policy source's tensors, then the draft's (``MegatronSource(part="mtp")``), as
    one source -- what a released DeepSeek-V3 / GLM-4.5 / Qwen3-Next / Qwen3.5 checkpoint holds in one
    folder (one index). Invariant: every name once; ``metadata`` is the policy's followed by the
    draft's, and ``iter_full`` streams in that order. A draft name the policy has too is the draft's
    copy of the embedding / output head megatron shares with the MTP block (Qwen3-Next / Qwen3.5 name
    it ``model.embed_tokens.weight`` / ``lm_head.weight``, as the policy does; DeepSeek / GLM carry
    their own copies under ``model.layers.{N}.``): the checkpoint holds it once, the policy's, so the
    draft's is left out -- after checking its shape and dtype are the policy's."""

    def __init__(self, policy: WeightSource, draft: WeightSource) -> None:
        self.policy = policy
        self.hf_config = getattr(policy, "hf_config", None)
        mine = {m.name: m for m in policy.metadata}
        shared = {m.name for m in draft.metadata if m.name in mine}
        odd = [m.name for m in draft.metadata if m.name in shared
               and (tuple(m.shape), m.dtype) != (tuple(mine[m.name].shape), mine[m.name].dtype)]
        if odd:
            raise ValueError(f"PolicyAndDraft: names in both the policy and the draft, with other shapes or dtypes: {odd[:5]}")
        self.draft = _Without(draft, shared) if shared else draft

    @functools.cached_property
    def metadata(self) -> list[Any]:
        return list(self.policy.metadata) + list(self.draft.metadata)

    @property
    def draft_names(self) -> list[str]:
        return [m.name for m in self.draft.metadata]

    def iter_full(self) -> Any:
        yield from self.policy.iter_full()
        yield from self.draft.iter_full()


class _Without(WeightSource):
    """``source`` less the tensors named in ``names`` (metadata and stream; every rank still runs the
    whole of ``source``'s pass, so its collectives match)."""

    def __init__(self, source: WeightSource, names: set[str]) -> None:
        self.source, self.names = source, set(names)
        self.hf_config = getattr(source, "hf_config", None)

    @functools.cached_property
    def metadata(self) -> list[Any]:
        return [m for m in self.source.metadata if m.name not in self.names]

    def iter_full(self) -> Any:
        return ((n, t) for n, t in self.source.iter_full() if n not in self.names)


def quantized(args: argparse.Namespace, source: WeightSource) -> WeightSource:
    """``source``, or with ``--quantize fp8`` its ``FP8Source`` (config from ``--quantize-config``,
    else ``check --checkpoint``'s folder, else weightsync's default)."""
    if getattr(args, "quantize", None) is None:
        return source
    from weightsync.sources import FP8Source

    return FP8Source(source, getattr(args, "quantize_config", None) or getattr(args, "checkpoint", None))


def shard_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a transformers causal LM) sharded with FSDP2 over every rank of the default group
    on a CPU mesh: each decoder layer, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
