"""The speculative draft (multi-token prediction) of the hybrid families -- Qwen3-Next (``qwen3_next``),
Qwen3.5 (``qwen3_5_text``) and Qwen3.5-MoE (``qwen3_5_moe_text``) -- from a live megatron-core model:
``MegatronSource(part="mtp")`` over the CPU builder's MTP block, and ``weightsync export / check --mtp``.

Oracles, none of them ``MegatronSource``'s own mapping of the MTP block:

* **Values**: the tests' own importer (``_import_mtp``) cuts random checkpoint tensors -- named as a
  released Qwen3-Next / Qwen3.5 checkpoint names its MTP layer (``mtp.fc``, ``mtp.pre_fc_norm_*``,
  ``mtp.norm``, and ``mtp.layers.0.*`` with the names and shapes transformers' ``save_pretrained``
  gives the last full-attention decoder layer), plus ``model.embed_tokens`` / ``lm_head`` -- into
  megatron-core's MTP block under TP2 / PP2 / EP2: megatron's gated ``linear_qkv`` rows per query group
  ``[q heads | gate heads | k | v]`` (``SelfAttention.get_query_key_value_tensors(output_gate=True)``)
  from HF's ``q_proj`` rows per head ``[q_h | gate_h]`` (``Qwen3NextAttention.forward``), column / row
  shards, ``linear_fc1`` as ``[gate_r; up_r]``, this EP rank's experts, the padded vocabulary. The
  export must be exactly those tensors, byte for byte.
* **Names**: vLLM 0.34's own draft models (``Qwen3NextMTP``, ``Qwen3_5MTP``, ``Qwen3_5MoeMTP``), built
  on the meta device (``vllm_meta_draft``), run ``load_weights`` over the export: every exported tensor
  reaches one parameter's ``weight_loader`` (shape-checked by vLLM), every draft parameter is loaded.
* **CLI**: ``export --mtp`` of the tiny Qwen3.5-MoE preset at TP2: the policy tensors are
  ``save_pretrained``'s byte for byte, the folder's draft tensors load through vLLM's ``Qwen3_5MoeMTP``,
  ``check --mtp`` passes on it and fails, naming the tensor, on a copy with one MTP tensor changed.

The Qwen3-Next configs here set ``mlp_only_layers=[]`` (as the released Qwen3-Next does): vLLM's
``Qwen3NextMTP`` builds MTP layer ``i`` like decoder layer ``i`` for that list (docs/mtp.md).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from family_worlds import preset_config, same_bytes
from fsdp_worlds import unpack
from mtp_cli import export_and_check
from worlds import run_world as _run_world

ARCH = {"tiny-qwen3-next": "Qwen3NextForCausalLM", "tiny-qwen3.5": "Qwen3_5ForCausalLM",
        "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM"}
CASES = [("tiny-qwen3-next", "tp2"), ("tiny-qwen3-next", "pp2"), ("tiny-qwen3-next", "ep2"),
         ("tiny-qwen3.5", "tp2"), ("tiny-qwen3.5-moe", "tp2")]
PAR = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}
PRE = "mtp.layers.0."


def _hf(preset: str) -> Any:
    hf = preset_config(preset, ARCH[preset], **({"mlp_only_layers": []} if preset == "tiny-qwen3-next" else {}))
    setattr(hf, "num_nextn_predict_layers" if preset == "tiny-qwen3-next" else "mtp_num_hidden_layers", 1)
    return hf


def _last_full(hf: Any) -> int:
    return max(i for i, t in enumerate(hf.layer_types) if t == "full_attention")


def _hf_mtp(hf: Any) -> dict[str, torch.Tensor]:
    """The MTP layer as a released checkpoint holds it, random (seeded by name): ``mtp.layers.0.*`` with
    transformers' ``save_pretrained`` names and shapes of the last full-attention decoder layer,
    ``mtp.fc`` ``[h, 2h]``, the two pre-fc norms and ``mtp.norm`` ``[h]``, and the embedding / head."""
    from family_worlds import saved_pretrained

    h, v = hf.hidden_size, hf.vocab_size
    last = f"model.layers.{_last_full(hf)}."
    shapes = {PRE + k[len(last):]: s for k, (s, _) in saved_pretrained(hf).items() if k.startswith(last)}
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
                   "model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h)})
    return {k: torch.randn(s, generator=torch.Generator().manual_seed(zlib.crc32(k.encode()))) for k, s in shapes.items()}


def _gated_qkv(hf: Any, q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """megatron-core's gated ``linear_qkv`` rows: per query group its heads' queries, then their gates,
    then the group's key and value. HF's ``q_proj`` holds ``[q_h; gate_h]`` per head."""
    d, heads, groups = hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads
    per_head = q_proj.view(heads, 2, d, -1)  # [head, (q, gate), d, hidden]
    hpg = heads // groups
    rows = []
    for g in range(groups):
        mine = per_head[g * hpg:(g + 1) * hpg]
        rows += [mine[:, 0].reshape(-1, q_proj.shape[1]), mine[:, 1].reshape(-1, q_proj.shape[1]),
                 k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(rows)


def _import_mtp(chunks: list[torch.nn.Module], hf: Any, ck: dict[str, torch.Tensor]) -> list[str]:
    """The tests' own importer (no MegatronSource code): copy ``ck`` into this rank's megatron-core MTP
    block and the embedding / output layer it shares (module docstring). Raises on any MTP parameter it
    has no rule for; returns the checkpoint names it used."""
    from megatron.core import parallel_state as ps

    tp, tpr = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etpr = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    experts = getattr(hf, "num_experts", 0) or 0
    first = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return ck[name]

    def vocab(name: str, p: torch.Tensor) -> torch.Tensor:
        full = torch.full((p.shape[0] * tp, p.shape[1]), 7.0)  # megatron's padded vocab; padding must not leak
        full[: hf.vocab_size] = get(name)
        return full.chunk(tp)[tpr]

    same = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "final_layernorm.weight": "mtp.norm.weight",
            "transformer_layer.input_layernorm.weight": PRE + "input_layernorm.weight",
            "transformer_layer.pre_mlp_layernorm.weight": PRE + "post_attention_layernorm.weight",
            "transformer_layer.self_attention.q_layernorm.weight": PRE + "self_attn.q_norm.weight",
            "transformer_layer.self_attention.k_layernorm.weight": PRE + "self_attn.k_norm.weight",
            "transformer_layer.mlp.router.weight": PRE + "mlp.gate.weight",
            "transformer_layer.mlp.shared_experts.gate_weight": PRE + "mlp.shared_expert_gate.weight"}

    def glu(base: str, k: int, r: int) -> torch.Tensor:
        return torch.cat([get(base + "gate_proj.weight").chunk(k)[r], get(base + "up_proj.weight").chunk(k)[r]])

    def mtp_value(suffix: str) -> torch.Tensor:
        if suffix in same:
            return get(same[suffix])
        if suffix == "eh_proj.weight":
            return get("mtp.fc.weight").chunk(tp)[tpr]
        if suffix == "transformer_layer.self_attention.linear_qkv.weight":
            a = PRE + "self_attn."
            return _gated_qkv(hf, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")).chunk(tp)[tpr]
        if suffix == "transformer_layer.self_attention.linear_proj.weight":
            return get(PRE + "self_attn.o_proj.weight").chunk(tp, 1)[tpr]
        m = re.fullmatch(r"transformer_layer\.mlp\.(?:experts\.local_experts\.(\d+)\.|shared_experts\.|)linear_fc([12])\.weight",
                         suffix)
        if m is None:
            raise KeyError(f"the test importer has no rule for mtp.layers.0.{suffix}")
        if m[1] is not None:
            base, k, r = f"{PRE}mlp.experts.{first + int(m[1])}.", etp, etpr
        else:
            base, k, r = (PRE + "mlp.shared_expert." if ".shared_experts." in suffix else PRE + "mlp."), tp, tpr
        return glu(base, k, r) if m[2] == "1" else get(base + "down_proj.weight").chunk(k, 1)[r]

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name == "embedding.word_embeddings.weight":
                val = vocab("model.embed_tokens.weight", p)
            elif name == "output_layer.weight":
                val = vocab("lm_head.weight", p)
            elif name.startswith("mtp."):
                val = mtp_value(name.removeprefix("mtp.layers.0."))
            else:
                continue
            assert tuple(val.shape) == tuple(p.shape), (name, tuple(val.shape), tuple(p.shape))
            with torch.no_grad():
                p.copy_(val)
    return sorted(used)


def _world(rank: int, world_size: int, tables: dict[str, dict[str, torch.Tensor]], cli_out: str) -> bytes:
    import torch.distributed as dist
    from fsdp_worlds import pack
    from megatron.core import parallel_state as ps
    from mla_models import build_megatron

    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.sources import MegatronSource

    out: dict[str, Any] = {}
    for preset, layout in CASES:
        hf = _hf(preset)
        chunks = build_megatron(hf, MegatronParallel(*PAR[layout][:2], None, PAR[layout][2]), seed=5,
                                overrides={"mtp_num_layers": 1})
        used: list[Any] = [None] * world_size
        dist.all_gather_object(used, _import_mtp(chunks, hf, tables[preset]))
        model = chunks if len(chunks) > 1 else chunks[0]
        draft = MegatronSource(model, hf_config=hf, part="mtp")
        got = {n: t.clone() for n, t in draft.iter_full()}
        policy = [m.name for m in MegatronSource(model, hf_config=hf).metadata]
        out[f"{preset}/{layout}"] = {
            "draft": got, "imported": sorted({n for u in used for n in u}), "policy_meta": policy,
            "draft_meta": [(m.name, tuple(m.shape), m.owners) for m in draft.metadata],
        }
        ps.destroy_model_parallel()
    out["cli"] = export_and_check(
        rank, cli_out, ["--model", "tiny-qwen3.5-moe", "--layout", "megatron", "--tp", "2", "--nproc", "2", "--mtp"],
        "mtp.fc.weight")
    return pack(out if rank == 0 else {"cli": out["cli"]})


def _vllm_world(rank: int, world_size: int, jobs: dict[str, tuple[Any, dict[str, torch.Tensor]]]) -> bytes:
    """One process, vLLM's draft models built and loaded for every job (``vllm_meta_draft``)."""
    from fsdp_worlds import pack
    from vllm_meta_draft import load_draft

    return pack({k: load_draft(hf, tensors) for k, (hf, tensors) in jobs.items()})


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    from safetensors.torch import load_file

    tables = {p: _hf_mtp(_hf(p)) for p in ARCH}
    tmp = tempfile.mkdtemp(prefix="ws-mtp-hybrid-")
    folder = os.path.join(tmp, "ckpt")
    try:
        res = unpack(_run_world(_world, 2, timeout=600, tables=tables, cli_out=folder))
        r0 = res[0]
        ck = {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
              for k, v in load_file(os.path.join(folder, f)).items()}
        drafts = {"cli": (_hf("tiny-qwen3.5-moe"), {k: v for k, v in ck.items() if k.startswith("mtp.")
                                                     or k in ("model.embed_tokens.weight", "lm_head.weight")})}
        drafts.update({case: (_hf(case.split("/")[0]), r0[case]["draft"]) for case in (f"{p}/{lay}" for p, lay in CASES)})
        vllm = unpack(_run_world(_vllm_world, 1, timeout=600, jobs=drafts))[0]
        yield {"ranks": res, "tables": tables, "vllm": vllm, "folder": folder, "checkpoint": ck}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("case", [f"{p}/{lay}" for p, lay in CASES])
