"""What a user can get wrong on the command line, checked before any rank starts and before torch,
transformers or megatron-core is imported: a usage error answers at once (exit 2, one line).

``validate_args`` is the CLI's gate; ``checkpoint_config`` is also re-run by the ``check`` ranks
(idempotent) to find the config of ``--checkpoint PATH``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["validate_args", "checkpoint_config", "layout_options", "MEGATRON_ONLY", "TORCH_DTYPES"]

#: Options that only a ``--layout megatron`` run uses.
MEGATRON_ONLY = ("tp", "pp", "vpp", "ep")
#: ``--dtype`` names (torch.dtype attributes of torch 2.x), checked before torch is imported; the
#: ranks check again against the real torch.
TORCH_DTYPES = frozenset((
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex32", "chalf",
    "complex64", "cfloat", "complex128", "cdouble", "uint8", "uint16", "uint32", "uint64", "int8",
    "int16", "short", "int32", "int", "int64", "long", "bool", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
))


def validate_args(args: argparse.Namespace) -> Any:
    """Everything a user can get wrong, checked before any rank starts and before torch,
    transformers or megatron-core is imported (a usage error answers at once). Fills the defaults
    of ``--nproc`` and, for ``--layout megatron``, ``--tp/--pp/--ep``. Returns the config's
    ``presets.ConfigFacts``; the ranks build the transformers config itself."""
    from ..testbed.presets import UserError, config_facts

    if args.config and args.model:
        raise UserError("pass --model or --config, not both")
    if args.command in ("check", "export"):
        layout_options(args)
        if args.nproc is None:
            args.nproc = args.tp * args.pp * args.ep if args.layout == "megatron" else 1
    nproc = getattr(args, "nproc", 1)
    if nproc < 1 or nproc > 64:
        raise UserError(f"--nproc must be between 1 and 64, got {nproc}")
    if getattr(args, "steps", 1) < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if getattr(args, "delta", False):
        if getattr(args, "quantize", None):
            raise UserError("--delta with --quantize is not supported by the CLI (DeltaSource(FP8Source(...)) "
                            "works in code)")
        if args.command == "check" and getattr(args, "checkpoint", None):
            raise UserError("check --delta compares with a dense pass, not a --checkpoint folder")
        if args.command == "demo" and not (args.packed and args.checksums):
            raise UserError("demo --delta sends sparse patches (never packed) and verifies every sync against a "
                            "dense pass: --no-packed / --no-checksums do not apply")
    elif getattr(args, "lr", None) is not None:
        raise UserError("--lr is for demo --delta")
    if getattr(args, "server", "loopback") == "vllm":
        given = [f for f, v in (("--delta", args.delta), ("--quantize", args.quantize), ("--config", args.config),
                                ("--hidden", args.hidden), ("--layers", args.layers)) if v]
        if args.model not in (None, "tiny-qwen3"):
            given.insert(0, "--model")
        if given:
            raise UserError(f"demo --server vllm serves its own tiny Qwen3 (fp32, random weights): {given[0]} "
                            "does not apply")
    if getattr(args, "names_only", False) and not getattr(args, "checkpoint", None):
        raise UserError("--names-only applies to check --checkpoint PATH")
    checkpoint_config(args)
    if getattr(args, "quantize", None) == "fp8" and getattr(args, "checkpoint", None) and (
        os.path.isfile(os.path.join(args.checkpoint, "config.json")) or not getattr(args, "quantize_config", None)
    ):
        _fp8_folder(args.checkpoint)
    if getattr(args, "checkpoint", None) and not any(n.endswith(".safetensors") for n in os.listdir(args.checkpoint)):
        # answered here, not after the ranks built a model (seconds): nothing in it could be compared
        raise UserError(f"--checkpoint {args.checkpoint}: no *.safetensors file in the folder (not a checkpoint "
                        "folder; weightsync export --out DIR or save_pretrained writes one)")
    facts = config_facts(args.model, args.config, hidden=args.hidden, layers=args.layers)
    if getattr(args, "dtype", None) and args.dtype not in TORCH_DTYPES:
        raise UserError(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float32)")
    if args.command in ("check", "export") and args.layout == "megatron":
        _validate_megatron(args, facts)
    if args.command in ("check", "export") and getattr(args, "mtp", False):
        _validate_mtp(args, facts)
    if args.command == "export":
        from .export import validate_export

        validate_export(args)
    return facts


def layout_options(args: argparse.Namespace) -> None:
    """``--tp/--pp/--vpp/--ep`` belong to ``--layout megatron``: given with another layout they are
    a usage error naming the option (a run would silently ignore them); with megatron each must be
    >= 1 (``--tp/--pp/--ep`` default to 1)."""
    from ..testbed.presets import UserError

    given = [flag for flag in MEGATRON_ONLY if getattr(args, flag) is not None]
    if args.layout != "megatron":
        if given:
            raise UserError(
                f"--{given[0]} applies to --layout megatron only; this run's layout is {args.layout} "
                f"(add --layout megatron, or drop {' '.join('--' + f for f in given)})"
            )
        return
    for flag in given:
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) is None:
            setattr(args, flag, 1)


def checkpoint_config(args: argparse.Namespace) -> None:
    """``check --checkpoint PATH``: PATH must be a folder (a file given instead is named as one,
    with its folder; ``validate_args`` then wants ``*.safetensors`` in it); without ``--model``/``--config`` the config is
    PATH/config.json (sets ``args.config``). Raises ``UserError``; idempotent."""
    from ..testbed.presets import UserError

    path = getattr(args, "checkpoint", None)
    if path is None:
        return
    if os.path.isfile(path):
        raise UserError(f"--checkpoint {path} is a file: pass the folder that holds it "
                        f"(--checkpoint {os.path.dirname(path) or '.'})")
    if not os.path.isdir(path):
        raise UserError(f"--checkpoint {path}: no such folder")

    if not args.model and not args.config:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(
                f"--checkpoint {path}: no config.json in it; pass --model or --config to say which "
                "model the folder should hold"
            )
        args.config = path


def _fp8_folder(path: str) -> None:
    """``check --quantize fp8 --checkpoint PATH``: PATH's config.json must declare an FP8 checkpoint
    (``quantization_config.quant_method == "fp8"``), else the comparison could only list every
    tensor as different: a usage error naming what the folder declares."""
    import json

    from ..testbed.presets import UserError

    try:
        with open(os.path.join(path, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        qc = None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise UserError(
            f"--quantize fp8 --checkpoint {path}: the folder is not an FP8 checkpoint (its config.json has "
            f"quantization_config.quant_method={method!r}, not 'fp8'); drop --quantize to check it as it is"
        )


def _validate_mtp(args: argparse.Namespace, facts: Any) -> None:
    """``--mtp``: a Megatron layout, a family with MTP names (``family_for(...).mtp``: plain data, no
    torch; the CPU builder builds every such family's MTP block), and none of the options it does not
    combine with."""
    import types

    from weightsync.sources.toolkit import family_for

    from ..testbed.presets import UserError

    if args.layout != "megatron":
        raise UserError("--mtp needs --layout megatron (megatron-core's MTP block; transformers holds no MTP weights)")
    if getattr(args, "adapter", False) or getattr(args, "quantize", None) or getattr(args, "delta", False):
        flag = "--adapter" if getattr(args, "adapter", False) else "--quantize" if args.quantize else "--delta"
        raise UserError(f"--mtp does not combine with {flag}")
    if args.command == "check" and not getattr(args, "checkpoint", None):
        raise UserError("check --mtp compares a checkpoint folder's MTP tensors: pass --checkpoint PATH "
                        "(transformers' save_pretrained, the oracle without one, holds no MTP layers)")
    try:
        family = family_for(types.SimpleNamespace(model_type=facts.model_type), check=False)
    except Exception:  # noqa: BLE001 - no family at all: the same answer as a family without MTP names
        family = None
    if family is None or family.mtp is None:
        raise UserError(f"--mtp: family {facts.model_type!r} has no multi-token-prediction (MTP) layers "
                        "(DeepSeek-V3/V3.2, GLM-4.5/GLM-5, Qwen3-Next and Qwen3.5 have)")


def _validate_megatron(args: argparse.Namespace, facts: Any) -> None:
    """``--layout megatron`` sizes against the config's ``ConfigFacts`` by the rules ``plan`` also
    asks (``testbed.layout_rules``; a fact the config file does not state is left to the ranks,
    which build the real config), then a model type the CPU builder builds."""
    from ..testbed.layout_rules import check_megatron_layout
    from ..testbed.presets import MEGATRON_MODEL_TYPES, UserError

    check_megatron_layout(facts, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, world=args.nproc)
    if facts.model_type not in MEGATRON_MODEL_TYPES:
        raise UserError(
            f"--layout megatron: no CPU Megatron builder for model_type {facts.model_type!r} "
            f"(supported: {', '.join(MEGATRON_MODEL_TYPES)})"
        )
