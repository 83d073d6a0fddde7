"""What the model-family test modules share (test_glm4_moe, test_gpt_oss, test_mla_fsdp,
test_mla_megatron), so that a family's module holds only what is the family's own: its
transformers model, its documented Megatron -> HF layout, its refusals, its forward oracle's
negative controls.

* **FSDP2**: ``fsdp_passes`` is what every family's FSDP world runs on its sharded model (metadata
  read without a collective, an fp32 pass, a bf16 pass, that bf16 source through vLLM's NCCL trainer
  engine); ``check_fp32_wire`` / ``check_bf16_wire`` / ``check_nccl`` assert those facts against
  ``save_pretrained`` of the same weights.
* **Megatron**: ``megatron_layouts`` is one world that builds each layout of a list with the one
  builder, saves it with megatron-core's own ``dist_checkpointing`` and exports it with
  ``MegatronSource`` (many layouts per set of rank processes); ``check_layout`` is what every family's
  export must satisfy against ``save_pretrained`` (names, shapes, dtypes, order) and against the full
  tensors torch's DCP reader assembles from megatron's checkpoint (bytes, through the family's own
  ``expected`` layout); ``check_refusals`` that a refusal is raised on every rank, naming the field.
* **CLI**: ``check_cli`` / ``check_demo`` run ``weightsync check`` / ``weightsync demo`` for a preset on
  forked ranks (the CLI's rank code; the torchrun launch is tests/test_demo_cli.py's).
* **transformers**: a checkpoint folder from exported tensors, ``from_pretrained`` with its loading
  info, logits.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, Callable

import torch

IDS = [[3, 17, 42, 5, 60, 1, 33, 8], [9, 9, 27, 50, 2, 44, 13, 61]]


# ---- transformers ------------------------------------------------------------------------------


def preset_config(preset: str, architecture: str, **over: Any) -> Any:
    """The preset's transformers config with ``over`` applied."""
    from transformers import AutoConfig

    from weightsync.plugins.testbed.presets import PRESETS

    kw = {**PRESETS[preset], **over}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg.architectures = [architecture]
    return cfg


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[list[int]] = IDS) -> torch.Tensor:
    return model.eval()(input_ids=torch.tensor(ids)).logits.float()


def write_checkpoint(config: Any, tensors: dict[str, torch.Tensor], directory: str) -> None:
    """The export as a checkpoint folder: transformers' config.json + one safetensors file."""
    from safetensors.torch import save_file

    config.save_pretrained(directory)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})


def from_pretrained(directory: str) -> tuple[torch.nn.Module, dict]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)


