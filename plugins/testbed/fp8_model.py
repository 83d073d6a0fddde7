"""A receiver model that holds an FP8 checkpoint's tensors, for FP8 syncs on CPU.

``FP8CheckpointModel(dense, quantization_config)``: its ``state_dict`` is what a block-FP8 checkpoint
of ``dense``'s architecture holds -- built by transformers' own ``replace_with_fp8_linear`` (the
FineGrainedFP8 integration that loads such checkpoints): each quantized Linear an ``FP8Linear`` with a
``float8_e4m3fn`` ``weight`` and a float32 ``weight_scale_inv``, fused experts ``FP8Experts``
(``gate_up_proj`` + ``gate_up_proj_scale_inv``...), every module ``modules_to_not_convert`` lists as
it was. So a ``LoopbackReceiver`` over it accepts exactly an FP8 stream, names, dtypes and shapes
checked strictly as for any model, with wire checksums over the FP8 bytes.

Forward: transformers' FP8 kernels need a GPU, so ``forward`` dequantizes what it holds
(``weight * weight_scale_inv`` per block, as vLLM's loader reads it) into a dense copy of the
architecture and runs that. The logits then differ from the trainer's by FP8 rounding: the demo
compares them within a stated tolerance.

Nothing here imports vLLM (a receiver process does not pay for it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from weightsync.sources import dequantize_blocks, quantize_blocks

__all__ = ["FP8CheckpointModel", "build_fp8_model"]


class FP8CheckpointModel(nn.Module):
    """``dense``'s architecture as a block-FP8 checkpoint loads it (module docstring).

    ``quantization_config``: the checkpoint's ``quantization_config`` dict (``FP8Source.quantization_config``
    writes one). Initial weights: ``dense``'s, quantized. ``dense`` itself is not modified.
    """

    def __init__(self, dense: nn.Module, quantization_config: dict[str, Any]) -> None:
        super().__init__()
        from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
        from transformers.utils.quantization_config import FineGrainedFP8Config

        q = dict(quantization_config)
        self.block = tuple(q["weight_block_size"])
        self.scale_fmt = q.get("scale_fmt")
        cfg = FineGrainedFP8Config(
            weight_block_size=self.block, activation_scheme=q.get("activation_scheme", "dynamic"),
            modules_to_not_convert=list(q.get("modules_to_not_convert") or []), scale_fmt=self.scale_fmt or "float",
        )
        fp8 = copy.deepcopy(dense)
        replace_with_fp8_linear(fp8, modules_to_not_convert=cfg.modules_to_not_convert, quantization_config=cfg,
                                pre_quantized=True)
        _materialize(fp8, dense, self.block, self.scale_fmt)
        for name, child in fp8.named_children():  # the checkpoint's names, no prefix
            self.add_module(name, child)
        self.config = getattr(dense, "config", None)
        object.__setattr__(self, "_dense", copy.deepcopy(dense))  # not a submodule: not in state_dict

    def dense_state(self) -> dict[str, torch.Tensor]:
        """What vLLM's loader computes from the FP8 tensors: each FP8 weight times its block scales."""
        sd = self.state_dict()
        out = {}
        for name, t in sd.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                scale = sd[_scale_name(name, sd)]
                out[name] = _dequantize(t, scale, self.block)
            else:
                out[name] = t
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dense = self._dense
        with torch.no_grad():
            dense.load_state_dict(self.dense_state(), strict=False, assign=False)
        dense.train(self.training)
        return dense(*args, **kwargs)


def build_fp8_model(config: Any, seed: int, quantization_config: dict[str, Any]) -> FP8CheckpointModel:
    """A module-level factory (picklable for ``start_receiver_process``): ``presets.build_model`` of
    ``config`` with ``seed``, held as an FP8 checkpoint of ``quantization_config``."""
    from .presets import build_model

    return FP8CheckpointModel(build_model(config, seed), quantization_config)


def _scale_name(weight: str, sd: dict[str, torch.Tensor]) -> str:
    if weight.endswith(".weight") and weight[: -len("weight")] + "weight_scale_inv" in sd:
        return weight[: -len("weight")] + "weight_scale_inv"
    return weight + "_scale_inv"


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block dequantization; a fused gate/up whose scale holds each half's blocks separately
    (``2 * ceil(I/bN)`` rows, as vLLM's parameter does) is dequantized half by half."""
    rows = q.shape[-2]
    if scale.shape[-2] != -(-rows // block[0]) and rows % 2 == 0:
        halves = [dequantize_blocks(h, s, block) for h, s in zip(q.chunk(2, dim=-2), scale.chunk(2, dim=-2))]
        return torch.cat(halves, dim=-2)
    return dequantize_blocks(q, scale, block)


@torch.no_grad()
def _materialize(fp8: nn.Module, dense: nn.Module, block: tuple[int, int], scale_fmt: str | None) -> None:
    """Give the FP8 modules (built on the meta device) real CPU tensors: ``dense``'s weights quantized."""
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    for mod_name, mod in fp8.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if pname.endswith("_scale_inv"):
                continue  # filled with its weight below
            src = dense_params[full].detach()
            scale_pname = _scale_name(pname, dict(mod.named_parameters(recurse=False)))
            scale_meta = getattr(mod, scale_pname)
            parts = 2 if pname == "gate_up_proj" and scale_meta.shape[-2] != -(-src.shape[-2] // block[0]) else 1
            qs = [quantize_blocks(h, block, scale_fmt=scale_fmt) for h in src.chunk(parts, dim=-2)]
            q = torch.cat([x[0] for x in qs], dim=-2)
            s = torch.cat([x[1] for x in qs], dim=-2)
            if tuple(s.shape) != tuple(scale_meta.shape):
                raise ValueError(f"{full}: transformers allocates a scale of {tuple(scale_meta.shape)}, "
                                 f"quantizing gives {tuple(s.shape)}")
            setattr(mod, pname, nn.Parameter(q, requires_grad=False))
            setattr(mod, scale_pname, nn.Parameter(s.to(scale_meta.dtype), requires_grad=False))
    left = [n for n, p in fp8.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"FP8CheckpointModel: parameters left on the meta device: {left[:5]}")
