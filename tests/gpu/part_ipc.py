"""Part 1 of the GPU evidence: weightsync sources through vLLM's real CUDA IPC engines.

Trainer (this process): a tiny Qwen3-style model, either a transformers model under FSDP2 (world
size 1, ``fully_shard`` per decoder layer and at the root) exported by ``FSDPSource``, or a TP1
megatron-core ``GPTModel`` exported by ``MegatronSource``; vLLM's ``IPCTrainerWeightTransferEngine``
built by ``WeightTransferTrainerFactory.trainer_init`` drives ``send_weights()``.
Receiver (spawned process): vLLM's ``IPCWeightTransferEngine`` loading into a transformers model of
the same config (``receiver.py``). ``--source module`` runs vLLM's own ``ModuleSource`` on the plain
model through the same harness: the control that tells a harness failure from a source failure.
``--source lora`` wraps the FSDP2 trainer's model in PEFT LoRA (every linear, non-zero B): the plain
transformers receiver can only match the trainer's logits through ``FSDPSource``'s merged weights.
``--source safetensors`` has no trainer model: ``save_pretrained`` writes a sharded fp32 checkpoint and
``SafetensorsSource(folder, dtype=bfloat16, device="cuda")`` feeds vLLM's IPC engine from the files
(see ``run_safetensors``).

``--family`` takes a comma list of ``hf_side.FAMILIES`` (default qwen3; the checks of any other
family start with its name): e.g. ``glm4_moe`` -- partial rotary, q/k/v biases, q/k norms, a dense
first layer, routed + shared experts, a sigmoid router whose score-correction bias stays fp32 in a
bf16 model. The frontier families (``hf_side.FRONTIER``: qwen3_next, qwen3_5_text,
qwen3_5_moe_text, deepseek_v32, glm_moe_dsa; part ``ipc_frontier``) are weightsync's tiny presets;
their Megatron trainer is the one builder's model (``megatron_side.build_frontier``), and the
receiver's logits are compared with transformers' forward of the trainer's export, while what the
receiver got on the first sync must be ``save_pretrained`` of that transformers model byte for byte
(Megatron's own forward of these families is the subject of ``part_frontier.py``).

Checked, packed and unpacked, each over two refits (the second after the trainer's weights changed):
* exported names/shapes equal what transformers' ``save_pretrained`` writes for the config;
* the receiver got exactly the exported tensors, bit for bit, in order, and every receiver parameter
  was written; with a transformers trainer (FSDP, ``ModuleSource``), what it got on the first sync is
  ``save_pretrained`` of the trainer's model, name by name and byte for byte;
* the receiver's logits on a fixed batch equal the trainer's (FSDP, bf16: the FSDP2 forward of the
  same transformers model; Megatron, fp32 with TF32 off: Megatron's own forward, 2e-4 relative).

``--dry-run`` runs it all on CPU with gloo and a loopback transport instead of CUDA IPC (Megatron's
forward with ``megatron_side.allow_cpu_forward``).

``--transport nccl`` (parts ``nccl_dense``, ``nccl_fp8``): the same round trips through vLLM's dense NCCL
engines instead (``NCCLTrainerWeightTransferEngine`` -> ``NCCLWeightTransferEngine``, one sender, one
worker), on two GPUs or on one under NCCL's multi-rank mode (``nccl_one_gpu``); a skip otherwise.

    python tests/gpu/part_ipc.py --source fsdp,megatron,module,safetensors [--family qwen3,glm4_moe]
        [--transport ipc|nccl] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402

#: packed buffer for the tiny model: above its largest tensor (the 1000x256 fp32 embedding),
#: small enough that the transfer takes many chunks.
PACKED_BUFFER_BYTES = 1_100_000


def _buffer_bytes(src) -> int:
    """The packed buffer for ``src``: ``PACKED_BUFFER_BYTES``, or its largest tensor if larger (a fused
    expert tensor, e.g. GPT-OSS's ``gate_up_proj``, cannot be split across buffers)."""
    import math

    largest = max(math.prod(m.shape) * m.dtype.itemsize for m in src.metadata)
    return max(PACKED_BUFFER_BYTES, largest)


#: fp32 logits of two implementations (Megatron vs transformers, TF32 off) agree to this.
FP32_CROSS_IMPL_REL = 2e-4
#: bf16 logits of the same transformers model (FSDP2 forward vs plain forward, or two processes).
BF16_SAME_IMPL_REL = 1e-2
#: The Megatron trainer runs in fp32 so that its logits can be compared tightly with the
#: receiver's transformers forward; so does the LoRA trainer, whose unmerged forward (base and
#: adapter paths rounded separately) differs from a merged one by 2-5% in bf16. The transformers
#: trainers run in bf16 (the usual wire dtype).
DTYPES = {"module": "bfloat16", "fsdp": "bfloat16", "lora": "float32", "megatron": "float32"}
#: The model of ``--family``'s default; check names of other families start with the family.
DEFAULT_FAMILY = "qwen3"


def _init_dist(device: str) -> None:
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    # one rank: an in-process store, so parallel parts never race for a port
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )


