"""What ``weightsync check`` judges a source against: the index of the checkpoint transformers'
``save_pretrained`` writes, and that index as each wire layout would hold it.

Invariant: every function here returns ``{name: (dtype, shape)}`` computed from transformers' own
output (or from such an index) and never from the source under test, so the check cannot agree
with itself. Folding and unfolding keep the bytes; quantizing replaces each planned weight by its
FP8 tensor and float32 scale.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Any

import torch

__all__ = ["checkpoint_index", "fold_experts", "unfold_experts", "quantized_index"]


def checkpoint_index(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the safetensors checkpoint ``model.save_pretrained`` writes."""
    from safetensors import safe_open
    from transformers.utils import logging as hf_logging

    from weightsync.sources.toolkit import SAFETENSORS_DTYPES

    hf_logging.disable_progress_bar()

    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    with tempfile.TemporaryDirectory(prefix="weightsync-check-") as tmp:
        model.save_pretrained(tmp)
        for file in sorted(glob.glob(os.path.join(tmp, "*.safetensors"))):
            with safe_open(file, "pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    out[k] = (SAFETENSORS_DTYPES.get(s.get_dtype(), torch.uint8), tuple(s.get_shape()))
    return out


#: vLLM's fused routed-expert names per checkpoint leaf (0.33, 0.34) (``RoutedExperts.make_expert_params_mapping``):
#: gate + up rows are stacked into one ``[E, 2I, H]`` tensor (gate first), down into ``[E, H, I]``.
_VLLM_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "w1": ("w13", 0),
               "w3": ("w13", 1), "down_proj": ("down_proj", None), "w2": ("w2", None)}
_PER_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>\w+)\.weight")


def fold_experts(
    index: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The checkpoint index as vLLM's fused expert names would hold it (``--expert-layout fused``):
    each layer's per-expert ``gate``/``up`` ``[I, H]`` become one ``[E, 2I, H]``, ``down`` ``[H, I]``
    one ``[E, H, I]``; every other entry is kept. Same bytes, fewer tensors."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    experts: dict[str, tuple[torch.dtype, tuple[int, ...], set[int]]] = {}
    for name, (dt, shape) in index.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None or m["leaf"] not in _VLLM_FUSED:
            out[name] = (dt, shape)
            continue
        fused, half = _VLLM_FUSED[m["leaf"]]
        key = f"{m['prefix']}.{fused}"
        rows = shape[0] * (2 if half is not None else 1)
        _, _, seen = experts.setdefault(key, (dt, (rows, *shape[1:]), set()))
        seen.add(int(m["e"]))
    for key, (dt, shape, seen) in experts.items():
        out[key] = (dt, (len(seen), *shape))
    return out


#: A checkpoint that keeps its experts fused (GPT-OSS): ``…experts.<leaf>`` ``[E, …]``.
_FUSED_CHECKPOINT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<leaf>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)")


def unfold_experts(
    index: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The checkpoint index as ``--expert-layout per_expert`` sends a checkpoint that keeps its
    experts fused (GPT-OSS): each fused ``[E, …]`` tensor as ``E`` slices ``…experts.{e}.<leaf>``
    (vLLM's gpt_oss per-expert names); every other entry is kept (per-expert checkpoints are
    unchanged). Same bytes, more tensors."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (dt, shape) in index.items():
        m = _FUSED_CHECKPOINT.fullmatch(name)
        if m is None:
            out[name] = (dt, shape)
            continue
        for e in range(shape[0]):
            out[f"{m['prefix']}.{e}.{m['leaf']}"] = (dt, tuple(shape[1:]))
    return out


def quantized_index(
    index: dict[str, tuple[torch.dtype, tuple[int, ...]]], config: Any
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The checkpoint index as an FP8 checkpoint of ``config`` (an ``FP8Config``) holds it: each
    planned weight ``float8_e4m3fn`` followed by its float32 scale."""
    out = {}
    for name, (dt, shape) in index.items():
        plan = config.plan(name, tuple(shape)) if dt.is_floating_point else None
        if plan is None:
            out[name] = (dt, shape)
        else:
            out[name] = (torch.float8_e4m3fn, shape)
            out[plan.scale_name] = (torch.float32, plan.scale_shape)
    return out
