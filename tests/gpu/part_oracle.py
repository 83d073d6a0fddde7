"""Part 2 of the GPU evidence: the functional oracle for ``MegatronSource``.

A TP1 megatron-core ``GPTModel`` (local spec, Megatron's own init then perturbed) runs its own
forward; ``MegatronSource`` exports it; a transformers model of the same config loads the export
strictly (every parameter written, no unknown name); its forward must give the same logits:
float32 first (tight: 2e-4 of the largest logit; TF32 off), then the same weights in bf16
(5e-2 relative; for MoE, 75% of positions within it: bf16 routing flips near-ties between the
two implementations -- 2 of 48 positions on CPU with megatron-core 0.19.2 -- so fp32 is the oracle).
Megatron's forward and transformers' forward are two independent implementations of the same
function, so this checks every name, split, concatenation, transpose and trim of the export,
including the ones a names-and-shapes check cannot see (q/k/v row grouping, gate/up order).

Configs: dense Qwen3 (qk-norm, tied, head_dim != hidden/heads), Llama (untied), Qwen2 (qkv bias);
Qwen3-MoE, GLM-4.5 (partial rotary, sigmoid group-limited routing with expert bias, shared experts,
a dense first layer) and GPT-OSS (sinks, alternating sliding windows, YaRN, clamped SwiGLU, biased
router and experts held fused/transposed/interleaved) in every expert format megatron-core can build here (local SequentialMLP; legacy
GroupedMLP where this megatron-core still has it; TEGroupedMLP where Transformer Engine is
installed) -- formats that cannot be built are reported as skips with the reason.

Dense configs also run the other direction: transformers weights imported into Megatron by the CPU
tests' importer (``tests/megatron_worlds.import_hf``), Megatron logits == transformers logits, and
the export hands back the imported tensors bit for bit.

``--dry-run``: the same on CPU (``use_cpu_initialization``; Megatron's forward runs there with two
CUDA-only defaults redirected, see ``megatron_side.allow_cpu_forward``).

    python tests/gpu/part_oracle.py --configs qwen3,llama,qwen2,qwen3_moe [--dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from facts import Facts, log  # noqa: E402

FP32_REL = 2e-4
BF16_REL = 5e-2
MOE_BF16_POS_FRACTION = 0.75


def is_moe(family: str) -> bool:
    """Whether ``family``'s tiny config has routed experts (every expert format is tried; the
    HF->Megatron importer is dense-only)."""
    from hf_side import tiny_config

    cfg = tiny_config(family)
    return bool(getattr(cfg, "num_local_experts", 0) or getattr(cfg, "num_experts", 0)
                or getattr(cfg, "n_routed_experts", 0))


def _export_into_hf(model, cfg, dtype, device, facts: Facts, tag: str):
    """MegatronSource(model) -> a fresh transformers model (strict). Returns the HF model."""
    from hf_side import HFReceiver, build_hf

    from weightsync.sources import MegatronSource

    src = MegatronSource(model, hf_config=cfg)
    hf = build_hf(cfg, device=device, dtype=dtype, seed=99)
    recv = HFReceiver(hf, track=False)
    loaded = recv.load_weights(src.iter_full())
    facts.check(f"{tag}: export loads strictly, every HF parameter written",
                not recv.missing() and len(loaded) == len(src.metadata),
                f"loaded {len(loaded)} of {len(src.metadata)} declared; missing {recv.missing()[:5]}")
    return src, hf


def _negative_control(hf, ids, ml, cfg, facts: Facts, tag: str) -> None:
    """The comparison can fail: swapping layer 0's two key/value groups in ``k_proj`` (what a
    wrong q/k/v row grouping would do) must move the logits beyond the fp32 tolerance."""
    import torch

    from hf_side import compare_logits, hf_logits

    w = hf.model.layers[0].self_attn.k_proj.weight
    half = w.shape[0] // 2
    with torch.no_grad():
        saved = w.detach().clone()
        w.copy_(torch.cat([saved[half:], saved[:half]]))
        c = compare_logits(hf_logits(hf, ids), ml)
        w.copy_(saved)
    facts.check(f"{tag}: negative control (k groups swapped) is detected", c["rel_err"] > 10 * FP32_REL,
                f"rel_err {c['rel_err']:.3g}")


def _importer():
    """The test-only HF -> Megatron importer of the CPU Megatron tests (``tests/megatron_worlds``),
    or None with the reason when it is not there."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    try:
        from megatron_worlds import import_hf

        return import_hf, ""
    except Exception as e:  # noqa: BLE001
        return None, f"tests/megatron_worlds.import_hf not importable: {type(e).__name__}: {e}"


