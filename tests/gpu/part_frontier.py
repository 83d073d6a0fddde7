"""Part of the GPU evidence: the Megatron-vs-transformers logits oracle for the frontier families
(issue 27): DeepSeek sparse attention (``deepseek_v32``, ``glm_moe_dsa``; part ``oracle_dsa``) and
the gated-delta-net hybrids (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``; part
``oracle_gdn``).

A TP1 megatron-core ``GPTModel`` from weightsync's one builder (``megatron_side.build_frontier``:
init std 0.1, norms and biases perturbed) runs its own forward; ``MegatronSource`` exports it; the
export is written as a checkpoint folder and transformers' ``from_pretrained`` loads it strictly
(eager attention); both forwards must give the same fp32 logits (TF32 off), within 2e-4 of the
largest logit, the tolerance every other family meets. Negative controls: shape-preserving
mistakes in the export, each of which must move the logits beyond 10x that tolerance.

DSA. megatron-core's indexer applies a Hadamard rotation to q and k (``rotate_activation``) through
``fast_hadamard_transform``, a CUDA extension the device image lacks: ``tests/gpu/standins/`` holds a
pure-torch STAND-IN with the real package's API and semantics (zero-pad the last dim to a power of
two, Sylvester Hadamard matrix, ``scale``, truncate), put on ``sys.path`` by this part only, after
everything else (a real install wins; the summary says which one ran). transformers'
``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` skip the rotation (orthogonal at ``scale = dim**-0.5``
for a power-of-two head dim: ``Hq . Hk = q . k``), so both sides compute the same scores.
``rotate_activation`` asserts bf16 input; the fp32 run uses the same function without that
assertion (same transform, same scale); the bf16 run uses megatron's own (both forwards must run;
its agreement is reported, not judged: top-k over ReLU scores flips near-ties in bf16). The tiny presets keep
``index_topk`` (4) below the sequence (24), so the indexer's choice changes the attention.
Controls: two indexer heads of ``wq_b`` swapped; ``wq_b`` / ``wk`` copied verbatim from megatron
(where this megatron-core's channel order differs from transformers'; megatron-core 0.19 without
``dsa_indexer_rope_interleaved`` ropes DeepSeek-V3.2's channels as transformers does, and then a
verbatim copy *is* the export: reported as a skip); MLA's ``kv_b_proj`` regrouped. On megatron-core
0.19 each family also runs with ``dsa_indexer_rope_interleaved=True`` (the other channel pairing).

Gated delta net. Megatron's forward by its torch chunked delta rule (``deterministic_mode``;
transformers' ``l2norm`` standing in for fla's where fla is absent), as on the H200 before; and,
where flash-linear-attention imports (``bash .ci/gpu-extras.sh`` ships it in ``.kit-extra/``), by
fla's Triton kernels (megatron's default path: ``chunk_gated_delta_rule``, fla's ``causal_conv1d``
and ``l2norm``) -- while transformers' modeling is imported with fla hidden, so its side is the torch
delta rule: two independent implementations. The fla comparison's tolerance is ``FLA_REL`` (the
kernels' fp32 accumulation differs from the torch recurrence; the measured value is reported).
Controls (``tests/test_qwen3_next._controls``): two key-head groups swapped (Qwen3-Next) or z with v
(Qwen3.5), the output norm's ``+ 1`` dropped, q and gate un-interleaved.

``--dry-run``: the same on CPU (fla's kernels need CUDA: reported as a skip).

    python tests/gpu/part_frontier.py --families deepseek_v32,glm_moe_dsa [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, ".."))

from facts import Facts, log  # noqa: E402
from part_oracle import BF16_REL, FP32_REL  # noqa: E402

#: fp32 logits, Megatron with fla's Triton kernels vs transformers' torch delta rule.
FLA_REL = 2e-3
DSA = ("deepseek_v32", "glm_moe_dsa")
GDN = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


# ---- shared --------------------------------------------------------------------------------------


def _export(model, cfg, directory: str) -> dict:
    from safetensors.torch import save_file

    from weightsync.sources import MegatronSource

    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in MegatronSource(model, hf_config=cfg).iter_full()}
    cfg.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _hf_logits(cfg, tensors: dict, ids, device: str, dtype=None):
    """transformers' ``from_pretrained`` of ``tensors`` (strict) and its logits on ``ids``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        hf, info = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager",
                                                        output_loading_info=True)
    bad = {k: sorted(v)[:5] for k, v in info.items() if v}
    if bad:
        raise AssertionError(f"from_pretrained(export) was not strict: {bad}")
    with torch.no_grad():
        return hf.to(device).eval()(input_ids=ids, use_cache=False).logits.float()


def _megatron_logits(model, ids, vocab: int):
    import mla_models as mm

    return mm.megatron_logits(model, ids, vocab)


