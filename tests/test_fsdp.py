"""FSDPSource on CPU gloo worlds, checked against transformers' ``save_pretrained`` and vLLM.

One world per scenario (starting one costs seconds); each returns facts asserted here:

* ``world_families`` (2 ranks): Llama/Qwen2/Qwen3, tied and untied, FSDP2 per layer + root.
* ``world_hsdp`` (4 ranks): HSDP (Replicate, Shard(0)) and FSDP+TP (``_StridedShard`` fallback).
* ``world_wrappers`` (2 ranks): AC + torch.compile + DDP-like wrappers, CPU offload, ignored
  params, keep_fp32 / group_bytes, vLLM's NCCL trainer engine on a non-sender rank, bad input.
"""

from __future__ import annotations

import os

import pytest
import torch

from fsdp_worlds import FAMILIES, load_oracle, unpack, world_families, world_hsdp, world_wrappers
from worlds import CONTEXT, run_world

pytestmark = pytest.mark.slow

# Collectives a pass may add to the FSDP unit count: the root unit of a transformers model is
# gathered in two runs (embeddings first, final norm / lm_head last), because the stream follows
# checkpoint order and the source holds at most one group.
EXTRA_RUNS = 1


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (
        f"{what}: names differ: extra {sorted(set(got) - set(want))}, "
        f"missing {sorted(set(want) - set(got))}"
    )
    for n, w in want.items():
        g = got[n]
        assert g.dtype == w.dtype, f"{what}: {n} dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{what}: {n} shape {tuple(g.shape)} != {tuple(w.shape)}"
        # bytes, not values: NaN-safe and catches -0.0 vs 0.0
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (
            f"{what}: {n} bytes differ"
        )


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_families")
    return unpack(run_world(world_families, 2, timeout=420, oracle_dir=str(d))), d


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fsdp2_stream_equals_save_pretrained(families, family, tied):
    results, d = families
    key = f"{family}-{'tied' if tied else 'untied'}"
    oracle = load_oracle(os.path.join(d, key))
    oracle_bf16 = load_oracle(os.path.join(d, key + "-bf16"))
    assert ("lm_head.weight" in oracle) is (not tied)  # the oracle itself, for the reader
    for rank, facts in results.items():
        f = facts[key]
        assert_same_tensors(f["fp32"], oracle, f"rank {rank} {key} fp32")
        assert_same_tensors(f["bf16"], oracle_bf16, f"rank {rank} {key} bf16 wire")
        # metadata declares the wire dtype, and the stream follows metadata order
        assert set(f["bf16_meta_dtypes"].values()) == {"torch.bfloat16"}
        assert [m[0] for m in f["meta"]] == list(f["fp32"])
        # cast before gather: half the bytes received (each tensor's block is 16-byte aligned)
        fp32_rx, bf16_rx = f["stats2"]["bytes_received"], f["bf16_stats"]["bytes_received"]
        assert fp32_rx / 2 <= bf16_rx <= fp32_rx / 2 + 16 * len(f["meta"])


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_identical_on_every_rank_without_collectives(families, family):
    results, _ = families
    for tied in ("tied", "untied"):
        metas = [results[r][f"{family}-{tied}"]["meta"] for r in sorted(results)]
        assert all(m == metas[0] for m in metas[1:])
        # same names as vLLM's ModuleSource where no alias is involved, plus lm_head iff untied
        ms_names = results[0][f"{family}-{tied}"]["ms_names"]
        assert [m[0] for m in metas[0]] == ms_names


@pytest.mark.parametrize("family", FAMILIES)
def test_collectives_per_pass_bounded_by_fsdp_units(families, family):
    results, _ = families
    for tied in ("tied", "untied"):
        for rank, facts in results.items():
            f = facts[f"{family}-{tied}"]
            n_params = len(f["meta"])
            # independent counters (patched python functions, dispatcher ops) agree with the source's
            assert f["calls"] == f["ops"] == f["stats2"]["collectives"], f
            assert f["calls"] <= f["units"] + EXTRA_RUNS
            # vLLM's ModuleSource: one gather per parameter
            assert f["ms_calls"] == n_params and f["ms_ops"] == n_params, f
            assert f["calls"] < f["ms_calls"]


def test_yielded_tensors_stay_valid_and_module_is_untouched(families):
    results, _ = families
    for rank, facts in results.items():
        for key, f in facts.items():
            assert f["kept_equal"], f"rank {rank} {key}: first-pass tensors changed"
            ptrs = [p for p in f["first_ptrs"]]
            assert len(set(ptrs)) == len(ptrs), f"rank {rank} {key}: yielded tensors share storage"
            assert f["module_changed"] == [], f"rank {rank} {key}: {f['module_changed'][:3]}"
            assert f["ms_full_equal"], f"rank {rank} {key}: differs from ModuleSource"


def test_iter_local_matches_vllm_module_source(families):
    results, _ = families
    for rank, facts in results.items():
        for key, f in facts.items():
            assert_same_tensors(f["local"], f["ms_local"], f"rank {rank} {key} iter_local")


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_hsdp")
    return unpack(run_world(world_hsdp, 4, timeout=420, oracle_dir=str(d))), d


