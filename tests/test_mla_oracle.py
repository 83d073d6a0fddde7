"""The GPU evidence's MLA oracle part (``tests/gpu/part_mla.py``), run on CPU exactly as
``bash .ci/gpu --dry-run`` runs it: its own subprocess, ``--dry-run``, one rank.

megatron-core's own MLA forward (local spec, megatron's ``DotProductAttention``) on a tiny
DeepSeek-V3 -- with and without ``q_lora_rank``, a first dense layer, MoE with shared experts and a
score-correction bias -- against transformers' ``DeepseekV3ForCausalLM`` loaded by
``from_pretrained`` from ``MegatronSource``'s export: fp32 logits within 2e-4 of the largest logit,
every negative control detected, the per-layer MLA tensor count reported. The oracle is
transformers' forward; the part asserts nothing about names beyond what ``save_pretrained`` writes.
"""

from __future__ import annotations

import os
import sys

import pytest


pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def test_mla_oracle_part_dry_run_megatron_forward_equals_transformers_from_export(tmp_path):
    sys.path.insert(0, os.path.join(HERE, "gpu"))
    import run_all
    from mla_models import unsupported
    from part_mla import MLA_TENSORS

    row = run_all._run_part(
        "oracle_mla", [sys.executable, os.path.join(HERE, "gpu", "part_mla.py"), "--dry-run"],
        900, str(tmp_path / "oracle_mla.json"),
    )
    doc = row["result"] or {}
    checks = {c["name"]: c for c in doc.get("checks", [])}
    failed = [f"{n}: {c['detail'][:300]}" for n, c in checks.items() if not c["ok"]]
    assert row["status"] == "PASS", (row["status"], row["rc"], failed, doc.get("errors"))
    # megatron-core 0.17+ cannot build q_lora_rank=None from the local spec: the part skips it there.
    variants = [v for v in MLA_TENSORS if unsupported(v) is None]
    assert "q_lora" in variants
    assert "q_lora_yarn" in variants  # the builder's YaRN mapping, compared forward to forward
    skipped = {s["name"] for s in doc["skips"]}
    assert not {f"deepseek_v3[{v}]" for v in variants} & skipped, doc["skips"]
    for v in variants:
        tag = f"deepseek_v3[{v}]"
        fp32 = [n for n in checks if n.startswith(f"{tag} fp32: transformers(export) logits == Megatron")]
        assert len(fp32) == 1 and checks[fp32[0]]["ok"], fp32
        assert doc["numbers"][f"{tag} fp32 rel_err"] <= 2e-4
        controls = [n for n in checks if n.startswith(f"{tag}: negative control")]
        assert len(controls) == 3 and all(checks[n]["ok"] for n in controls), controls
        assert doc["numbers"][f"{tag} MLA tensors per layer"].startswith(f"{len(MLA_TENSORS[v])} x 3 layers")
        strict = f"{tag} fp32: from_pretrained(export) loads strictly (no missing/unexpected/mismatched key)"
        assert checks[strict]["ok"]
