"""GPU evidence, delta sync (issue 32): ``DeltaSource`` rounds diffed and extracted on CUDA are exact.

One CUDA device, one rank. Sources (tiny Qwen3 config, ``hf_side.tiny_config``):

* ``plain bf16``: ``FSDPSource`` over a plain transformers model in bf16 (world size 1: no sharding);
  changes are parameter noise on ~2% of the elements of half the tensors, plus a ``0.0`` that becomes
  ``-0.0`` (a change only a bitwise diff sees);
* ``fsdp2 fp32->bf16``: the same model in fp32 under FSDP2 (``fully_shard`` per layer and at the
  root, a 1-rank mesh), ``FSDPSource(dtype=bfloat16)``; changes are Adam steps at an RL learning rate
  (most fp32 updates round away in bf16), plus an fp32-only nudge that must not show;
* ``megatron TP1 fp32->bf16``: a megatron-core ``GPTModel`` from the one builder
  (``megatron_side.build_megatron``, as ``part_ipc.py`` builds it) exported by
  ``MegatronSource(dtype=bfloat16)``; changes are parameter noise;

each with ``snapshot="device"`` and ``snapshot="cpu"``. Rounds: anchor, two change rounds, a
no-change round, ``reset()`` then an anchor, one more change round. After every round:

* the round's patch set equals the set of changed elements: for each tensor, the patch's indices are
  exactly the positions where a dense ``iter_full`` pass after the change differs bitwise from the
  one before it (both passes kept on the device, compared there), its values are the new pass's at
  those positions; no patch for an unchanged tensor; an anchor carries every element of every tensor;
* a receiver on the device (``sparse_side.CheckpointTensors``, started with other values) fed only
  the rounds, through vLLM's own ``load_checkpoint_weight_patches`` on CUDA tensors, equals the dense
  pass bitwise;
* ``last_round`` agrees (anchor flag, changed elements, 6 wire bytes per changed element) and the
  snapshot is where ``snapshot=`` put it, one wire-dtype copy of the model.

``--dry-run``: the same on CPU (gloo for the 1-rank group, the Megatron model built on CPU).

    python tests/gpu/part_delta.py [--sources plain,fsdp2,megatron] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402

SOURCES = ("plain", "fsdp2", "megatron")
SNAPSHOTS = ("device", "cpu")
#: rounds of every scenario: what happens to the trainer's weights before each
ROUNDS = ("anchor", "change", "change", "none", "reset", "change")
#: Adam's learning rate for the fp32 -> bf16 scenario: an RL-like step, most of it absorbed by bf16
ADAM_LR = 1e-5


def _build(kind: str, device: str, facts: Facts) -> tuple[Any, Any, Any]:
    """(module whose weights the rounds change, the dense source, a change function ``step -> None``)."""
    import torch

    from hf_side import build_hf, tiny_config

    from weightsync.sources import FSDPSource, MegatronSource

    cfg = tiny_config("qwen3")
    if kind == "plain":
        model = build_hf(cfg, device=device, dtype=torch.bfloat16, seed=21)
        return model, FSDPSource(model), _noise_fn(model, seed=31)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = build_hf(cfg, device=device, dtype=torch.float32, seed=22).train()
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")
        facts.check("fsdp2: model is FSDP2-sharded (1-rank mesh)", sharded == len(list(model.parameters())),
                    f"{sharded} DTensor parameters")
        opt = torch.optim.Adam(model.parameters(), lr=ADAM_LR)

        def step(k: int) -> None:
            g = torch.Generator().manual_seed(100 + k)
            ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # an fp32-only change: below half a bf16 step, must not show
                p = model.model.norm.weight
                local = p.to_local() if hasattr(p, "to_local") else p
                local.mul_(1 + 2 ** -12)

        return model, FSDPSource(model, dtype=torch.bfloat16), step
    if kind == "megatron":
        from megatron_side import allow_cpu_forward, build_megatron, describe, init_parallel

        init_parallel(device)
        if not device.startswith("cuda"):
            allow_cpu_forward()
        model = build_megatron(cfg, dtype=torch.float32, device=device, seed=23)
        log(f"[delta] megatron trainer: {describe(model)}")
        return model, MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16), _noise_fn(model, seed=33)
    raise KeyError(kind)


def _noise_fn(model: Any, *, seed: int):
    """Parameter noise: in every other parameter (sorted names, rotating with the step), ~2% of the
    elements scaled by 1.05 (a bf16 change) -- plus, on the first parameter, one element set to
    ``0.0`` on odd steps and ``-0.0`` on even ones."""
    import torch

    named = sorted(model.named_parameters(), key=lambda kv: kv[0])

    @torch.no_grad()
    def step(k: int) -> None:
        g = torch.Generator().manual_seed(seed + k)
        for j, (_, p) in enumerate(named):
            if (j + k) % 2:
                continue
            flat = p.data.view(-1)
            mask = (torch.rand(flat.numel(), generator=g) < 0.02).to(flat.device)
            flat.copy_(torch.where(mask, flat * 1.05 + 1e-3, flat))
        first = named[0][1].data.view(-1)
        first[7] = 0.0 if k % 2 else -0.0

    return step


def _dense(src: Any) -> dict[str, Any]:
    """One dense ``iter_full`` pass, cloned where it was yielded (the oracle of the next round)."""
    return {n: t.detach().clone() for n, t in src.iter_full()}


def _round(label: str, r: int, what: str, delta: Any, src: Any, recv: Any, before: dict[str, Any] | None,
           facts: Facts) -> dict[str, Any]:
    """Run one round, check it, return the dense pass after it."""
    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from sparse_side import bits, bitwise_equal, changed_indices

    tag = f"{label} round {r} ({what})"
    expect_anchor = what in ("anchor", "reset")
    facts.check(f"{tag}: anchor_next == {expect_anchor}", delta.anchor_next == expect_anchor, delta.anchor_next)
    patches = list(delta.iter_patches())
    after = _dense(src)
    st = delta.last_round
    # 1. the patch set is exactly the set of changed elements
    problems: list[str] = []
    by_name = {}
    for p in patches:
        if p.name in by_name:
            problems.append(f"{p.name}: two patches")
        by_name[p.name] = p
    changed_total = 0
    for name, new in after.items():
        p = by_name.pop(name, None)
        n = new.numel()
        if expect_anchor or before is None:
            want = torch.arange(n, device=new.device)
        else:
            want = changed_indices(before[name], new)
        changed_total += want.numel()
        if p is None:
            if want.numel():
                problems.append(f"{name}: {want.numel()} changed elements, no patch")
            continue
        if p.indices.dtype != torch.int32 or p.values.dtype != new.dtype or tuple(p.full_shape) != tuple(new.shape):
            problems.append(f"{name}: patch {p.indices.dtype} {p.values.dtype} {tuple(p.full_shape)}")
            continue
        idx = p.indices.to(torch.int64).to(new.device)
        srt, order = torch.sort(idx)
        if srt.numel() != want.numel() or not torch.equal(srt, want):
            problems.append(f"{name}: patch has {idx.numel()} indices, {want.numel()} elements changed")
            continue
        if not torch.equal(bits(p.values.to(new.device))[order], bits(new).index_select(0, want)):
            problems.append(f"{name}: patch values differ from the dense pass at its indices")
    problems += [f"{n}: a patch for an unknown tensor" for n in by_name]
    facts.check(f"{tag}: patch set == changed elements of the dense passes (indices and values, bitwise)",
                not problems, problems[:5] or f"{len(patches)} patches, {changed_total} elements")
    on_device = {str(p.values.device.type) for p in patches} | {str(p.indices.device.type) for p in patches}
    facts.check(f"{tag}: patches live where the source yields ({next(iter(after.values())).device.type})",
                on_device <= {next(iter(after.values())).device.type}, sorted(on_device) or "no patches")
    wire = sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size() for p in patches)
    facts.check(f"{tag}: last_round (anchor {expect_anchor}, changed, wire bytes) agrees",
                st.completed and st.anchor == expect_anchor and st.changed == changed_total
                and st.wire_bytes == wire and (not patches or wire == 6 * changed_total or expect_anchor),
                f"anchor={st.anchor} changed={st.changed}/{st.elements} wire={st.wire_bytes} patches={len(patches)}")
    if what == "none":
        facts.check(f"{tag}: nothing changed, nothing yielded", not patches and st.changed == 0, len(patches))
    elif what == "change":
        facts.number(f"{tag} changed fraction", round(st.changed_fraction, 5))
        facts.check(f"{tag}: a sparse round (some but not all elements)", 0 < st.changed < st.elements,
                    f"{st.changed}/{st.elements}")
    # 2. vLLM's own apply on the receiver, then receiver == dense pass
    load_checkpoint_weight_patches(recv, [
        CheckpointWeightPatch(p.name, tuple(p.full_shape), p.values.dtype, p.values, p.indices) for p in patches])
    bad = [n for n, t in after.items() if not bitwise_equal(recv.held[n], t)]
    facts.check(f"{tag}: receiver (vLLM load_checkpoint_weight_patches) == dense iter_full, bitwise",
                not bad, bad[:5] or f"{len(after)} tensors")
    return after


def run(kind: str, snapshot: str, device: str, facts: Facts) -> None:
    import torch

    from sparse_side import CheckpointTensors

    from weightsync.sources import DeltaSource

    label = f"{kind} snapshot={snapshot}"
    model, src, change = _build(kind, device, facts)
    delta = DeltaSource(src, snapshot=snapshot)
    facts.check(f"{label}: diffed where the shards live (iter_pieces)", delta.pieces_native, type(src).__name__)
    recv = CheckpointTensors([(m.name, m.dtype, tuple(m.shape)) for m in delta.metadata], device)
    before = None
    k = 0
    for r, what in enumerate(ROUNDS, start=1):
        if what == "change":
            k += 1
            change(k)
        elif what == "reset":
            delta.reset()
        before = _round(label, r, what, delta, src, recv, before, facts)
        if r == 1:
            where, host_pinned = delta.snapshot_placement
            want = "cpu" if snapshot == "cpu" else torch.device(device).type
            wire = sum(math.prod(m.shape) * m.dtype.itemsize for m in delta.metadata)
            pinned = host_pinned if (want == "cpu" and device.startswith("cuda")) else True
            facts.check(f"{label}: snapshot on {want}{' (pinned)' if want == 'cpu' and device != 'cpu' else ''}, "
                        "one wire-dtype copy of the model", where == {want} and delta.snapshot_bytes == wire
                        and pinned, f"{sorted(where)} {delta.snapshot_bytes}/{wire} bytes pinned={pinned}")
    del model


def kernel_edges(device: str, facts: Facts) -> None:
    """``diff_triton`` (the fused CUDA diff) against the torch path of ``Snapshots.diff_group`` and a
    naive oracle (torch's cast + integer compare) on edge values -- NaNs of both signs and several
    payloads, +-0, +-inf, the largest finites, fp32 / bf16 / fp16 subnormals, round-to-nearest-even
    ties; fp32, bf16 and fp16 masters into bf16, fp16 and fp32 wires; pieces ending mid-block; a
    group where every element changed and a 7-slot output (the second launch). Positions, values
    (bit for bit, NaN patterns included), NaN flags and the committed snapshot
    (``tests/delta_edges.py``, which the CPU suite runs under Triton's interpreter)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from delta_edges import check

    for label, ok, detail in check(device, kernels=True):
        facts.check(f"diff_triton edges: {label}", ok, detail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {SOURCES}")
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo, Megatron built on CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("delta", dry_run=args.dry_run)
    import torch

    from receiver import preload_checkpoint_weight_patch

    preload_checkpoint_weight_patch()

    device = "cpu" if args.dry_run else "cuda:0"
    if not args.dry_run:
        if not torch.cuda.is_available():
            facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
            return facts.finish(args.json)
        torch.cuda.set_device(0)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    try:
        from part_ipc import _init_dist

        _init_dist(device)
    except Exception as e:  # noqa: BLE001
        facts.error("setup", e)
        return facts.finish(args.json)
    if not args.dry_run:
        try:
            kernel_edges(device, facts)
        except Exception as e:  # noqa: BLE001
            facts.error("diff_triton edges", e)
    for kind in [s for s in args.sources.split(",") if s]:
        for snapshot in SNAPSHOTS:
            try:
                run(kind, snapshot, device, facts)
            except Exception as e:  # noqa: BLE001 - the next scenario still runs
                facts.error(f"{kind} snapshot={snapshot}", e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