def run_imported(family: str, device: str, facts: Facts) -> None:
    """The other direction: a transformers model (HF init, then every tensor perturbed) imported
    into Megatron by the CPU tests' importer; Megatron's forward must give the transformers
    model's logits (fp32), and ``MegatronSource`` must hand back the original tensors bit for bit."""
    import torch

    from hf_side import build_hf, compare_logits, fixed_batch, hf_logits, tiny_config
    from megatron_side import build_megatron, megatron_logits

    from weightsync.sources import MegatronSource

    tag = f"{family} (HF->Megatron import)"
    import_hf, why = _importer()
    if import_hf is None:
        facts.skip(tag, why)
        return
    cfg = tiny_config(family)
    hf = build_hf(cfg, device=device, dtype=torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.01)
            p.add_(noise.to(p.device))
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    model = build_megatron(cfg, dtype=torch.float32, device=device, seed=23, perturb=False)
    import_hf(model, state, cfg)
    ids = fixed_batch(cfg.vocab_size, device=device)
    c = compare_logits(megatron_logits(model, ids, cfg.vocab_size), hf_logits(hf, ids))
    facts.check(f"{tag}: Megatron logits == transformers logits (fp32, rel<= {FP32_REL})",
                c["shape_equal"] and c["finite"] and c["rel_err"] <= FP32_REL, c)
    exported = {n: t.detach().cpu() for n, t in MegatronSource(model, hf_config=cfg).iter_full()}
    want = {k: v for k, v in state.items() if k in exported or not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    diff = sorted(k for k in set(want) | set(exported)
                  if k not in exported or k not in want or not torch.equal(exported[k], want[k]))
    facts.check(f"{tag}: export == the imported transformers tensors (bitwise)", not diff,
                f"{len(exported)} tensors" if not diff else f"differ: {diff[:5]}")


def run_config(family: str, fmt: str, device: str, facts: Facts) -> None:
    import torch

    from hf_side import checkpoint_layout, compare_logits, fixed_batch, hf_logits, tiny_config
    from megatron_side import build_megatron, describe, experts_class, megatron_logits

    cfg = tiny_config(family)
    moe = is_moe(family)
    tag = f"{family}[{fmt}]" if moe else family
    try:
        model = build_megatron(cfg, dtype=torch.float32, device=device, moe_format=fmt, seed=5)
    except Exception as e:  # noqa: BLE001
        if fmt != "local/sequential":
            facts.skip(tag, f"cannot build this expert format here: {type(e).__name__}: {str(e)[:300]}")
            return
        raise
    ecls = experts_class(model)
    if fmt == "local/grouped" and ecls == "SequentialMLP":
        facts.skip(tag, "this megatron-core's local spec has no legacy GroupedMLP (builds SequentialMLP again)")
        return
    log(f"[oracle] {tag}: {describe(model)}")

    layout = checkpoint_layout(cfg)
    src, hf = _export_into_hf(model, cfg, torch.float32, device, facts, f"{tag} fp32")
    meta = {m.name: tuple(m.shape) for m in src.metadata}
    want = {k: v[1] for k, v in layout.items()}
    facts.check(f"{tag}: metadata == save_pretrained names and shapes", meta == want,
                f"only in metadata {sorted(set(meta) - set(want))[:4]}, only in checkpoint "
                f"{sorted(set(want) - set(meta))[:4]}, shape diffs "
                f"{ {k: (meta[k], want[k]) for k in set(meta) & set(want) if meta[k] != want[k]} }")

    ids = fixed_batch(cfg.vocab_size, device=device)
    hl = hf_logits(hf, ids)
    facts.check(f"{tag} fp32: transformers forward on the export is finite", bool(torch.isfinite(hl).all()),
                tuple(hl.shape))
    ml = megatron_logits(model, ids, cfg.vocab_size)
    c = compare_logits(hl, ml)
    facts.check(f"{tag} fp32: transformers(export) logits == Megatron logits (rel<= {FP32_REL})",
                c["shape_equal"] and c["finite"] and c["rel_err"] <= FP32_REL, c)
    facts.number(f"{tag} fp32 rel_err", c["rel_err"])
    _negative_control(hf, ids, ml, cfg, facts, tag)

    mb = build_megatron(cfg, dtype=torch.bfloat16, device=device, moe_format=fmt, seed=5, perturb=False)
    mb.load_state_dict(model.state_dict(), strict=True)
    del model
    _, hfb = _export_into_hf(mb, cfg, torch.bfloat16, device, facts, f"{tag} bf16")
    c = compare_logits(hf_logits(hfb, ids), megatron_logits(mb, ids, cfg.vocab_size), tol=BF16_REL)
    ok = c["shape_equal"] and c["finite"] and (
        c["pos_within_tol"] >= MOE_BF16_POS_FRACTION if moe else c["rel_err"] <= BF16_REL
    )
    facts.check(
        f"{tag} bf16: transformers(export) logits == Megatron logits "
        f"({'>= 75% of positions ' if moe else ''}rel<= {BF16_REL})", ok, c,
    )
    facts.number(f"{tag} bf16 rel_err", c["rel_err"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="qwen3,llama,qwen2,qwen3_moe")
    ap.add_argument("--formats", default=None, help="MoE expert formats (default: all of MOE_FORMATS)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    families = [f for f in args.configs.split(",") if f]
    facts = Facts("oracle_" + "_".join(families), dry_run=args.dry_run)
    from megatron_side import MOE_FORMATS, oracle_device

    device = oracle_device(args.dry_run, facts)
    if device is None:
        return facts.finish(args.json)
    formats = args.formats.split(",") if args.formats else list(MOE_FORMATS)
    for family in families:
        for fmt in formats if is_moe(family) else ["local/sequential"]:
            try:
                run_config(family, fmt, device, facts)
            except Exception as e:  # noqa: BLE001 - next config still runs
                facts.error(f"{family}[{fmt}]", e)
        if not is_moe(family):
            try:
                run_imported(family, device, facts)
            except Exception as e:  # noqa: BLE001
                facts.error(f"{family} (HF->Megatron import)", e)
    return facts.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
