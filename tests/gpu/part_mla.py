"""Part of the GPU evidence: the functional oracle for ``MegatronSource``'s multi-latent attention
(DeepSeek-V3 class) export.

A TP1 megatron-core ``GPTModel`` with ``MLASelfAttention`` (local spec; with ``q_lora_rank``:
``linear_q_down_proj`` + ``q_layernorm`` + ``linear_q_up_proj``, without it: ``linear_q_proj``),
a first dense layer, then MoE layers with sigmoid group-limited routing, a score-correction bias
and shared experts, Megatron's own init then perturbed (expert bias included), runs its own forward.
``MegatronSource`` exports it; the export is written as a checkpoint folder (transformers'
``config.json`` + one safetensors file) and transformers' own ``from_pretrained`` loads it into
``DeepseekV3ForCausalLM`` -- no missing, unexpected or mismatched key -- whose forward must give
Megatron's logits: float32 within 2e-4 of the largest logit (TF32 off), then bf16 (MoE criterion of
``part_oracle``). Two independent implementations of the same function, so this checks every MLA
name, row layout (``[nope, rope]`` per query head, ``[k_nope, v]`` per head in ``kv_b_proj``,
``[latent, rope]`` in ``kv_a_proj_with_mqa``) and norm placement, which a names-and-shapes check
cannot see.

Negative controls (each must move the fp32 logits beyond 10x the tolerance): ``kv_b_proj`` rows
regrouped from per-head ``[k_nope_h, v_h]`` to ``[all k_nope; all v]`` (a wrong split rule),
``kv_a_proj_with_mqa``'s rope rows moved before the latent rows, and the first MoE layer's
score-correction bias dropped (it only moves which experts are chosen; the check must see that).

The summary gets the per-layer MLA tensor count of the export (equal to ``save_pretrained``'s).

``--dry-run``: the same on CPU (megatron-core's MLA forward runs there with
``megatron_side.allow_cpu_forward``); ``tests/test_mla_oracle.py`` runs it so.

    python tests/gpu/part_mla.py [--variants q_lora,no_q_lora] [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402
from part_oracle import BF16_REL, FP32_REL, MOE_BF16_POS_FRACTION  # noqa: E402

#: variant -> DeepSeek-V3 config overrides (``hf_side.tiny_config("deepseek_v3", **overrides)``).
VARIANTS: dict[str, dict[str, Any]] = {
    "q_lora": {},
    "no_q_lora": {"q_lora_rank": None},
    # YaRN as DeepSeek-V3 ships it (factor, beta_fast/slow, mscale == mscale_all_dim): the builder maps
    # it to megatron's rope_type="yarn" (families/deepseek_v3.py); this compares the two forwards.
    "q_lora_yarn": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }},
}

#: The attention tensors of one DeepSeek-V3 layer in the checkpoint, per variant.
MLA_TENSORS = {
    "q_lora": ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
               "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"),
    "q_lora_yarn": ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                    "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"),
    "no_q_lora": ("q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                  "o_proj.weight"),
}

_ATTN = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")


def mla_tensors_per_layer(names: list[str]) -> dict[int, list[str]]:
    """``{layer: sorted attention tensor names}`` of a checkpoint's names."""
    out: dict[int, list[str]] = {}
    for n in names:
        m = _ATTN.match(n)
        if m:
            out.setdefault(int(m[1]), []).append(m[2])
    return {k: sorted(v) for k, v in sorted(out.items())}


def export_checkpoint(model, cfg, directory: str) -> tuple[Any, dict]:
    """``MegatronSource(model)`` written as a checkpoint folder; returns the source and the
    exported tensors (on CPU)."""
    from safetensors.torch import save_file

    from weightsync.sources import MegatronSource

    src = MegatronSource(model, hf_config=cfg)
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in src.iter_full()}
    cfg.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return src, tensors