def saved_pretrained(hf: Any, dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes transformers' ``save_pretrained`` writes for ``hf`` in ``dtype``: an
    fp32 model loaded back with ``from_pretrained(dtype=...)``, which is where transformers keeps
    the tensors it holds in fp32 (``e_score_correction_bias``), as a real checkpoint holds them."""
    from moe_models import saved_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf)
    if dtype != torch.float32:
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    return {n: (tuple(t.shape), t.dtype) for n, t in saved_state_dict(model).items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, tells -0.0 from 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def meta_map(meta: list[tuple]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of ``fsdp_worlds.meta_facts`` rows."""
    return {m[0]: (m[1], tuple(m[2])) for m in meta}


def dtype_shape(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


# ---- FSDP2 (in the ranks, then in the parent) -----------------------------------------------------


def fsdp_passes(model: torch.nn.Module, rank: int) -> dict[str, Any]:
    """In a rank of a 2-rank FSDP2 world, on the sharded ``model``: the default source's expert
    layout and metadata (read inside ``no_collectives``), an fp32 pass (its order and tensors), a
    bf16 source's metadata and pass, and that bf16 source driven through vLLM's NCCL trainer engine
    (``drive_vllm_nccl``: rank 0 the sender's own stream-vs-metadata check, rank 1 a real
    non-sender). The caller records ``module_changed`` once its own passes are done too."""
    from fsdp_worlds import drive_vllm_nccl, meta_facts, no_collectives, stream, to_cpu

    from weightsync.sources import FSDPSource

    f: dict[str, Any] = {}
    src = FSDPSource(model)
    f["layout"] = src.expert_transform.layout
    with no_collectives():
        f["meta"] = meta_facts(src.metadata)
    pairs = stream(src)
    f["order"] = [n for n, _ in pairs]
    f["fp32"] = to_cpu(pairs)
    bf = FSDPSource(model, dtype=torch.bfloat16)
    f["bf16_meta"] = meta_facts(bf.metadata)
    f["bf16"] = to_cpu(stream(bf))
    drive_vllm_nccl(bf, rank, f)
    return f


def check_fp32_wire(f: dict[str, Any], saved: dict[str, torch.Tensor], who: str) -> None:
    """One rank's fp32 pass (``fsdp_passes``) is ``saved`` (save_pretrained's tensors): names, dtype,
    shape and bytes of each; stream order is metadata order; metadata declares exactly those dtypes
    and shapes, every tensor iterated by both ranks; the module was left as it was."""
    from test_fsdp import assert_same_tensors

    assert_same_tensors(f["fp32"], saved, f"{who} fp32")
    assert f["order"] == [m[0] for m in f["meta"]], f"{who}: stream order != metadata order"
    assert meta_map(f["meta"]) == dtype_shape(saved), who
    assert all(m[3] in (None, (0, 1)) for m in f["meta"]), who  # FSDP: both ranks iterate every tensor
    assert f["module_changed"] == [], (who, f["module_changed"][:5])


def check_bf16_wire(f: dict[str, Any], want: dict[str, torch.Tensor], who: str) -> None:
    """One rank's bf16 pass is ``want`` (save_pretrained in bf16, the wire policy's fp32 tensors as
    they are): names, dtype, shape and bytes of each; metadata declares exactly those dtypes."""
    from test_fsdp import assert_same_tensors

    assert_same_tensors(f["bf16"], want, f"{who} bf16")
    assert meta_map(f["bf16_meta"]) == dtype_shape(want), who


def check_nccl(res: dict[int, dict[str, Any]], want: dict[str, torch.Tensor]) -> None:
    """vLLM's NCCL trainer engine: rank 0's stream passed the sender's own ``_checked_iter`` against
    metadata and is ``want`` byte for byte; rank 1 is a non-sender that drained every tensor."""
    sent = res[0]["nccl_sender"]
    bad = sorted(set(sent) ^ set(want)) or [n for n in want if not same_bytes(sent[n], want[n])]
    assert bad == [], f"vLLM's NCCL sender check on rank 0: names or bytes differ: {bad[:10]}"
    assert res[1]["nccl_is_sender"] is False, "rank 1 is a sender"
    assert res[1]["nccl_nonsender_tensors"] == len(want), (res[1]["nccl_nonsender_tensors"], len(want))


# ---- Megatron (in the ranks, then in the parent) --------------------------------------------------


def megatron_layouts(
    rank: int,
    world_size: int,
    *,
    root: str,
    layouts: list[dict[str, Any]],
    hf_of: Callable[[dict], Any],
    extra: Callable[..., dict] | None = None,
    build: Callable[..., list] | None = None,
    skip: Callable[[dict], str | None] | None = None,
) -> bytes:
    """One world, many layouts. Each layout (``name``; ``tp`` / ``pp`` / ``vpp`` / ``ep``; ``dtype``):
    build it (``build(hf, par, lay)`` -> chunks, default the one builder), save it with megatron's
    own ``dist_checkpointing`` under ``root/name``, export it with ``MegatronSource`` twice (the
    second pass must be equal), read ``mode="local"`` (``local=True``: its pieces reassembled from
    owners / placements like ``nccl_m2n``; else the error it raises), add ``extra(rank, lay, hf,
    chunks, src)`` (the family's facts, e.g. its refusals; run before the model is compared with its
    copy, so whatever it exports must leave the model as it was too). Rank 0 keeps the tensors.
    A layout with ``refuse`` (TransformerConfig overrides) is only built: the error MegatronSource
    raises for it; ``skip(lay)`` names a reason this megatron-core cannot build it."""
    import mla_models as mm
    import torch.distributed as dist
    from fsdp_worlds import pack
    from megatron_worlds import dcp_save, gather_local_pieces
    from worlds import errors_of

    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.sources import MegatronSource

    facts: dict[str, Any] = {}
    for lay in layouts:
        name = lay["name"]
        why = skip(lay) if skip else None
        if why:
            facts[name] = {"skip": why}
            continue
        hf = hf_of(lay)
        par = MegatronParallel(tp=lay.get("tp", 1), pp=lay.get("pp", 1), vpp=lay.get("vpp"), ep=lay.get("ep", 1))
        if lay.get("refuse"):  # a Megatron variant the family's checkpoint cannot express
            chunks = mm.build_megatron(hf, par, overrides=lay["refuse"])
            facts[name] = {"error": errors_of(lambda: MegatronSource(chunks[0], hf_config=hf))}
            continue
        chunks = build(hf, par, lay) if build else mm.build_megatron(hf, par)
        model = chunks if par.vpp else chunks[0]
        os.makedirs(f"{root}/{name}", exist_ok=True)
        dcp_save(model, f"{root}/{name}")
        before = {(v, n): p.detach().clone() for v, c in enumerate(chunks) for n, p in c.named_parameters()}
        src = MegatronSource(model, hf_config=hf, dtype=lay.get("dtype"))
        f: dict[str, Any] = {"meta": [(m.name, tuple(m.shape), str(m.dtype), m.owners) for m in src.metadata]}
        got = {n: t.clone() for n, t in src.iter_full()}
        f["stats"] = src.last_pass.as_dict()
        f["again"] = all(torch.equal(got[n], t) for n, t in src.iter_full())
        if lay.get("local"):
            local = gather_local_pieces(MegatronSource(model, hf_config=hf, mode="local"))
            if rank == 0:
                f["local_equal"] = sorted(local) == sorted(got) and all(torch.equal(local[n], got[n]) for n in got)
        else:
            f["local_error"] = errors_of(lambda: MegatronSource(model, hf_config=hf, mode="local"))
        if extra:
            f.update(extra(rank, lay, hf, chunks, src))
        f["unchanged"] = all(
            torch.equal(p, before[(v, n)]) for v, c in enumerate(chunks) for n, p in c.named_parameters()
        )
        if rank == 0:
            f["got"] = got
        else:
            f["yielded"] = len(got)
        facts[name] = f
        dist.barrier()
    return pack(facts)


def ck_any(ck: dict[str, torch.Tensor], layer: int, *suffixes: str) -> torch.Tensor:
    """One layer's tensor from megatron's full checkpoint under the first key it uses (per-layer
    keys or layers stacked on dim 0; local-spec norms are saved under Transformer-Engine-compatible
    keys in some layers)."""
    from test_moe_megatron import _ck

    for s in suffixes:
        if f"decoder.layers.{layer}.{s}" in ck or f"decoder.layers.{s}" in ck:
            return _ck(ck, s, layer)
    raise KeyError(f"layer {layer}: none of {suffixes} in megatron's checkpoint")


def expected_dense_mlp(ck: dict[str, torch.Tensor], layer: int, pre: str) -> dict[str, torch.Tensor]:
    """A dense MLP layer's HF tensors cut from megatron's full checkpoint: ``linear_fc1`` is
    ``[gate; up]``, ``linear_fc2`` is ``down_proj``."""
    gate, up = ck_any(ck, layer, "mlp.linear_fc1.weight").chunk(2, 0)
    return {pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up,
            pre + "mlp.down_proj.weight": ck_any(ck, layer, "mlp.linear_fc2.weight")}


def expected_ends(ck: dict[str, torch.Tensor], hf) -> dict[str, torch.Tensor]:
    """The embedding, final norm and output layer from megatron's full checkpoint, the vocabulary
    padding (``make_vocab_size_divisible_by`` x TP) trimmed to HF's ``vocab_size`` rows."""
    return {"model.embed_tokens.weight": ck["embedding.word_embeddings.weight"][: hf.vocab_size],
            "model.norm.weight": ck["decoder.final_layernorm.weight"],
            "lm_head.weight": ck["output_layer.weight"][: hf.vocab_size]}


def check_layout(
    res: dict[int, dict[str, Any]],
    root: str,
    lay: dict[str, Any],
    hf: Any,
    *,
    expected: Callable[[dict, Any], dict[str, torch.Tensor]],
    kept_fp32: re.Pattern,
    fused_qkv: bool,
) -> dict[str, Any]:
    """What every family's export of one ``megatron_layouts`` layout satisfies; returns rank 0's facts.

    Metadata identical on every rank, every tensor owned by rank 0, no name twice; names, shapes and
    dtypes == ``save_pretrained`` of ``hf`` (on a bf16 wire the ``kept_fp32`` tensors keep the model's
    fp32, exactly the dtypes FSDPSource declares for the same model); rank 0's stream in metadata
    order with those shapes and dtypes; every tensor == ``expected(ck, hf)``, the family's documented
    layout cut from megatron's own full checkpoint -- with ``fused_qkv``, q/k/v weights and biases are
    compared the other way: put back into megatron's per-group ``linear_qkv`` rows they are that
    checkpoint's tensor. Every rank: model unchanged, a second pass equal, ``mode="local"`` refused
    naming the rank (unless the layout reads it), nothing yielded but on rank 0."""
    import megatron_worlds as mw
    from moe_megatron import load_full_checkpoint

    from weightsync.sources import FSDPSource

    name = lay["name"]
    r0 = res[0][name]
    dtype = lay.get("dtype") or torch.float32
    assert all(res[r][name]["meta"] == r0["meta"] for r in res), f"{name}: metadata differs between ranks"
    assert all(o == (0,) for *_, o in r0["meta"]), name
    declared = {n: (s, d) for n, s, d, _ in r0["meta"]}
    assert len(declared) == len(r0["meta"]), f"{name}: a name declared twice"
    saved = saved_pretrained(hf, dtype)
    if dtype != torch.float32:  # the wire-dtype policy every source shares
        saved = {n: (s, torch.float32 if kept_fp32.search(n) else d) for n, (s, d) in saved.items()}
        from transformers import AutoModelForCausalLM

        fsdp = FSDPSource(AutoModelForCausalLM.from_config(hf), dtype=dtype, rank=0)
        fsdp_dtypes = {m.name: str(m.dtype) for m in fsdp.metadata}
        decl_dtypes = {n: d for n, (_, d) in declared.items()}
        assert decl_dtypes == fsdp_dtypes, (name, "wire dtypes != FSDPSource's", _differ(decl_dtypes, fsdp_dtypes))
    want_decl = {n: (s, str(d)) for n, (s, d) in saved.items()}
    assert declared == want_decl, (name, _differ(declared, want_decl))
    got = r0["got"]
    assert list(got) == [n for n, *_ in r0["meta"]], f"{name}: stream order != metadata order"
    got_sd = {n: (tuple(t.shape), t.dtype) for n, t in got.items()}
    assert got_sd == saved, (name, _differ(got_sd, saved))
    ck = load_full_checkpoint(f"{root}/{name}")
    want = expected(ck, hf)
    qkv = {n for n in got if re.search(r"self_attn\.[qkv]_proj\.", n)} if fused_qkv else set()
    assert sorted(want) == sorted(set(got) - qkv), (name, sorted(set(want) ^ (set(got) - qkv))[:10])
    bad = [n for n, t in want.items() if not torch.equal(got[n], t.to(got[n].dtype))]
    assert bad == [], f"{name}: not megatron's checkpoint tensor: {bad[:10]}"
    if fused_qkv:
        for i in range(hf.num_hidden_layers):
            for leaf in ("weight", "bias") if getattr(hf, "attention_bias", False) else ("weight",):
                q, k, v = (got[f"model.layers.{i}.self_attn.{x}_proj.{leaf}"] for x in "qkv")
                full = ck_any(ck, i, f"self_attention.linear_qkv.{leaf}")
                assert torch.equal(mw._fused_qkv_rows(hf, q, k, v), full.to(q.dtype)), (name, i, leaf)
    for r, f in res.items():
        f = f[name]
        assert f["unchanged"], f"{name}: rank {r} mutated its model"
        assert f["again"], f"{name}: rank {r}: a second pass differs"
        if not lay.get("local"):
            err = f["local_error"]
            assert err and err.startswith("NotImplementedError") and f"rank {r}" in err, (name, r, err)
        if r:
            assert f["yielded"] == 0 and f["stats"]["tensors"] == 0, f"{name}: rank {r} yielded tensors"
    return r0


def _differ(a: dict, b: dict) -> list:
    """The first entries on which two dicts differ: ``(key, a's, b's)``."""
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)][:10]