def _compare(facts: Facts, tag: str, hl, ml, tol: float) -> dict:
    from hf_side import compare_logits

    c = compare_logits(hl, ml)
    facts.check(f"{tag}: transformers(export) logits == Megatron logits (fp32, rel<= {tol})",
                c["shape_equal"] and c["finite"] and c["rel_err"] <= tol, c)
    facts.number(f"{tag} fp32 rel_err", c["rel_err"])
    return c


def _control(facts: Facts, tag: str, what: str, cfg, tensors, change: dict, ids, device, ml) -> None:
    from hf_side import compare_logits

    c = compare_logits(_hf_logits(cfg, {**tensors, **change}, ids, device), ml)
    facts.check(f"{tag}: negative control ({what}) is detected", c["rel_err"] > 10 * FP32_REL,
                f"rel_err {c['rel_err']:.3g}")


# ---- DSA -----------------------------------------------------------------------------------------


def _hadamard(facts: Facts) -> Any:
    """megatron's ``dsa`` module with a ``hadamard_transform``: the real package if installed,
    else the stand-in (``tests/gpu/standins``, appended to ``sys.path`` here only)."""
    standins = os.path.join(HERE, "standins")
    if standins not in sys.path:
        sys.path.append(standins)  # last: a real fast_hadamard_transform wins
    import fast_hadamard_transform as fht
    import megatron.core.transformer.experimental_attention_variant.dsa as dsa

    if getattr(dsa, "hadamard_transform", None) is None:  # megatron imported before the path was set
        dsa.hadamard_transform = fht.hadamard_transform
    which = "pure-torch STAND-IN (tests/gpu/standins)" if getattr(fht, "IS_STANDIN", False) else f"real {fht.__file__}"
    facts.number("fast_hadamard_transform", which)
    return dsa


@contextlib.contextmanager
def _fp32_rotation(dsa) -> Any:
    """megatron's ``rotate_activation`` minus its bf16-only assertion: the same transform and scale."""
    saved = dsa.rotate_activation
    dsa.rotate_activation = lambda x: dsa.hadamard_transform(x, scale=x.size(-1) ** -0.5)
    try:
        yield
    finally:
        dsa.rotate_activation = saved


def _dsa_variants() -> list[dict]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "dsa_indexer_rope_interleaved" in TransformerConfig.__dataclass_fields__:  # megatron-core 0.19+
        return [{}, {"dsa_indexer_rope_interleaved": True}]
    return [{}]


def _swap_rows(t, a: slice, b: slice):
    t = t.clone()
    t[a], t[b] = t[b].clone(), t[a].clone()
    return t


def run_dsa(family: str, over: dict, device: str, facts: Facts) -> None:
    import torch
    from hf_side import compare_logits, fixed_batch, tiny_config
    from megatron_side import build_frontier, describe

    dsa = _hadamard(facts)
    cfg = tiny_config(family)
    tag = family + "".join(f"[{k}={v}]" for k, v in over.items())
    ids = fixed_batch(cfg.vocab_size, device=device)
    facts.check(f"{tag}: index_topk < sequence, so the indexer's choice matters",
                cfg.index_topk < ids.shape[1], (cfg.index_topk, ids.shape[1]))
    model = build_frontier(cfg, dtype=torch.float32, device=device, seed=5, overrides=over)
    log(f"[frontier] {tag}: {describe(model)}")
    with tempfile.TemporaryDirectory() as d:
        tensors = _export(model, cfg, d)
    with _fp32_rotation(dsa):
        ml = _megatron_logits(model, ids, cfg.vocab_size)
    _compare(facts, tag, _hf_logits(cfg, tensors, ids, device), ml, FP32_REL)

    layer = 1
    pre = f"model.layers.{layer}.self_attn."
    ind = model.decoder.layers[layer].self_attention.core_attention.indexer
    d = cfg.index_head_dim
    wq = tensors[pre + "indexer.wq_b.weight"]
    _control(facts, tag, "two indexer heads of wq_b swapped", cfg, tensors,
             {pre + "indexer.wq_b.weight": _swap_rows(wq, slice(0, d), slice(d, 2 * d))}, ids, device, ml)
    for hname, mod in (("wq_b", ind.linear_wq_b), ("wk", ind.linear_wk)):
        verbatim = mod.weight.detach().cpu().clone()
        if torch.equal(verbatim, tensors[pre + f"indexer.{hname}.weight"]):
            facts.skip(f"{tag}: negative control (verbatim {hname})",
                       "this megatron-core ropes the indexer channels as transformers does: the export is the "
                       "verbatim tensor")
            continue
        _control(facts, tag, f"indexer {hname} copied verbatim from megatron", cfg, tensors,
                 {pre + f"indexer.{hname}.weight": verbatim}, ids, device, ml)
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    per = tensors[pre + "kv_b_proj.weight"].view(heads, nope + v, -1)
    regrouped = torch.cat([per[:, :nope].reshape(heads * nope, -1), per[:, nope:].reshape(heads * v, -1)])
    _control(facts, tag, "kv_b_proj rows regrouped [all k_nope; all v]", cfg, tensors,
             {pre + "kv_b_proj.weight": regrouped}, ids, device, ml)

    # bf16: megatron's own rotate_activation (bf16 input) through the Hadamard transform
    mb = build_frontier(cfg, dtype=torch.bfloat16, device=device, seed=5, perturb=False, overrides=over)
    mb.load_state_dict(model.state_dict(), strict=True)
    with tempfile.TemporaryDirectory() as dd:
        tb = _export(mb, cfg, dd)
    c = compare_logits(_hf_logits(cfg, tb, ids, device, dtype=torch.bfloat16),
                       _megatron_logits(mb, ids, cfg.vocab_size), tol=BF16_REL)
    # Not a pass/fail criterion: the indexer keeps 4 of 24 keys by ReLU scores, many of them exact
    # zeros or near-ties, and bf16 rounding (Hadamard-rotated on one side only) flips which ones --
    # 71% of positions within 5e-2 on CPU, below the MoE families' 75%. fp32 is the oracle.
    facts.check(f"{tag} bf16 (megatron's rotate_activation through the Hadamard transform): both forwards "
                "run, finite, same shape", c["shape_equal"] and c["finite"], c)
    facts.number(f"{tag} bf16 positions within {BF16_REL} (top-k flips allowed)", round(c["pos_within_tol"], 3))
    facts.number(f"{tag} bf16 rel_err", c["rel_err"])