def test_hybrid_mtp_export_is_the_imported_checkpoint_tensors_byte_for_byte(world, case):
    """Under TP2 / PP2 / EP2: ``MegatronSource(part="mtp")`` streams exactly the checkpoint's MTP tensors
    the tests' importer cut into megatron-core (names, shapes, dtypes, bytes; vocabulary padding
    trimmed), in metadata order, owned by rank 0; the policy export of the same model has no ``mtp.*``."""
    r = world["ranks"][0][case]
    want = world["tables"][case.split("/")[0]]
    got = r["draft"]
    assert r["imported"] == sorted(want), "the importer left checkpoint tensors out"
    assert list(got) == [m[0] for m in r["draft_meta"]]
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:10]
    bad = [n for n in want if not same_bytes(got[n], want[n])]
    assert bad == [], f"not the imported checkpoint tensor: {bad[:10]}"
    assert not any(n.startswith("mtp.") for n in r["policy_meta"])
    assert all(o == (0,) for _, _, o in r["draft_meta"])


@pytest.mark.parametrize("case", [f"{p}/{lay}" for p, lay in CASES] + ["cli"])
def test_hybrid_mtp_names_are_what_vllms_draft_loader_consumes(world, case):
    """vLLM's own ``Qwen3NextMTP`` / ``Qwen3_5MTP`` / ``Qwen3_5MoeMTP`` (meta device): every exported
    tensor reaches exactly one ``weight_loader`` call (experts: one per expert and shard), and
    ``load_weights`` loads every draft parameter."""
    r = world["vllm"][case]
    preset = "tiny-qwen3.5-moe" if case == "cli" else case.split("/")[0]
    want_cls = {"tiny-qwen3-next": "Qwen3NextMTP", "tiny-qwen3.5": "Qwen3_5MTP", "tiny-qwen3.5-moe": "Qwen3_5MoeMTP"}
    assert r["cls"] == want_cls[preset]
    n = len(world["ranks"][0][case]["draft"]) if case != "cli" else len(
        [k for k in world["checkpoint"] if k.startswith("mtp.") or k in ("model.embed_tokens.weight", "lm_head.weight")])
    assert len(r["calls"]) == n, (len(r["calls"]), n)
    assert r["loaded"] == r["params"], (sorted(r["params"] - r["loaded"])[:5], sorted(r["loaded"] - r["params"])[:5])
    experts = [c for c in r["calls"] if "expert_id" in c[2]]
    hf = _hf(preset)
    if getattr(hf, "num_experts", 0):
        assert sorted({c[2]["expert_id"] for c in experts}) == list(range(hf.num_experts))
        assert len(experts) == 3 * hf.num_experts
    else:
        assert experts == []