def load_export(directory: str, dtype, device: str, facts: Facts, tag: str):
    """transformers' ``from_pretrained`` of the export; a check that the load was strict."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: sorted(v)[:5] for k, v in info.items() if v}
    facts.check(f"{tag}: from_pretrained(export) loads strictly (no missing/unexpected/mismatched key)",
                not bad, bad or "every key")
    return hf.to(device).eval()


def _controls(hf, ids, ml, cfg, facts: Facts, tag: str) -> None:
    """The comparison can fail: shape-preserving export mistakes must each break it."""
    import torch

    from hf_side import compare_logits, hf_logits

    attn = hf.model.layers[1].self_attn
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_lora = cfg.kv_lora_rank

    def regroup_kv_b(w):  # [k_h, v_h] x H  ->  [k x H; v x H]
        per = w.view(heads, nope + v, -1)
        return torch.cat([per[:, :nope].reshape(heads * nope, -1), per[:, nope:].reshape(heads * v, -1)])

    def rope_first(w):  # [latent; rope] -> [rope; latent]
        return torch.cat([w[kv_lora:], w[:kv_lora]])

    for what, param, wrong in (
        ("kv_b_proj rows regrouped [all k_nope; all v]", attn.kv_b_proj.weight, regroup_kv_b),
        ("kv_a_proj_with_mqa rope rows before the latent", attn.kv_a_proj_with_mqa.weight, rope_first),
        ("e_score_correction_bias zeroed", hf.model.layers[1].mlp.gate.e_score_correction_bias, torch.zeros_like),
    ):
        with torch.no_grad():
            saved = param.detach().clone()
            param.copy_(wrong(saved))
            c = compare_logits(hf_logits(hf, ids), ml)
            param.copy_(saved)
        facts.check(f"{tag}: negative control ({what}) is detected", c["rel_err"] > 10 * FP32_REL,
                    f"rel_err {c['rel_err']:.3g}")


def run_variant(variant: str, device: str, facts: Facts) -> None:
    import torch

    from hf_side import checkpoint_layout, compare_logits, fixed_batch, hf_logits, tiny_config
    from megatron_side import build_megatron, describe, megatron_logits, megatron_version

    cfg = tiny_config("deepseek_v3", **VARIANTS[variant])
    tag = f"deepseek_v3[{variant}]"
    try:
        model = build_megatron(cfg, dtype=torch.float32, device=device, seed=7)
    except Exception as e:  # noqa: BLE001
        if cfg.q_lora_rank is not None:
            raise
        # megatron-core 0.19's MLA norm resolver puts a q norm into linear_q_proj whenever
        # qk_layernorm is on and q_lora_rank is None (TE's fused norm+linear; the local spec has
        # none and raises) -- the kv_a_layernorm of a q_lora_rank=None checkpoint cannot be had
        # without it. 0.16 builds this variant.
        facts.skip(tag, f"megatron-core {megatron_version()} cannot build MLA without q_lora_rank "
                        f"with the local spec: {type(e).__name__}: {str(e)[:300]}")
        return
    log(f"[mla] {tag}: {describe(model)}")
    layout = checkpoint_layout(cfg)
    with tempfile.TemporaryDirectory() as d:
        src, exported = export_checkpoint(model, cfg, d)
        meta = {m.name: tuple(m.shape) for m in src.metadata}
        want = {k: v[1] for k, v in layout.items()}
        facts.check(f"{tag}: metadata == save_pretrained names and shapes", meta == want,
                    f"only in metadata {sorted(set(meta) - set(want))[:4]}, only in checkpoint "
                    f"{sorted(set(want) - set(meta))[:4]}")
        per_layer = mla_tensors_per_layer(list(exported))
        expected = sorted(MLA_TENSORS[variant])
        facts.check(f"{tag}: every layer exports the {len(expected)} MLA tensors save_pretrained has",
                    per_layer == mla_tensors_per_layer(list(layout))
                    and all(v == expected for v in per_layer.values())
                    and sorted(per_layer) == list(range(cfg.num_hidden_layers)), per_layer)
        leaves = ", ".join(n.removesuffix(".weight") for n in expected)
        facts.number(f"{tag} MLA tensors per layer", f"{len(expected)} x {len(per_layer)} layers ({leaves})")
        bias = {n: t for n, t in exported.items() if n.endswith("e_score_correction_bias")}
        router_bias = {int(n.split(".")[2]): b.detach().cpu() for n, b in model.named_buffers()
                       if n.endswith("router.expert_bias")}
        facts.check(f"{tag}: e_score_correction_bias == Megatron's router expert_bias (bitwise, fp32)",
                    len(bias) == len(router_bias) > 0 and all(
                        torch.equal(bias[f"model.layers.{i}.mlp.gate.e_score_correction_bias"], b)
                        for i, b in router_bias.items()), sorted(bias))
        hf = load_export(d, torch.float32, device, facts, f"{tag} fp32")

    ids = fixed_batch(cfg.vocab_size, device=device)
    ml = megatron_logits(model, ids, cfg.vocab_size)
    c = compare_logits(hf_logits(hf, ids), ml)
    facts.check(f"{tag} fp32: transformers(export) logits == Megatron logits (rel<= {FP32_REL})",
                c["shape_equal"] and c["finite"] and c["rel_err"] <= FP32_REL, c)
    facts.number(f"{tag} fp32 rel_err", c["rel_err"])
    _controls(hf, ids, ml, cfg, facts, tag)

    mb = build_megatron(cfg, dtype=torch.bfloat16, device=device, seed=7, perturb=False)
    mb.load_state_dict(model.state_dict(), strict=True)  # the router's expert_bias stays fp32
    del model, hf
    with tempfile.TemporaryDirectory() as d:
        export_checkpoint(mb, cfg, d)
        hfb = load_export(d, torch.bfloat16, device, facts, f"{tag} bf16")
    c = compare_logits(hf_logits(hfb, ids), megatron_logits(mb, ids, cfg.vocab_size), tol=BF16_REL)
    facts.check(f"{tag} bf16: transformers(export) logits == Megatron logits "
                f"(>= {MOE_BF16_POS_FRACTION:.0%} of positions rel<= {BF16_REL})",
                c["shape_equal"] and c["finite"] and c["pos_within_tol"] >= MOE_BF16_POS_FRACTION, c)
    facts.number(f"{tag} bf16 rel_err", c["rel_err"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    facts = Facts("oracle_mla", dry_run=args.dry_run)
    from megatron_side import megatron_version, oracle_device

    facts.number("megatron-core", megatron_version())
    device = oracle_device(args.dry_run, facts)
    if device is None:
        return facts.finish(args.json)
    for variant in [v for v in args.variants.split(",") if v]:
        try:
            run_variant(variant, device, facts)
        except Exception as e:  # noqa: BLE001 - the next variant still runs
            facts.error(f"deepseek_v3[{variant}]", e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