# ---- gated delta net -------------------------------------------------------------------------------


def _fla_status(device: str) -> str | None:
    """None when megatron's gated delta net will run fla's kernels here, else why not."""
    if not device.startswith("cuda"):
        return "fla's Triton kernels need CUDA"
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return (f"flash-linear-attention does not import here ({type(e).__name__}: {str(e)[:200]}); "
                "run bash .ci/gpu-extras.sh before shipping (.kit-extra/)")
    return None


def _import_sides() -> Any:
    """megatron's gated-delta-net module first (it binds fla where fla imports), then transformers'
    modeling modules with fla hidden (``sys.modules['fla'] = None``), so transformers binds its torch
    delta rule and conv whatever is installed. Returns megatron's module whose globals the forward reads."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    gdn = sys.modules[GatedDeltaNet.reset_parameters.__module__]  # 0.16: the layer's module; 0.19: common.py
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
        import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
    return gdn


def _gdn_kernel_names(model) -> str:
    for m in model.modules():
        rule = getattr(m, "gated_delta_rule", None)
        if rule is not None:
            return f"{getattr(rule, '__module__', '?')}.{getattr(rule, '__name__', '?')}"
    return "?"


def run_gdn(family: str, device: str, facts: Facts, gdn: Any) -> None:
    import torch
    from hf_side import fixed_batch, tiny_config
    from megatron_side import build_frontier, describe
    from test_qwen3_next import _controls, _l2norm

    cfg = tiny_config(family)
    ids = fixed_batch(cfg.vocab_size, device=device)
    why_not_fla = _fla_status(device)
    paths = [("torch delta rule", False)] + ([] if why_not_fla else [("fla kernels", True)])
    if why_not_fla:
        facts.skip(f"{family}[fla kernels]", why_not_fla)
    for label, fla in paths:
        tag = f"{family}[{label}]"
        saved = getattr(gdn, "l2norm", None)
        if not fla and (not getattr(gdn, "HAVE_FLA", False) or saved is None):
            gdn.l2norm = _l2norm  # transformers' l2norm for fla's, on a host without fla
        try:
            model = build_frontier(cfg, dtype=torch.float32, device=device, seed=5, fla=fla)
            log(f"[frontier] {tag}: {describe(model)}; megatron's delta rule {_gdn_kernel_names(model)}")
            with tempfile.TemporaryDirectory() as d:
                tensors = _export(model, cfg, d)
            ml = _megatron_logits(model, ids, cfg.vocab_size)
        finally:
            gdn.l2norm = saved
        _compare(facts, tag, _hf_logits(cfg, tensors, ids, device), ml, FLA_REL if fla else FP32_REL)
        for what, change in _controls(cfg, tensors).items():
            _control(facts, tag, what, cfg, tensors, change, ids, device, ml)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(DSA))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    facts = Facts("oracle_" + ("dsa" if set(families) <= set(DSA) else "gdn" if set(families) <= set(GDN) else "frontier"),
                  dry_run=args.dry_run)
    from megatron_side import megatron_version, oracle_device

    facts.number("megatron-core", megatron_version())
    device = oracle_device(args.dry_run, facts)
    if device is None:
        return facts.finish(args.json)
    import transformers

    facts.number("transformers", transformers.__version__)
    gdn = None
    for family in families:
        try:
            if family in DSA:
                for over in _dsa_variants():
                    run_dsa(family, over, device, facts)
            elif family in GDN:
                gdn = gdn or _import_sides()
                run_gdn(family, device, facts, gdn)
            else:
                raise KeyError(f"{family}: not a frontier family ({DSA + GDN})")
        except Exception as e:  # noqa: BLE001 - the next family still runs
            facts.error(family, e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
