"""Build the right ``WeightSource`` from an ``accelerate.Accelerator`` and its prepared model.

Invariants, and why:

* **FSDP2 is sent from the shards**: a model prepared with ``fsdp_version=2`` is ``fully_shard``-ed in
  place, so ``FSDPSource`` gathers it per FSDP unit. FSDP1 (``FlatParameter``) is refused with a
  pointer to ``fsdp_version=2``: its flat parameters have no per-tensor layout to send from.
* **DDP / single process**: the unwrapped module is sent as is (every rank holds it whole). On CPU
  accelerate never applies its FSDP plugin (``fsdp_plugin`` / the Trainer's ``fsdp_config``): the
  model is prepared with plain DDP, so this is the path taken there.
* **Says what it picked**: one INFO line names the source, the distributed type, the wire dtype and
  why (the FSDP-on-CPU case included), so a run that silently lost its FSDP config is visible.
* **Wire dtype follows mixed precision**: under ``bf16`` / ``fp16`` accelerate keeps (or upcasts)
  trainable parameters in fp32; the engine would ship twice the bytes vLLM keeps. The source casts
  each shard to the mixed-precision dtype before it is gathered; ``FSDPSource``'s fp32 allow-list
  (routers / gates) still applies. ``dtype=`` overrides, ``dtype=None`` keeps parameter dtypes.
* **Adapter-only with one option**: ``adapter_only=True`` returns a ``LoRAAdapterSource`` over the
  same module (the prepared ``PeftModel``: FSDP2 shards, or unwrapped from DDP) -- only its LoRA
  A/B, in PEFT's saved names -- for ``LoRAAdapterSync(source, client, adapter_dir=...)``. The wire
  dtype follows the same rule (vLLM casts an adapter to its ``--lora-dtype`` either way). A model
  without a LoRA adapter raises ``UnsupportedAdapterError`` naming this function and the rank.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.sources import FSDPSource, LoRAAdapterSource, UnsupportedAdapterError
from weightsync.sources.toolkit import get_logger

__all__ = ["source_from_accelerator", "wire_dtype_for"]

_AUTO = "auto"

# Logged under the module path users import it from (README: ``weightsync.plugins.accelerate``).
logger = get_logger("weightsync.plugins.accelerate")


def wire_dtype_for(accelerator: Any) -> torch.dtype | None:
    """The wire dtype accelerate's mixed-precision setting implies (``None``: parameter dtype)."""
    policy = getattr(getattr(getattr(accelerator, "state", None), "fsdp_plugin", None), "mixed_precision_policy", None)
    param_dtype = getattr(policy, "param_dtype", None)
    if isinstance(param_dtype, torch.dtype):
        return param_dtype
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))


def source_from_accelerator(
    accelerator: Any,
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None | str = _AUTO,
    adapter_only: bool = False,
    **source_kwargs: Any,
) -> FSDPSource | LoRAAdapterSource:
    """``FSDPSource`` over ``model`` as ``accelerator.prepare`` returned it (``adapter_only``: its
    ``LoRAAdapterSource``).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the prepared model (FSDP2-sharded, DDP-wrapped, or plain).
        dtype: wire dtype; ``"auto"`` (default) follows the accelerator's mixed precision.
        adapter_only: the PEFT LoRA adapter only (``LoRAAdapterSource``, for ``LoRAAdapterSync``).
        source_kwargs: passed to ``FSDPSource`` (``keep_fp32``, ``group_bytes``, ``transforms``...)
            or, with ``adapter_only``, to ``LoRAAdapterSource`` (``adapter``, ``check``...).
    """
    from accelerate.utils import DistributedType

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"source_from_accelerator: model must be an nn.Module, got {type(model).__name__}")
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError(
            "source_from_accelerator: the model is prepared with FSDP1 (FlatParameter), which has no "
            "per-tensor layout to send from; set fsdp_version=2 in the accelerate FSDP plugin / config"
        )
    auto = dtype == _AUTO
    if auto:
        dtype = wire_dtype_for(accelerator)
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"source_from_accelerator: dtype must be a torch.dtype, None or 'auto', got {dtype!r}")
    if not isinstance(adapter_only, bool):
        raise TypeError(f"source_from_accelerator: adapter_only must be a bool, got {adapter_only!r}")
    module = model if accelerator.is_fsdp2 else accelerator.unwrap_model(model)
    logger.info("source_from_accelerator: %s", _explain(accelerator, dtype, auto, adapter_only))
    if adapter_only:
        try:
            return LoRAAdapterSource(module, dtype=dtype, **source_kwargs)
        except UnsupportedAdapterError as e:
            raise UnsupportedAdapterError(
                f"source_from_accelerator(adapter_only=True): {e}. adapter_only sends a PEFT LoRA adapter; "
                "drop it to send the whole (merged) model"
            ) from e
    return FSDPSource(module, dtype=dtype, **source_kwargs)


def _explain(accelerator: Any, dtype: torch.dtype | None, auto: bool, adapter_only: bool = False) -> str:
    """One line: which source over what, and why (logged by ``source_from_accelerator``)."""
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    wire = "the parameters' dtype" if dtype is None else str(dtype).removeprefix("torch.")
    if auto:
        wire += f" (mixed precision {accelerator.mixed_precision!s})"
    name = "LoRAAdapterSource" if adapter_only else "FSDPSource"
    if accelerator.is_fsdp2:
        why = f"the model is FSDP2-sharded: {name} gathers it per FSDP unit"
    else:
        why = f"every rank holds the whole module: {name} sends the unwrapped module, no gathers"
        device = getattr(accelerator, "device", None)
        if getattr(device, "type", None) == "cpu":
            why += (
                "; on CPU accelerate never applies FSDP, so an fsdp_plugin / fsdp_config runs as "
                "plain DDP here (shard with FSDP2 on GPUs)"
            )
    return f"distributed_type {kind}, wire dtype {wire}: {why}"