def _build_trainer(kind: str, cfg, device: str, dtype, facts: Facts, label: str = ""):
    """(model, source, trainer_logits_fn, module whose parameters the refit mutates, ``{name:
    digest}`` of ``save_pretrained`` of the trainer's transformers model before sharding, or None
    where the trainer is not one: LoRA, Megatron). ``label`` names the checks (default ``kind``)."""
    import torch

    from hf_side import build_hf, fixed_batch, hf_logits, saved_digests
    from megatron_side import FRONTIER_TYPES

    ids = fixed_batch(cfg.vocab_size, device=device)
    label = label or kind
    if kind in ("fsdp", "module", "lora"):
        model = build_hf(cfg, device=device, dtype=dtype, seed=11)
        saved = saved_digests(model) if kind != "lora" else None
        if kind == "module":
            from vllm.distributed.weight_transfer import ModuleSource

            return model, ModuleSource(model), (lambda: hf_logits(model, ids)), model, saved
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightsync.sources import FSDPSource

        layers = model.model.layers
        if kind == "lora":
            # PEFT LoRA on every linear projection, B initialized non-zero so the merge is visible;
            # the receiver is a plain transformers model: it can only match through merged weights.
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(5)
            lcfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
            model = get_peft_model(model, lcfg)
            layers = model.base_model.model.model.layers
            log(f"[ipc] lora trainer: {sum(1 for n, _ in model.named_parameters() if 'lora_' in n)} adapter tensors")
            with model.disable_adapter():
                base_only = hf_logits(model, ids)
            c = _cmp(hf_logits(model, ids), base_only)
            facts.check("lora: the adapters move the logits far beyond the tolerance (an unmerged export "
                        "would fail the logits checks)", c["rel_err"] > 100 * FP32_CROSS_IMPL_REL, c)
        plain_logits = hf_logits(model, ids)
        mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (1,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")
        facts.check(f"{label}: model is FSDP2-sharded", sharded == len(list(model.parameters())),
                    f"{sharded} DTensor parameters")
        cmp_fsdp = _cmp(hf_logits(model, ids), plain_logits)
        facts.check(f"{label}: FSDP2 forward equals the plain forward (harness sanity)",
                    cmp_fsdp["rel_err"] <= BF16_SAME_IMPL_REL, cmp_fsdp)
        return model, FSDPSource(model), (lambda: hf_logits(model, ids)), model, saved
    if kind == "megatron":
        from megatron_side import allow_cpu_forward, build_megatron, describe, init_parallel, megatron_logits

        from weightsync.sources import MegatronSource

        init_parallel(device)
        if not device.startswith("cuda"):  # before the build: a MoE router allocates its expert bias there
            allow_cpu_forward()
        model = build_megatron(cfg, dtype=dtype, device=device, seed=11)
        log(f"[ipc] megatron trainer: {describe(model)}")
        src = MegatronSource(model, hf_config=cfg)
        if cfg.model_type in FRONTIER_TYPES:
            # Megatron's forward of these families is the oracle parts' subject (oracle_dsa,
            # oracle_gdn: stand-ins and kernels there); here the reference is transformers' own
            # forward of the trainer's current export (same implementation as the receiver), and
            # save_pretrained of that model is what the receiver must get byte for byte.
            from hf_side import saved_digests

            return model, src, (lambda: hf_logits(_export_model(src, cfg, device), ids)), model, \
                saved_digests(_export_model(src, cfg, device))
        fn = lambda: megatron_logits(model, ids, cfg.vocab_size)  # noqa: E731
        return model, src, fn, model, None
    raise KeyError(kind)


def _export_model(src, cfg, device: str):
    """A transformers model of ``cfg`` (fp32) holding ``src``'s current export, loaded strictly
    (``HFReceiver``: every parameter written, no unknown name)."""
    import torch

    from hf_side import HFReceiver, build_hf

    hf = build_hf(cfg, device=device, dtype=torch.float32, seed=99)
    recv = HFReceiver(hf, track=False)
    recv.load_weights(src.iter_full())
    if recv.missing():
        raise AssertionError(f"export left transformers parameters unwritten: {recv.missing()[:5]}")
    return hf


def _cmp(a, b):
    from hf_side import compare_logits

    return compare_logits(a, b)


def run_source(kind: str, family: str, device: str, mode: str, client, facts: Facts) -> None:
    import torch

    from hf_side import checkpoint_layout, digest, fixed_batch, tiny_config
    from megatron_side import FRONTIER_TYPES
    from receiver import shutdown_pair, trainer_engine

    if kind == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as e:
            facts.skip("lora", f"peft is not importable here ({e}): run bash .ci/kit-extras before shipping .kit")
            return
    from weightsync.sources.core.ground.dtype_policy import WirePolicy

    cfg = tiny_config(family)
    ids = fixed_batch(cfg.vocab_size, device="cpu")
    dtype = getattr(torch, DTYPES[kind])
    label = kind if family == DEFAULT_FAMILY else f"{family} {kind}"
    model, src, trainer_logits, mutable, saved = _build_trainer(kind, cfg, device, dtype, facts, label)
    layout = checkpoint_layout(cfg)
    meta = {m.name: tuple(m.shape) for m in src.metadata}
    want = {k: v[1] for k, v in layout.items()}
    facts.check(f"{label}: metadata names == save_pretrained names", set(meta) == set(want),
                f"only in metadata {sorted(set(meta) - set(want))[:5]}, "
                f"only in checkpoint {sorted(set(want) - set(meta))[:5]}")
    bad_shapes = {k: (meta[k], want[k]) for k in set(meta) & set(want) if meta[k] != want[k]}
    facts.check(f"{label}: metadata shapes == save_pretrained shapes", not bad_shapes, bad_shapes or len(meta))
    # Routers and score-correction biases (the wire policy's keep-fp32 names) may be fp32 in a bf16
    # model, as transformers keeps them; every other tensor travels in the model's dtype.
    keeps = WirePolicy.build(None).keeps
    wire = {str(m.dtype) for m in src.metadata if not keeps(m.name)}
    kept = {str(m.dtype) for m in src.metadata if keeps(m.name)}
    facts.check(f"{label}: wire dtype is the model's {DTYPES[kind]} (kept-fp32 names: {sorted(kept)})",
                wire == {str(dtype)} and kept <= {str(dtype), "torch.float32"}, (wire, kept))
    cross_impl = kind in ("megatron", "lora")
    tol = FP32_CROSS_IMPL_REL if cross_impl else BF16_SAME_IMPL_REL
    ref_name = {"megatron": "Megatron fwd", "lora": "PEFT unmerged fwd"}.get(kind, "same model")
    if kind == "megatron" and cfg.model_type in FRONTIER_TYPES:
        ref_name = "transformers fwd of the trainer's export, fp32"

    for packed in (False, True):
        tag = f"{label}/{'packed' if packed else 'unpacked'}"
        client.call("build", (cfg, dtype, 1000 + packed, True))
        eng = trainer_engine(mode, client=client, source=src, packed=packed, buffer_bytes=_buffer_bytes(src))
        if mode == "nccl":
            from nccl_one_gpu import loaded_nccl

            facts.number(f"{tag} trainer communicator", loaded_nccl(eng.model_update_group))
        try:
            first: list = []  # refit 1's export, compared with refit 2's
            for refit in (1, 2):
                if refit == 2:
                    with torch.no_grad():  # the trainer's weights change between refits
                        for p in mutable.parameters():
                            p.mul_(1.25)
                client.call("reset")
                exported = [(n, digest(t)) for n, t in src.iter_full()]
                eng.send_weights()
                rep = client.call("report")
                got = [tuple(x) for x in rep["received"]]
                same = got == exported
                detail = f"{len(got)} tensors" if same else _first_diff(got, exported)
                facts.check(f"{tag} refit {refit}: receiver tensors == exported (bitwise, in order)", same, detail)
                facts.check(f"{tag} refit {refit}: every receiver parameter written", not rep["missing"],
                            rep["missing"][:5] or "all")
                if refit == 2:
                    facts.check(f"{tag}: refit 2 exported new values", exported != first, "digests changed")
                else:
                    first = exported
                    if saved is not None and not packed:  # the trainer as built (later passes follow refits)
                        diff = sorted(n for n in set(saved) | {n for n, _ in got} if saved.get(n) != dict(got).get(n))
                        facts.check(f"{tag} refit 1: receiver tensors == save_pretrained of the trainer's model "
                                    "(bitwise: names, dtypes, shapes, bytes)", not diff,
                                    f"{len(saved)} tensors" if not diff else f"differ: {diff[:5]}")
                ref = trainer_logits().cpu()
                c = _cmp(client.call("logits", ids), ref)
                facts.check(
                    f"{tag} refit {refit}: receiver logits == trainer logits "
                    f"({ref_name}, rel<= {tol})",
                    c["shape_equal"] and c["finite"] and c["rel_err"] <= tol, c,
                )
        finally:
            shutdown_pair(eng, client, mode)


def run_safetensors(kind: str, family: str, device: str, mode: str, client, facts: Facts) -> None:
    """A checkpoint folder through vLLM's IPC engines: ``save_pretrained`` of a seed-11 fp32 model,
    sharded; ``SafetensorsSource(folder, dtype=bfloat16, device=device)`` (files read lazily, cast
    and moved on the way out); vLLM's IPC trainer engine into a receiver built with other weights.

    Checked, unpacked and packed: metadata == the files (safe_open: names, and their on-disk order
    where safetensors has ``offset_keys``), owners (0,), bf16 wire; the receiver's tensors == the files' tensors cast to bf16, bit for bit,
    in order; every receiver parameter written; the receiver's logits == transformers'
    ``from_pretrained(folder, dtype=bfloat16)`` logits. Negative controls: before each sync the
    receiver's logits are far from the checkpoint's; after one shard is truncated, a new source
    raises ``CheckpointError`` naming the file, and the source built before refuses to send (the
    receiver gets nothing)."""
    import tempfile

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hf_side import build_hf, digest, fixed_batch, hf_logits, tiny_config
    from receiver import shutdown_pair, trainer_engine

    from weightsync.sources import CheckpointError, SafetensorsSource

    cfg = tiny_config(family)
    ids = fixed_batch(cfg.vocab_size, device="cpu")
    wire = torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="ws-ipc-ckpt-") as root:
        folder = os.path.join(root, "ckpt")
        build_hf(cfg, device="cpu", dtype=torch.float32, seed=11).save_pretrained(folder, max_shard_size="1MB")
        shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        facts.check("safetensors: save_pretrained wrote a sharded fp32 checkpoint", len(shards) >= 2, shards)
        files: dict[str, str] = {}  # name -> digest of the file's tensor cast to the wire dtype
        on_disk: list[str] | None = []  # safe_open's on-disk order (offset_keys: safetensors >= 0.4.4)
        for fn in shards:
            with safe_open(os.path.join(folder, fn), "pt") as h:
                files.update({k: digest(h.get_tensor(k).to(wire)) for k in h.keys()})
                on_disk = on_disk + h.offset_keys() if on_disk is not None and hasattr(h, "offset_keys") else None
        src = SafetensorsSource(folder, dtype=wire, device=device)
        names = [m.name for m in src.metadata]
        facts.check("safetensors: metadata names == the files' names", sorted(names) == sorted(files),
                    f"{len(names)} tensors")
        if on_disk is None:
            facts.skip("safetensors: metadata order == on-disk order", "this safetensors has no offset_keys()")
        else:
            facts.check("safetensors: metadata order == safe_open's on-disk order, shard by shard",
                        names == on_disk, f"first {names[:2]}")
        files_in_order = [(n, files[n]) for n in names]
        facts.check("safetensors: every entry owned by rank 0 only, bf16 on the wire",
                    all(m.owners == (0,) and m.dtype == wire for m in src.metadata),
                    {str(m.dtype) for m in src.metadata})
        first = next(iter(src.iter_full()))[1]
        facts.check(f"safetensors: tensors are yielded on {device}", first.device.type == torch.device(device).type,
                    first.device)
        del first
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=wire, attn_implementation="eager").to(device)
        ref_logits = hf_logits(ref.eval(), ids.to(device)).cpu()
        del ref
        for packed in (False, True):
            tag = f"safetensors/{'packed' if packed else 'unpacked'}"
            client.call("build", (cfg, wire, 2000 + packed, True))  # other weights than the checkpoint
            c0 = _cmp(client.call("logits", ids), ref_logits)
            facts.check(f"{tag}: before the sync the receiver's logits are far from the checkpoint's "
                        "(negative control)", c0["rel_err"] > 10 * BF16_SAME_IMPL_REL, c0)
            eng = trainer_engine(mode, client=client, source=src, packed=packed, buffer_bytes=PACKED_BUFFER_BYTES)
            try:
                client.call("reset")
                eng.send_weights()
                rep = client.call("report")
                got = [tuple(x) for x in rep["received"]]
                same = got == files_in_order
                facts.check(f"{tag}: receiver tensors == the files' tensors cast to bf16 (bitwise, in order)",
                            same, f"{len(got)} tensors" if same else _first_diff(got, files_in_order))
                facts.check(f"{tag}: every receiver parameter written", not rep["missing"], rep["missing"][:5] or "all")
                c = _cmp(client.call("logits", ids), ref_logits)
                facts.check(f"{tag}: receiver logits == from_pretrained(folder) logits (rel<= {BF16_SAME_IMPL_REL})",
                            c["shape_equal"] and c["finite"] and c["rel_err"] <= BF16_SAME_IMPL_REL, c)
            finally:
                shutdown_pair(eng, client, mode)
        # Negative controls: a truncated shard. The metadata order starts with the first shard, so
        # the stale source fails before its first tensor.
        victim = os.path.join(folder, shards[0])
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 64)
        try:
            SafetensorsSource(folder, dtype=wire, device=device)
            err = "no error"
        except CheckpointError as e:
            err = str(e)
        facts.check("safetensors: a truncated shard raises CheckpointError naming the file",
                    shards[0] in err and "truncated" in err, err)
        client.call("build", (cfg, wire, 2002, True))
        eng = trainer_engine(mode, client=client, source=src, packed=False, buffer_bytes=PACKED_BUFFER_BYTES)
        try:
            client.call("reset")
            try:
                eng.send_weights()
                err = "no error"
            except CheckpointError as e:
                err = str(e)
            rep = client.call("report")
            facts.check("safetensors: the source built before the truncation refuses to send; the receiver "
                        "got nothing", "changed since" in err and not rep["received"],
                        f"{err[:300]}; received {len(rep['received'])}")
        finally:
            shutdown_pair(eng, client, mode)


