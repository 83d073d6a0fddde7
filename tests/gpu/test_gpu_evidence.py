"""The GPU evidence as pytest tests: each runs one part of ``run_all.PARTS`` in its own subprocess
(as ``bash .ci/gpu`` does) and asserts on the facts it reports. Skipped without CUDA and the kit."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_all  # noqa: E402

PARTS = {name: (script, extra, timeout) for name, script, extra, timeout in run_all.PARTS}


def _run(name: str) -> dict:
    script, extra, timeout = PARTS[name]
    with tempfile.TemporaryDirectory() as d:
        row = run_all._run_part(name, [sys.executable, os.path.join(run_all.ROOT, script), *extra],
                                timeout, os.path.join(d, f"{name}.json"))
    doc = row["result"] or {}
    failed = [f"{c['name']}: {c['detail']}" for c in doc.get("checks", []) if not c["ok"]]
    assert row["status"] == "PASS", f"{name}: {row['status']} (rc {row['rc']}); failed: {failed}"
    return doc


def test_ipc_round_trip_fsdp_source_through_vllm_ipc_engines():
    doc = _run("ipc_fsdp")
    names = [c["name"] for c in doc["checks"]]
    for mode in ("unpacked", "packed"):
        assert any(n.startswith(f"fsdp/{mode} refit 2: receiver logits") for n in names)


def test_overlapped_gathers_keep_stream_order():
    doc = _run("streams")
    names = [c["name"] for c in doc["checks"]]
    assert sum(n.startswith("pass ") for n in names) == 3
    assert sum(n.startswith("control: ") for n in names) == 2  # the scenario can fail


def test_ipc_round_trip_megatron_source_through_vllm_ipc_engines():
    doc = _run("ipc_megatron")
    assert any("receiver logits == trainer logits" in c["name"] for c in doc["checks"])


def test_megatron_export_logits_match_transformers_dense():
    doc = _run("oracle_dense")
    for fam in ("qwen3", "llama", "qwen2"):
        assert any(c["name"].startswith(f"{fam} fp32: transformers(export) logits") for c in doc["checks"])


def test_megatron_export_logits_match_transformers_moe():
    doc = _run("oracle_moe")
    assert any("local/sequential] bf16: transformers(export) logits" in c["name"] for c in doc["checks"])
    for family in ("glm4_moe", "gpt_oss"):
        assert any(c["name"].startswith(f"{family}[local/sequential] fp32: transformers(export) logits")
                   for c in doc["checks"])


def test_ipc_round_trip_new_families_through_vllm_ipc_engines():
    doc = _run("ipc_families")
    names = [c["name"] for c in doc["checks"]]
    for family in ("glm4_moe", "gpt_oss"):
        for kind in ("fsdp", "megatron"):
            assert any(n.startswith(f"{family} {kind}/packed refit 2: receiver logits") for n in names)
        assert any(n.startswith(f"{family} fsdp/unpacked refit 1: receiver tensors == save_pretrained") for n in names)


def test_megatron_mla_export_logits_match_transformers_deepseek_v3():
    doc = _run("oracle_mla")
    assert any(c["name"].startswith("deepseek_v3[q_lora] fp32: transformers(export) logits") for c in doc["checks"])
    assert "deepseek_v3[q_lora] MLA tensors per layer" in doc["numbers"]


def test_delta_rounds_exact_on_cuda():
    doc = _run("delta")
    names = [c["name"] for c in doc["checks"]]
    for kind in ("plain", "fsdp2", "megatron"):
        for snapshot in ("device", "cpu"):
            for r in (1, 2, 4, 5, 6):
                assert any(n.startswith(f"{kind} snapshot={snapshot} round {r} (") and "receiver (vLLM" in n
                           for n in names), (kind, snapshot, r)


def test_sparse_nccl_engine_to_engine_or_skip():
    doc = _run("sparse_nccl")
    if not doc["checks"]:
        pytest.skip(doc["skips"][0]["reason"])  # fewer than 2 GPUs
    names = [c["name"] for c in doc["checks"]]
    assert any(n.startswith("preflight: a known tensor") for n in names)
    assert any(n.startswith("round 6 (auto anchor): worker tensors ==") for n in names)


@pytest.mark.parametrize("name", ["bench_ipc", "bench_megatron", "bench_delta"])
def test_gpu_benchmarks_run_and_check_their_transfers(name):
    doc = _run(name)
    assert any(k.startswith("ratio") for k in doc["numbers"])