def check_refusals(res: dict[int, dict[str, Any]], words: dict[str, tuple[str, str]], layout: str = "tp2") -> None:
    """Every rank's ``refusals`` fact (field -> the error MegatronSource raised for an hf_config that
    disagrees in that field) is that error type, naming the rank and the ``words``."""
    for r in res:
        got = res[r][layout]["refusals"]
        assert sorted(got) == sorted(words), (r, sorted(got))
        for field, (kind, word) in words.items():
            err = got[field]
            assert err is not None, f"rank {r}: {field} was not refused"
            assert err.startswith(kind) and word in err and f"rank {r}" in err, (r, field, err)


# ---- the CLI ------------------------------------------------------------------------------------


def check_cli(preset: str, *args: str, nproc: int, layout_line: str,
              names: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, Any]:
    """``weightsync check --model preset *args --show 1000`` on ``nproc`` forked ranks: exit 0, PASS,
    ``layout_line`` in the report, every listed name and shape == ``names`` (default: transformers'
    ``save_pretrained`` of the preset's model), no traceback. Returns ``(save_pretrained's {name:
    (dtype, shape)}, the run)``."""
    from test_demo_cli import _listed, _saved
    from worlds import run_cli

    from weightsync.plugins.testbed.presets import build_model, load_config

    saved = _saved(build_model(load_config(preset)))
    r = run_cli("check", "--model", preset, *args, "--show", "1000", nproc=nproc, timeout=600)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    assert out.strip().endswith("PASS") and layout_line in out, out[-3000:]
    assert _listed(out) == (names if names is not None else {n: s for n, (_, s) in saved.items()})
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return saved, r


def check_demo(preset: str, model_type: str) -> None:
    """``weightsync demo --model preset --steps 2`` on 2 forked ranks: every sync verified bit for
    bit in a transformers receiver, which did not hold the trainer's weights before."""
    from worlds import run_cli

    r = run_cli("demo", "--model", preset, "--steps", "2", nproc=2, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert re.search(rf"weightsync demo: 2/2 syncs verified, .* \(2 ranks, {model_type}, .*-> PASS", r.stdout), r.stdout
    assert "before any sync: receiver logits equal trainer's: False" in r.stdout
