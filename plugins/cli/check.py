"""``weightsync check``: one dry-run pass of a source on CPU ranks, judged against the checkpoint.

Three things must agree for a pass to be PASS:

1. the source's ``metadata`` and its stream, on every rank (``check_stream``: names, order, dtypes,
   shapes, contiguity, count);
2. the metadata and the checkpoint transformers' ``save_pretrained`` writes for the same config
   (the oracle, module ``oracle``: names, shapes, and -- when no wire ``--dtype`` is asked for -- dtypes and bytes;
   with ``--expert-layout fused`` its per-expert tensors are folded into vLLM's fused names (0.33, 0.34),
   ``fold_experts``; with ``--expert-layout per_expert`` a checkpoint's fused experts (GPT-OSS) are
   unfolded into vLLM's per-expert names, ``unfold_experts``);
3. every rank's verdict (gathered, so a failure on any rank fails the check everywhere).

``--quantize fp8`` checks ``FP8Source`` over the same source: the oracle of 2. becomes the FP8
checkpoint of that index (``quantized_index``: each quantized weight ``float8_e4m3fn`` and its
float32 ``weight_scale_inv``), or, with ``--checkpoint``, the FP8 folder itself (whose
``quantization_config`` and scales then define what is quantized).

``--checkpoint PATH`` replaces the oracle of 2. with a checkpoint folder (``SafetensorsSource``'s
reader: headers only, validated) and adds bytes: rank 0 compares every tensor it yields with the
folder's tensor of that name (``safe_open``, read lazily), and a failure lists the first
differences (missing, extra, dtype, shape, bytes) in metadata order. Only rank 0 opens PATH. The
trainer model is then loaded from PATH itself (``trainer_model``: ``from_pretrained``), so a correct
sync equals any folder of the config byte for byte; ``--names-only`` loads nothing and compares
names, shapes and dtypes. With ``--quantize fp8`` the folder's FP8 tensors are not loaded: bytes
match only the seed-0 weights ``export --quantize fp8`` writes.

``--mtp`` (``--layout megatron``, families with MTP layers; needs ``--checkpoint``): the model is
built with megatron's MTP block and the source streams the policy, then the draft
(``build.PolicyAndDraft``, ``MegatronSource(part="mtp")``). transformers drops a folder's MTP tensors
on load, so the policy is loaded from the folder while the MTP tensors are megatron's seed-0
initialization, compared with the folder's straight from its safetensors files: they match a folder
``export --mtp`` wrote at the same ``--tp/--pp/--ep`` (megatron's initialization depends on the
layout). The report gives the MTP count and how many are byte-equal.

Layouts: ``fsdp`` (the HF model, FSDP2 over every rank, ``FSDPSource``) and ``megatron`` (a
megatron-core ``GPTModel`` built on CPU from the same config by ``testbed.megatron``, ``MegatronSource``
in ``mode="full"``: rank 0 is the only owner).

Rank 0 prints a table of what would be sent (tensors, bytes, dtypes, owners) and every unmapped
name: checkpoint tensors the source does not send and sent names the checkpoint does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync.sources.toolkit import get_logger

from ..testbed.presets import build_model, load_config
from .build import build_source
from .common import format_bytes, layout_label
from .oracle import checkpoint_index, fold_experts, quantized_index, unfold_experts
from .progress import phase

log = get_logger("weightsync.cli.check")

__all__ = ["run_check", "trainer_model", "FolderLoadError"]


def _owners(m: Any, world: int) -> str:
    if m.owners is None:
        return f"all {world}"
    return ",".join(str(r) for r in m.owners)


def _folder_dtype(path: str) -> torch.dtype:
    """The floating dtype most of a checkpoint folder's tensors have (headers only)."""
    from weightsync.sources.toolkit import read_checkpoint

    counts = Counter(e.dtype for _, e in read_checkpoint(path).entries() if e.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


def trainer_model(args: argparse.Namespace, config: Any) -> torch.nn.Module:
    """The transformers model check builds from: with ``--checkpoint PATH`` (and no ``--quantize``)
    the folder's own weights (``from_pretrained``, in the dtype most of its tensors have, eager
    attention; tensors that do not fit stay as built and are listed as differences), so a sync of
    them must equal the folder byte for byte; else ``build_model(config,
    seed=0)`` (``--names-only``: in the folder's dtype). Raises ``FolderLoadError`` when transformers
    cannot read the folder at all."""
    path = getattr(args, "checkpoint", None)
    if not path or getattr(args, "quantize", None):
        return build_model(config, seed=0)
    if getattr(args, "names_only", False):  # no weights loaded: seed 0, in the folder's dtype
        return build_model(config, seed=0, dtype=_folder_dtype(path))
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    what = f"the folder's weights do not load into the model of {args.config or args.model}"
    try:
        # What fits (by name and shape) is loaded; what does not stays as built and the comparison
        # lists it (a tensor missing from the folder, one the model lacks, another shape or dtype).
        with _expected_mtp_drop(getattr(args, "mtp", False)):
            return AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=_folder_dtype(path), attn_implementation="eager",
                ignore_mismatched_sizes=True,
            )
    except Exception as e:  # noqa: BLE001 - a usage error naming the folder and the config
        raise FolderLoadError(f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") from e


@contextlib.contextmanager
def _expected_mtp_drop(mtp: bool) -> Iterator[None]:
    """``check --mtp``: no transformers model holds MTP layers, so ``from_pretrained`` of a folder
    with them reports every MTP tensor as UNEXPECTED in a table (the "LOAD REPORT", with raw ANSI
    codes) that reads as an error while it is what weightsync expects. Silence transformers' loading
    warnings for that load only; check compares the folder's MTP tensors itself (its "MTP (draft)"
    line), and any other mismatch is still listed among its differences."""
    if not mtp:
        yield
        return
    import logging

    loader = logging.getLogger("transformers")  # the load report and the TP-plan notes of the same load
    level = loader.level
    loader.setLevel(logging.ERROR)
    log.info("check --mtp: transformers drops the folder's MTP tensors on load (expected); its load report is not shown")
    try:
        yield
    finally:
        loader.setLevel(level)


class FolderLoadError(RuntimeError):
    """``check --checkpoint``: the folder's tensors do not load into the config's model."""


def _fsdp_source(args: argparse.Namespace, config: Any, dtype: torch.dtype | None, rank: int):
    """The model sharded with FSDP2 over every rank and its ``FSDPSource``; the oracle on rank 0."""
    model = trainer_model(args, config)
    oracle = checkpoint_index(model) if rank == 0 and not getattr(args, "checkpoint", None) else None
    return (lambda: build_source(args, config, dtype, hf_model=model)), oracle


def _megatron_source(args: argparse.Namespace, config: Any, dtype: torch.dtype | None, rank: int):
    """This rank's megatron-core ``GPTModel`` chunk(s) for the config, loaded with the seed-0
    transformers model's tensors (built on rank 0 only), and their ``MegatronSource``
    (``mode="full"``: rank 0 sends); the oracle (``save_pretrained`` of the HF model) on rank 0."""
    model = trainer_model(args, config) if rank == 0 else None
    want_oracle = rank == 0 and not getattr(args, "checkpoint", None)
    oracle = checkpoint_index(model) if want_oracle else None
    return (lambda: build_source(args, config, dtype, hf_model=model)), oracle


def run_check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from weightsync.sources import check_stream

    from .validate import checkpoint_config

    rank, world = dist.get_rank(), dist.get_world_size()
    args.checkpoint = getattr(args, "checkpoint", None)
    checkpoint_config(args)
    config = load_config(args.model, args.config, hidden=args.hidden, layers=args.layers)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    build = _megatron_source if args.layout == "megatron" else _fsdp_source
    problems: list[str] = []
    meta, source, oracle = [], None, None
    names_only = bool(getattr(args, "names_only", False))
    phase(f"building the {args.layout} model and its source"
          + (" (and save_pretrained's tensors, the oracle)" if not args.checkpoint else ""))
    try:  # no collective inside: a rank that cannot load the folder must not leave the others waiting
        make, oracle = build(args, config, dtype, rank)
        load_error = None
    except FolderLoadError as e:
        make, load_error = None, str(e)
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, load_error)
    if any(errors):  # a configuration error, on every rank alike: the cause, exit 2
        from ..testbed.presets import UserError

        raise UserError(f"check --checkpoint {args.checkpoint}: {next(e for e in errors if e)} "
                        "(--names-only compares names, shapes and dtypes without loading the weights)")
    try:
        source = make()
        meta = source.metadata
    except Exception as e:  # noqa: BLE001 - reported as the verdict
        meta, source = [], None
        problems.append(f"rank {rank}: metadata failed: {type(e).__name__}: {e}")
    folder = _Folder.open(args.checkpoint, problems) if args.checkpoint and rank == 0 else None
    mine = [m for m in meta if m.owners is None or rank in m.owners]
    seen = 0
    phase(f"one pass of the source: {len(mine)} tensors on this rank"
          + (", compared with the folder" if folder is not None and not names_only else ""))
    if source is not None:
        bar = tqdm(
            total=len(mine), desc="weightsync check: pass", unit="tensor", file=sys.stderr,
            disable=rank != 0 or len(mine) < 64 or not sys.stderr.isatty(), leave=False,
        )
        try:
            for name, t in check_stream(source.iter_full(), mine, rank=rank, what="iter_full"):
                seen += 1
                if folder is not None and not names_only:
                    folder.compare(name, t)
                bar.update()
        except Exception as e:  # noqa: BLE001 - reported as the verdict
            problems.append(f"rank {rank}: pass failed: {type(e).__name__}: {e}")
        finally:
            bar.close()
            if folder is not None:
                folder.close()
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, (rank, seen, len(mine), problems))
    code = None
    if rank == 0:
        oracle = oracle or {}
        if args.checkpoint:
            oracle = folder.index if folder is not None else {}
        elif getattr(args, "expert_layout", None) == "fused":
            oracle = fold_experts(oracle)
        elif getattr(args, "expert_layout", None) == "per_expert":
            oracle = unfold_experts(oracle)
        if not args.checkpoint and source is not None and getattr(args, "quantize", None):
            oracle = quantized_index(oracle, source.config)
        code = _report(
            args, config, dtype, meta, oracle, verdicts, world, source,
            checkpoint=args.checkpoint, content=folder.bytes_differ if folder is not None else None,
            names_only=names_only,
        )
    box = [code]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _report(
    args: argparse.Namespace,
    config: Any,
    dtype: torch.dtype | None,
    meta: list[Any],
    oracle: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    verdicts: list[Any],
    world: int,
    source: Any,
    *,
    checkpoint: str | None = None,
    content: tuple[int, dict[str, str]] | None = None,
    names_only: bool = False,
) -> int:
    """Print the table and the verdict; 0 pass, 1 fail. ``oracle`` is save_pretrained's index, or
    with ``checkpoint`` that folder's (dtypes then always compared), and ``content`` is rank 0's
    byte comparison with it: (tensors compared, {name: how its bytes differ})."""
    what = args.config or (args.model or "tiny-qwen3")
    print(
        f"weightsync check: {what} ({config.model_type}, {config.num_hidden_layers} layers), "
        f"layout {layout_label(args, world)}, source {type(source).__name__ if source else '-'}, "
        f"wire dtype {str(dtype).removeprefix('torch.') if dtype else 'as trained'}"
    )
    total = _print_sent(meta, world, args.show)

    failures: list[str] = []
    for _rank, seen, expected, problems in verdicts:
        failures.extend(problems)
        if not problems and seen != expected:
            failures.append(f"rank {_rank}: stream yielded {seen} of {expected} tensors")
    names = {m.name for m in meta}
    not_sent = [k for k in oracle if k not in names]
    not_in_ckpt = [m.name for m in meta if m.name not in oracle]
    shape_diff = [
        f"{m.name}: sent {tuple(m.shape)}, checkpoint {oracle[m.name][1]}"
        for m in meta
        if m.name in oracle and tuple(m.shape) != oracle[m.name][1]
    ]
    dtype_diff = []
    if dtype is None or checkpoint:
        dtype_diff = [
            f"{m.name}: sent {m.dtype}, checkpoint {oracle[m.name][0]}"
            for m in meta
            if m.name in oracle and m.dtype != oracle[m.name][0]
        ]
    ckpt_bytes = sum(d.itemsize * _numel(s) for d, s in oracle.values())
    label = checkpoint or f"(save_pretrained of the same config{_fused_note(args)})"
    differ = content[1] if content is not None else {}
    if checkpoint and content is None:  # unreadable: the FAIL line says why; nothing to compare
        not_sent, not_in_ckpt, shape_diff, dtype_diff = [], [], [], []
        print(f"  checkpoint {label}: unreadable")
    else:
        print(f"  checkpoint {label}: {len(oracle)} tensors, {format_bytes(ckpt_bytes)}")
        print(f"  unmapped: checkpoint tensors not sent: {_some(not_sent)}")
        print(f"  unmapped: sent names not in the checkpoint: {_some(not_in_ckpt)}")
    if checkpoint and content is not None:
        if names_only:
            print("  bytes: not compared (--names-only)")
        else:
            print(f"  bytes: {content[0] - len(differ)} of {content[0]} tensors compared equal the checkpoint's")
        draft = getattr(source, "draft_names", None)
        if draft is not None:  # --mtp: the folder's MTP tensors (transformers drops them on load)
            equal = [n for n in draft if n in oracle and n not in differ and tuple(oracle[n][1]) == tuple(
                next(m.shape for m in meta if m.name == n))]
            seen = "not compared (--names-only)" if names_only else f"{len(equal)} equal the checkpoint's byte for byte"
            print(f"  MTP (draft): {len(draft)} tensors (MegatronSource part='mtp': megatron's seed-0 init at this "
                  f"{layout_label(args, world).split(' x')[0]}; bytes match a folder exported at the same layout), {seen}")
        diffs = _differences(meta, oracle, differ)
        if diffs:
            print(f"  first differences ({len(diffs)} in all, metadata order):")
            for item in diffs[:10]:
                print(f"    {item}")
            hint = _wire_dtype_hint(dtype, meta, oracle)
            if hint:
                print(f"  hint: {hint}")
            failures.append(f"{len(diffs)} difference(s) from checkpoint {checkpoint}, the first listed above")
    else:
        for label, items in (("shape", shape_diff), ("dtype", dtype_diff)):
            for item in items[:10]:
                print(f"  {label} differs: {item}")
    if (dtype is None or checkpoint) and oracle and not not_sent and not not_in_ckpt and total != ckpt_bytes:
        failures.append(f"bytes differ: sent {total}, checkpoint {ckpt_bytes}")
    dtypes = Counter(str(m.dtype).removeprefix("torch.") for m in meta)
    print(f"  stream vs metadata: {sum(v[1] for v in verdicts)} tensors checked on {world} rank(s); dtypes {dict(dtypes)}")
    for f in failures:
        print(f"  FAIL: {f}")
    ok = not (failures or not_sent or not_in_ckpt or shape_diff or dtype_diff or differ) and bool(meta)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _wire_dtype_hint(dtype: torch.dtype | None, meta: list[Any], oracle: dict[str, tuple[Any, Any]]) -> str:
    """``--dtype X`` against a folder saved in another dtype: every floating tensor differs in dtype
    and no byte can compare equal. Say so, in the flags the user typed, instead of leaving a list of
    dtype differences (empty when ``--dtype`` was not given or the dtypes agree)."""
    if dtype is None:
        return ""
    folder = Counter(oracle[m.name][0] for m in meta if m.name in oracle and m.dtype == dtype and oracle[m.name][0] != dtype)
    if not folder:
        return ""
    saved = str(folder.most_common(1)[0][0]).removeprefix("torch.")
    wire = str(dtype).removeprefix("torch.")
    return (f"the folder holds {saved} tensors and --dtype {wire} sends {wire}: drop --dtype (check then sends the "
            f"folder's dtype, {saved}) to compare the folder as saved, or export it with --dtype {wire}")