def test_export_mtp_writes_a_qwen35_checkpoint_with_its_draft(world):
    """``export --mtp`` (tiny Qwen3.5-MoE, TP2): save_pretrained's policy tensors byte for byte, the
    MTP layer (``mtp.*``) beside them, the shared embedding / head once; transformers loads the folder
    with nothing missing and the config states one MTP layer."""
    from transformers import AutoModelForCausalLM

    from weightsync.plugins.cli.build import checkpoint_state
    from weightsync.plugins.testbed.presets import build_model, load_config

    cli, ck = world["ranks"][0]["cli"], world["checkpoint"]
    code, text = cli["export"]
    assert code == 0 and "PASS" in text and "MTP (draft): 29 tensors" in text, text
    assert [r["cli"]["export"][0] for r in world["ranks"].values()] == [0, 0]
    policy = checkpoint_state(build_model(load_config("tiny-qwen3.5-moe", None), seed=0))
    mtp = sorted(k for k in ck if k.startswith("mtp."))
    assert sorted(set(ck) - set(mtp)) == sorted(policy) and len(mtp) == 29
    bad = [k for k, t in policy.items() if not same_bytes(ck[k], t)]
    assert bad == [], bad[:5]
    model, info = AutoModelForCausalLM.from_pretrained(world["folder"], output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert model.config.mtp_num_hidden_layers == 1


def test_check_mtp_compares_a_qwen35_folders_draft_byte_for_byte(world):
    """``check --mtp --checkpoint`` passes on the exported folder, every MTP tensor compared byte for
    byte; one changed MTP tensor fails it, named, with exit 1 on both ranks."""
    cli = world["ranks"][0]["cli"]
    code, text = cli["check"]
    assert code == 0 and text.rstrip().endswith("PASS"), text
    assert re.search(r"bytes: (\d+) of \1 tensors compared equal", text), text
    assert "MTP (draft): 29 tensors" in text and "29 equal the checkpoint's byte for byte" in text, text
    code, text = cli["check_changed"]
    assert code == 1 and "mtp.fc.weight: bytes differ" in text and "FAIL" in text, text
    assert [r["cli"]["check_changed"][0] for r in world["ranks"].values()] == [1, 1]