def _first_diff(got, want) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"index {i}: received {a}, exported {b} (received {len(got)}, exported {len(want)})"
    return f"received {len(got)} tensors, exported {len(want)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="module,fsdp,megatron",
                    help="comma list: module,fsdp,lora,megatron,safetensors")
    ap.add_argument("--family", default=DEFAULT_FAMILY, help="comma list of hf_side.FAMILIES")
    ap.add_argument("--transport", default="ipc", choices=("ipc", "nccl"),
                    help="vLLM's CUDA IPC engines (default) or its dense NCCL engines")
    ap.add_argument("--dry-run", action="store_true", help="CPU: gloo + loopback transport")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kinds = [k for k in args.source.split(",") if k]
    facts = Facts(f"{args.transport}_" + "_".join(kinds), dry_run=args.dry_run)
    import torch

    device = "cpu" if args.dry_run else "cuda:0"
    mode = "loopback" if args.dry_run else args.transport
    if mode == "nccl":
        from nccl_one_gpu import place, why_not

        where = place(2)
        if where is None:
            facts.skip("round trips over NCCL", why_not(2))
            return facts.finish(args.json)
        device, worker_device = where
        facts.number("placement", f"trainer {device}, worker {worker_device}")
    if not args.dry_run:
        if not torch.cuda.is_available():
            facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
            return facts.finish(args.json)
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    client = None
    try:
        _init_dist(device)
        from receiver import start_receiver

        client = start_receiver(mode, worker_device if mode == "nccl" else device)
        for family in [f for f in args.family.split(",") if f]:
            for kind in kinds:
                try:
                    run = run_safetensors if kind == "safetensors" else run_source
                    run(kind, family, device, mode, client, facts)
                except Exception as e:  # noqa: BLE001 - next source still runs
                    what = kind if family == DEFAULT_FAMILY else f"{family} {kind}"
                    facts.error(f"{what}: round trip", e)
    except Exception as e:  # noqa: BLE001
        facts.error("setup", e)
    finally:
        if client is not None:
            client.close()
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