def test_hsdp_on_four_ranks(hsdp):
    results, d = hsdp
    oracle = load_oracle(os.path.join(d, "hsdp"))
    metas = [results[r]["meta"] for r in range(4)]
    assert all(m == metas[0] for m in metas)
    for rank, f in results.items():
        assert f["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert_same_tensors(f["full"], oracle, f"rank {rank} hsdp")
        assert f["calls"] == f["ops"] == f["stats2"]["collectives"] <= f["units"] + EXTRA_RUNS
        assert f["ms_calls"] == len(oracle)
        assert_same_tensors(f["local"], f["ms_local"], f"rank {rank} hsdp iter_local")
        assert f["module_changed"] == []


def test_fsdp_tp_strided_shards_fall_back_to_full_tensor(hsdp):
    results, d = hsdp
    oracle = {k: v.to(torch.bfloat16) for k, v in load_oracle(os.path.join(d, "fsdp_tp")).items()}
    for rank, f in results.items():
        assert any("_StridedShard" in p for p in f["tp_placements"]), f["tp_placements"]
        assert_same_tensors(f["tp_full"], oracle, f"rank {rank} fsdp+tp")
        ms = {k: v.to(torch.bfloat16) for k, v in f["tp_ms_full"].items()}
        assert_same_tensors(f["tp_full"], ms, f"rank {rank} fsdp+tp vs ModuleSource")


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle_wrappers")
    return unpack(run_world(world_wrappers, 2, timeout=420, oracle_dir=str(d))), d


def test_wrapper_prefixes_are_stripped(wrappers):
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "wrapped"))
    for rank, f in results.items():
        inmem = f["wrapped_inmemory"][1]
        assert inmem.startswith("module._orig_mod.") and "_checkpoint_wrapped_module" in inmem
        assert_same_tensors(f["wrapped_full"], oracle, f"rank {rank} wrapped")
        assert f["wrapped_calls"] == f["wrapped_ops"] <= f["wrapped_units"] + EXTRA_RUNS


def test_cpu_offload_stages_and_leaves_module_as_it_was(wrappers):
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "offload"))
    for rank, f in results.items():
        assert_same_tensors(f["offload_full"], oracle, f"rank {rank} offload")
        assert f["offload_changed"] == [], f["offload_changed"][:3]
        assert f["offload_calls"] == f["offload_ops"] <= f["offload_units"] + EXTRA_RUNS
        ms = {k: v.to(torch.bfloat16) for k, v in f["offload_ms_full"].items()}
        assert_same_tensors(f["offload_full"], ms, f"rank {rank} offload vs ModuleSource")


def test_ignored_params_are_sent_plain(wrappers):
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "ignored"))
    for rank, f in results.items():
        plain = {n for n, t in f["ignored_types"].items() if t != "DTensor"}
        assert plain == {"model.norm.weight", "model.layers.0.input_layernorm.weight"}, plain
        assert_same_tensors(f["ignored_full"], oracle, f"rank {rank} ignored")


def test_keep_fp32_and_group_bytes(wrappers):
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "ignored"))
    for rank, f in results.items():
        want = {k: (v if k.endswith("norm.weight") else v.to(torch.bfloat16)) for k, v in oracle.items()}
        assert {k for k, v in f["keep_meta"].items() if v == "torch.float32"} == {
            k for k in oracle if k.endswith("norm.weight")
        }
        assert_same_tensors(f["keep_full"], want, f"rank {rank} keep_fp32")
        assert f["keep_calls"] > f["nokeep_calls"]  # 4 KiB groups split the units


def test_vllm_nccl_engine_non_sender_drives_source(wrappers):
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "nccl"))
    assert_same_tensors(results[0]["nccl_sender"], oracle, "sender via vLLM _checked_iter")
    assert results[1]["nccl_is_sender"] is False
    assert results[1]["nccl_nonsender_tensors"] == len(oracle)
    assert results[1]["nccl_nonsender_collectives"] > 0


def test_moe_experts_default_to_the_checkpoint_layout(wrappers):
    """No option: fused transformers-5 experts are sent per expert, names/bytes == save_pretrained;
    a dense model gets no expert transform."""
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "moe"))
    assert any(".experts.0.gate_proj.weight" in n for n in oracle)
    for rank, f in results.items():
        assert f["moe_default_layout"] == "per_expert"
        assert_same_tensors(f["moe_default_full"], oracle, f"rank {rank} moe default")
        assert f["dense_expert_transform"] is None


