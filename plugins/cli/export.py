"""``weightsync export``: a Hugging Face safetensors checkpoint from CPU ranks, via ``save_safetensors``.

The model and source are the ones ``weightsync check`` runs (``build.build_source``: FSDP2 +
``FSDPSource``, or a megatron-core ``GPTModel`` + ``MegatronSource(mode="full")``), built from a
preset or a ``config.json`` with random weights (seed 0); every rank calls
``save_safetensors(source, --out, max_shard_bytes=--max-shard-size, config=the config,
overwrite=--overwrite)`` and rank 0 prints what was written. Exit 0 when the folder is in place, 1
when the export failed (nothing is left at ``--out``), 2 for usage errors -- including a non-empty
``--out`` without ``--overwrite``, caught before any rank starts. Only ``run_export`` imports
torch: the CLI validates its arguments (``validate_export``) before any heavy import.

``export --mtp`` (``--layout megatron``, DeepSeek-V3/V3.2 and GLM-4.5/GLM-5 presets or configs):
the megatron-core model is built with its MTP block (``mtp_num_layers`` = the config's
``num_nextn_predict_layers``, 1 where it says 0) and the folder holds what a released checkpoint
holds: the policy's ``save_pretrained`` tensors plus the MTP layers in the checkpoint names vLLM's
MTP draft models load (``model.layers.{N+i}.*``), in one index (``build.PolicyAndDraft``). A family
without MTP layers is a usage error (exit 2) before any rank starts. The MTP block carries megatron's
seed-0 initialization, not weights from the preset's transformers model (which has none).

``export --adapter`` writes the PEFT LoRA adapter folder instead -- ``adapter_model.safetensors`` +
``adapter_config.json``, what vLLM's ``/v1/load_lora_adapter`` loads and ``LoRAAdapterSync`` sends
-- from the same preset / config model with a LoRA adapter attached (``lora_model``: ``--lora-rank``,
``--lora-alpha``, ``--lora-targets``), FSDP2 over ``--nproc`` ranks, only the adapter gathered
(``LoRAAdapterSource``), written by rank 0 atomically (``write_adapter``: a hidden staging folder,
fsynced, renamed; ``--overwrite`` swaps it with the old folder at the end). The folder equals
``PeftModel.save_pretrained`` of the unsharded model byte for byte. There is no checkpoint-folder
input: a trained adapter is already the folder PEFT saved; this is the dry run of the adapter path
(which tensors, how many bytes, a folder to try against a server's ``--max-lora-rank``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from ..testbed.presets import UserError, load_config
from .launch import failed
from .progress import phase

__all__ = ["run_export", "validate_export", "parse_size", "lora_model", "ADAPTER_DTYPES"]

#: ``export --adapter``: the dtypes an adapter file carries (``LoRAAdapterSource.DTYPES``)
ADAPTER_DTYPES = ("float32", "float", "bfloat16", "float16", "half")
#: ``export --adapter``'s LoRA defaults
DEFAULT_LORA_RANK = 8


def parse_size(text: str) -> int:
    """``--max-shard-size``: bytes as an int, or digits + KB/MB/GB/TB (powers of 10, as transformers'
    ``max_shard_size`` parses them). Raises ``UserError``."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(text).strip()
    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text.upper())
    except ValueError as e:
        raise UserError(f"--max-shard-size {text!r}: {e}") from None
    if size <= 0:
        raise UserError(f"--max-shard-size {text!r} must be positive")
    return size


def validate_export(args: argparse.Namespace) -> None:
    """Usage errors of ``export`` (exit 2): the size, and ``--out`` (a file, or a non-empty folder
    without ``--overwrite``). Sets ``args.max_shard_bytes``."""
    args.max_shard_bytes = parse_size(args.max_shard_size)
    if getattr(args, "adapter", False):
        _validate_adapter(args)
    else:
        given = [f for f in ("lora_rank", "lora_alpha", "lora_targets") if getattr(args, f, None) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} applies to export --adapter")
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--out {args.out}: exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        raise UserError(f"--out {args.out}: folder exists and is not empty (pass --overwrite to replace it)")


def _validate_adapter(args: argparse.Namespace) -> None:
    """``export --adapter``'s usage errors: the layout and the options that do not apply, the LoRA
    rank and alpha, the dtype. Fills the LoRA defaults."""
    if args.layout != "fsdp":
        raise UserError("export --adapter builds a PEFT model with FSDP2 (--layout fsdp); Megatron-core LoRA is "
                        "not supported")
    for flag, value in (("--quantize", args.quantize), ("--expert-layout", args.expert_layout)):
        if value:
            raise UserError(f"{flag} does not apply to export --adapter (only LoRA A/B are written)")
    if args.max_shard_size != "5GB":
        raise UserError("--max-shard-size does not apply to export --adapter (one adapter_model.safetensors)")
    if args.dtype and args.dtype not in ADAPTER_DTYPES:
        raise UserError(f"--dtype {args.dtype}: an adapter file carries float32, bfloat16 or float16")
    args.lora_rank = DEFAULT_LORA_RANK if args.lora_rank is None else args.lora_rank
    if args.lora_rank < 1:
        raise UserError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    if not args.lora_alpha > 0:
        raise UserError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    if args.lora_targets is not None:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        if not targets:
            raise UserError("--lora-targets: name at least one module (e.g. q_proj,v_proj)")
        args.lora_targets = ",".join(targets)