def _print_sent(meta: list[Any], world: int, show: int) -> int:
    """The table of what would be sent (tensors and bytes per dtype and owners, then the first
    ``show`` tensors); returns the total bytes."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for m in meta:
        g = groups[(str(m.dtype).removeprefix("torch."), _owners(m, world))]
        g[0] += 1
        g[1] += m.dtype.itemsize * _numel(m.shape)
    print(f"  {'tensors':>8}  {'bytes':>10}  {'dtype':<10} owners")
    for (dt, owners), (n, b) in sorted(groups.items()):
        print(f"  {n:>8}  {format_bytes(b):>10}  {dt:<10} {owners}")
    total = sum(m.dtype.itemsize * _numel(m.shape) for m in meta)
    print(f"  {len(meta):>8}  {format_bytes(total):>10}  total")
    for m in meta[:show]:
        print(f"    {m.name}  {str(m.dtype).removeprefix('torch.')}  {tuple(m.shape)}  owners {_owners(m, world)}")
    return total


def _differences(
    meta: list[Any], oracle: dict[str, tuple[torch.dtype, tuple[int, ...]]], differ: dict[str, str]
) -> list[str]:
    """Every difference between what is sent and the checkpoint, one line each: sent tensors in
    metadata order, then checkpoint tensors that are not sent."""
    out = []
    for m in meta:
        if m.name not in oracle:
            out.append(f"{m.name}: sent ({_dt(m.dtype)} {tuple(m.shape)}), not in the checkpoint")
            continue
        dt, shape = oracle[m.name]
        if dt != m.dtype or tuple(shape) != tuple(m.shape):
            out.append(f"{m.name}: sent {_dt(m.dtype)} {tuple(m.shape)}, checkpoint {_dt(dt)} {tuple(shape)}")
        elif m.name in differ:
            out.append(f"{m.name}: {differ[m.name]}")
    names = {m.name for m in meta}
    out += [
        f"{k}: in the checkpoint ({_dt(d)} {tuple(s)}), not sent" for k, (d, s) in oracle.items() if k not in names
    ]
    return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Folder:
    """Rank 0's side of ``check --checkpoint``: the folder's ``{name: (dtype, shape)}`` from its
    headers (``read_checkpoint``: validated, no tensor data read) and, per streamed tensor, a byte
    comparison with the file's tensor of that name (``safe_open``, mapped lazily; one handle per
    shard, closed by ``close``). Only names whose dtype and shape agree are compared: the rest are
    already differences."""

    def __init__(self, layout: Any) -> None:
        self.where = {e.name: (shard.path, e) for shard, e in layout.entries()}
        self.index = {n: (e.dtype, e.shape) for n, (_, e) in self.where.items()}
        self.compared = 0
        self.differ: dict[str, str] = {}
        self._handles: dict[str, Any] = {}

    @classmethod
    def open(cls, path: str, problems: list[str]) -> "_Folder | None":
        from weightsync.sources import CheckpointError
        from weightsync.sources.toolkit import read_checkpoint

        try:
            return cls(read_checkpoint(path))
        except CheckpointError as e:
            problems.append(f"rank 0: checkpoint unreadable: {e}")
            return None

    @property
    def bytes_differ(self) -> tuple[int, dict[str, str]]:
        return self.compared, self.differ

    def compare(self, name: str, t: torch.Tensor) -> None:
        if name not in self.where:
            return
        path, e = self.where[name]
        if e.dtype != t.dtype or tuple(e.shape) != tuple(t.shape):
            return
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        want = self._handles[path].get_tensor(name)
        got = t.detach().to("cpu").contiguous()
        self.compared += 1
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(got.element_size())
        if as_int is None or got.numel() == 0:
            return
        a, b = got.reshape(-1).view(as_int), want.reshape(-1).view(as_int)
        bad = int((a != b).sum())
        if bad:
            worst = ""
            if got.is_floating_point():
                worst = f"; max |sent - checkpoint| {float((got.float() - want.float()).abs().max()):.3g}"
            self.differ[name] = f"bytes differ in {bad} of {got.numel()} elements{worst}"

    def close(self) -> None:
        self._handles.clear()


def _fused_note(args: argparse.Namespace) -> str:
    return ", experts folded to vLLM's fused names" if getattr(args, "expert_layout", None) == "fused" else ""


def _some(names: list[str], n: int = 12) -> str:
    if not names:
        return "none"
    return str(names[:n]) + (f" ... ({len(names)} in all)" if len(names) > n else "")


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