def test_vlm_from_config_and_from_pretrained_as_save_pretrained_writes(wrappers):
    """Qwen2.5-VL (issue 27): save_pretrained writes model.* / visual.* for the in-memory
    model.language_model.* / model.visual.*; FSDPSource sends those names (and bytes, fp32 and
    bf16) whether the model came from from_config or from_pretrained, though fully_shard renamed
    the classes the rename is keyed on."""
    results, d = wrappers
    oracle = load_oracle(os.path.join(d, "vlm"))
    assert "model.embed_tokens.weight" in oracle and "visual.patch_embed.proj.weight" in oracle
    assert not any(n.startswith("model.language_model.") for n in oracle)
    bf16 = {k: v.to(torch.bfloat16) for k, v in oracle.items()}
    for rank, f in results.items():
        assert "model.language_model.embed_tokens.weight" in f["vlm_inmemory"]
        for key in ("vlm_config", "vlm_pretrained"):
            assert f[key + "_class"].startswith("FSDP")
            assert_same_tensors(f[key], oracle, f"rank {rank} {key}")
            assert_same_tensors(f[key + "_bf16"], bf16, f"rank {rank} {key} bf16")


def test_bad_input_raises_named_errors_on_every_rank(wrappers):
    results, _ = wrappers
    for rank, f in results.items():
        for key in ("err_moe", "err_moe_iter", "err_moe_fused"):
            err = f[key]
            assert err is not None and err.startswith("UnmappedParameterError"), (key, err)
            assert f"rank {rank}" in err and "model.layers.0.mlp.experts.gate_up_proj" in err, err
        assert f["err_layout"].startswith("ValueError") and "expert_layout='stacked'" in f["err_layout"]
        assert "dtype=" in f["err_dtype"] and "int8" in f["err_dtype"]
        assert "keep_fp32=" in f["err_regex"]
        assert "group_bytes=" in f["err_group"]
        assert f["err_module"].startswith("TypeError") and "module=" in f["err_module"]
        assert f["err_diverge"].startswith("CrossRankMismatchError"), f["err_diverge"]
        assert "dtype" in f["err_diverge"] or "float16" in f["err_diverge"]


def test_rank_stopping_mid_pass_is_a_named_timeout_not_a_hang(wrappers):
    results, _ = wrappers
    err = results[0]["err_quit"]
    assert err is not None and err.startswith("SyncTimeoutError"), err
    assert "rank 1" in err and "all-gather" in err, err
    assert "within 3s" in err, err  # the source's timeout_s, not the default


def test_loopback_engine_end_to_end(tmp_path):
    """Trainer world -> weightsync's loopback engine (built by vLLM's trainer factory) -> a receiver
    process. Oracle: vLLM's own weight digests of the receiver vs of transformers' from_pretrained
    of the save_pretrained (bf16) checkpoint."""
    import functools

    from transformers import AutoModelForCausalLM
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from fsdp_worlds import receiver_model, world_loopback
    from weightsync.plugins.loopback.receiver import start_receiver_process

    client, handle = start_receiver_process(functools.partial(receiver_model), mp_context=CONTEXT)
    with handle:
        before = client.weight_digests()
        results = unpack(
            run_world(
                world_loopback, 2, timeout=420, oracle_dir=str(tmp_path), port=0, url=handle.url
            )
        )
        after = client.weight_digests()
    oracle_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    want = dict(compute_tensor_digests(oracle_model))
    assert sorted(after) == sorted(want)
    assert after == want
    assert before != want  # the receiver started from other weights
    for rank, f in results.items():
        assert f["engine"] == "LoopbackTrainerWeightTransferEngine"
        assert f["tensors"] == len(want)
        assert f["collectives"] <= f["units"] + EXTRA_RUNS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (2 devices for a real gather)")
def test_cuda_side_streams_and_real_cpu_offload():
    import multiprocessing as mp

    from fsdp_worlds import cuda_streams_rank
    import torch.distributed as dist

    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)  # port 0: no race
    port = store.port
    procs = [ctx.Process(target=cuda_streams_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            r, status, value = queue.get(timeout=300)
            out[r] = (status, value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in out.items() if s != "ok"}
    assert not errors, errors
    for rank, (_, facts) in out.items():
        for variant, f in facts.items():
            assert f["names_equal"] and f["bad"] == [], (rank, variant, f["bad"][:5])
            assert f["storage_kept"], (rank, variant)
            assert f["collectives"] <= f["units"] + EXTRA_RUNS, (rank, variant, f)
        assert facts["offload"]["devices"] == ["cpu"]
        assert facts["gpu"]["devices"] == [f"cuda:{rank}"]


def test_plain_module_in_one_process_equals_save_pretrained(tmp_path):
    """No process group, no FSDP: the same source is a plain drop-in for ModuleSource(model)."""
    from vllm.distributed.weight_transfer import ModuleSource

    from fsdp_worlds import save_oracle, tiny_model

    from weightsync.sources import FSDPSource

    for tied in (True, False):
        model = tiny_model("llama", tied=tied, seed=7)
        d = tmp_path / f"plain-{tied}"
        save_oracle(model, str(d), torch.bfloat16)
        src = FSDPSource(model, dtype=torch.bfloat16)
        got = {n: t.clone() for n, t in src.iter_full()}
        assert_same_tensors(got, load_oracle(str(d)), f"plain tied={tied}")
        assert all(m.owners is None for m in src.metadata)
        assert src.last_pass.collectives == 0
        # vLLM's ModuleSource keeps named_parameters' names: the same here (no alias, no wrapper)
        assert [m.name for m in src.metadata] == [m.name for m in ModuleSource(model).metadata]