def lora_model(config: Any, *, rank: int, alpha: float, targets: str | None, seed: int = 0) -> Any:
    """``export --adapter``'s model: the preset / config model (``build_model(config, seed)``) with
    ``LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or "all-linear")`` attached by
    ``get_peft_model`` under ``torch.manual_seed(seed + 1)`` (A: PEFT's own init), and every
    ``lora_B`` drawn N(0, 0.02) under ``seed + 2`` -- PEFT's zero B would be an adapter that changes
    nothing, as a trained one does. Deterministic: every rank builds the same."""
    import torch
    from peft import LoraConfig, get_peft_model

    from ..testbed.presets import build_model

    base = build_model(config, seed=seed)
    torch.manual_seed(seed + 1)
    target: Any = targets.split(",") if targets else "all-linear"
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=target))
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    return model


def run_export_adapter(args: argparse.Namespace) -> int:
    """``export --adapter`` on every rank (module docstring); rank 0 prints the report or the failure."""
    import shutil
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.sources import LoRAAdapterSource

    from ..checkpoint.files import replace_folder
    from ..lora_adapter import write_adapter
    from .common import format_bytes

    rank = dist.get_rank()
    config = load_config(args.model, args.config, hidden=args.hidden, layers=args.layers)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = os.path.abspath(args.out)
    try:
        model = lora_model(config, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = LoRAAdapterSource(model, dtype=dtype)
        t0 = time.perf_counter()
        tensors = source.state_dict()  # every rank: one all-gather per decoder layer
        gather_s = time.perf_counter() - t0
        status, err = "ok", None
        if rank == 0:
            try:
                os.makedirs(os.path.dirname(out), exist_ok=True)
                stage = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.weightsync-", dir=os.path.dirname(out))
                try:
                    staged = os.path.join(stage, "adapter")
                    write_adapter(staged, tensors, source.adapter_config())
                    if os.path.isdir(out) and os.listdir(out):
                        replace_folder(staged, out)  # --overwrite (validated): the old folder until now
                    else:
                        if os.path.isdir(out):
                            os.rmdir(out)
                        os.rename(staged, out)
                finally:
                    shutil.rmtree(stage, ignore_errors=True)
            except Exception as e:  # noqa: BLE001 - agreed below, said by rank 0
                status, err = f"{type(e).__name__}: {e}", e
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, status)
        if got[0] != "ok":
            raise RuntimeError(f"rank 0 could not write {out}: {got[0]}") from err
    except Exception as e:  # noqa: BLE001 - a failed export is a verdict, in words
        return failed("export", e, rank=rank)
    if rank == 0:
        files = ["adapter_model.safetensors", "adapter_config.json"]
        size = os.path.getsize(os.path.join(out, files[0]))
        ranks = sorted({m.rank for m in source.modules})
        print(
            f"weightsync export: {out}: LoRA adapter {source.adapter!r}: {len(source.metadata)} tensors "
            f"({len(source.modules)} modules, rank {'/'.join(map(str, ranks))}), {format_bytes(source.nbytes)} "
            f"({format_bytes(size)} on disk), gathered by {dist.get_world_size()} rank(s) in "
            f"{source.last_pass.collectives} all-gather(s), {gather_s:.2f}s"
        )
        print(f"  files: {', '.join(files)}")
        print("PASS")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """One export on every rank; rank 0 prints the report or the failure."""
    if getattr(args, "adapter", False):
        return run_export_adapter(args)
    import torch
    import torch.distributed as dist

    from ..checkpoint import save_safetensors
    from .build import build_source
    from .common import format_bytes

    rank = dist.get_rank()
    config = load_config(args.model, args.config, hidden=args.hidden, layers=args.layers)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        phase(f"building the {args.layout} model and its source")
        source = build_source(args, config, dtype)
        phase(f"writing {args.out}")
        report = save_safetensors(
            source, args.out, max_shard_bytes=parse_size(args.max_shard_size), config=config, overwrite=args.overwrite
        )
    except Exception as e:  # noqa: BLE001 - a failed export is a verdict, in words
        return failed("export", e, rank=rank)
    if rank == 0:
        rate = report.total_size / report.seconds / 1e6 if report.seconds > 0 else float("inf")
        print(
            f"weightsync export: {report.path}: {report.num_tensors} tensors, "
            f"{format_bytes(report.total_size)} in {report.num_shards} shard(s) "
            f"(largest {format_bytes(report.largest_shard_bytes)}), {report.seconds:.2f}s ({rate:.0f} MB/s), "
            f"written by rank {report.writer}; writer peak extra memory {format_bytes(report.peak_extra_bytes)}"
        )
        draft = getattr(source, "draft", None)
        if draft is not None:  # --mtp
            meta = draft.metadata
            size = sum(m.dtype.itemsize * math.prod(m.shape) for m in meta)
            print(f"  MTP (draft): {len(meta)} tensors, {format_bytes(size)}, "
                  f"{meta[0].name.rsplit('.', 2)[0] if len(meta) == 1 else _prefix([m.name for m in meta])}*")
        print(f"  files: {', '.join(report.files)}")
        print("PASS")
    return 0


def _prefix(names: list[str]) -> str:
    """The names' common prefix, cut after a dot."""
    pre = os.path.commonprefix(names)
    return pre[: pre.rfind(".") + 1]
