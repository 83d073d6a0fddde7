"""``weightsync plan`` (issue 46): its counts equal what the sources' own passes report.

The oracle is the sources themselves: ``tests/plan_worlds.py`` runs real passes on 4 gloo ranks
(FSDP2, HSDP one sender / FP8 / ``senders="owners"``, Megatron TP2xPP2, PP2xVPP2xDP2, TP2xEP2,
PP2xEP2, a delta round) and returns each rank's ``PassStats``; ``plan()`` predicts the same fields
for the same model and layout from the meta-device model, in this process, without a collective.
Tensors, bytes, collectives and bytes received must be equal on every rank; the peak-extra-memory
estimates are bounds each pass must stay under (FSDP and Megatron). The Qwen3-30B-A3B test checks the count ``save_pretrained`` writes at full
size (48 x (128 x 3 + 9) + 3 = 18,867), in seconds on CPU.
"""

from __future__ import annotations

import json
import time

import pytest
from worlds import run_world

from weightsync.plugins.planner import plan, render

pytestmark = pytest.mark.slow

FIELDS = ("tensors", "bytes", "collectives", "bytes_received")


def _write(path, config) -> str:
    config.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=250,
                  tie_word_embeddings=False, max_position_embeddings=128)
    dense = Qwen3Config(intermediate_size=128, num_hidden_layers=4, **common)
    moe = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, **common)
    base = tmp_path_factory.mktemp("plan")
    return {"dense": _write(base / "dense", dense), "moe": _write(base / "moe", moe)}


@pytest.fixture(scope="module")
def real(configs):
    from plan_worlds import world_plan

    return run_world(world_plan, 4, timeout=300, dense_dir=configs["dense"], moe_dir=configs["moe"])


def _equal(predicted, real: dict[int, dict], what: str) -> None:
    for rank, stats in real.items():
        want = {k: stats[k] for k in FIELDS}
        got = {k: getattr(predicted.per_rank[rank], k) for k in FIELDS}
        assert got == want, (what, rank, got, want)


def test_fsdp_and_hsdp_counts_equal_the_passes(configs, real):
    from plan_worlds import SMALL_GROUP_BYTES

    p = plan(configs["moe"], world=4, group_bytes=SMALL_GROUP_BYTES, device="cpu")
    real_fsdp = {r: real[r]["fsdp"] for r in real}
    _equal(p.sources[0], real_fsdp, "fsdp")
    assert real_fsdp[0]["collectives"] > 6  # the small groups split units: more gathers than units
    for r in real:  # the peak-memory estimate is a bound the pass stays under
        assert real_fsdp[r]["peak_extra_bytes"] <= p.sources[0].per_rank[r].peak_extra_bytes, ("fsdp", r)

    h = plan(configs["dense"], world=4, replicas=2, device="cpu")
    _equal(h.sources[0], {r: real[r]["hsdp"] for r in real}, "hsdp")
    for r in real:
        assert real[r]["hsdp"]["peak_extra_bytes"] <= h.sources[0].per_rank[r].peak_extra_bytes, ("hsdp", r)


def test_hsdp_owners_counts_equal_the_pass(configs, real):
    from many_senders_worlds import skip_reason

    if "hsdp_owners" not in real[0]:
        pytest.skip(skip_reason())
    o = plan(configs["dense"], world=4, replicas=2, senders="owners")
    real_owners = {r: real[r]["hsdp_owners"] for r in real}
    _equal(o.sources[0], real_owners, "hsdp owners")
    assert real_owners[0]["tensors"] != real_owners[2]["tensors"]  # each replica sends its own run
    assert o.sources[0].bytes_per_sender == {0: real_owners[0]["bytes"], 2: real_owners[2]["bytes"]}


def test_fp8_counts_equal_the_stream(configs, real):
    q = plan(configs["dense"], world=4, replicas=2, fp8=True)
    assert [s.source for s in q.sources] == ["FSDPSource (HSDP)", "FP8Source"]
    _equal(q.sources[1], {r: real[r]["hsdp_fp8"] for r in real}, "fp8")


@pytest.mark.parametrize("key,kw", [
    ("megatron_tp2_pp2", dict(cfg="dense", tp=2, pp=2)),
    ("megatron_tp2_ep2", dict(cfg="moe", tp=2, ep=2)),
    ("megatron_pp2_ep2", dict(cfg="moe", pp=2, ep=2)),
    ("megatron_pp2_vpp2", dict(cfg="dense", pp=2, vpp=2, world=4)),
])
def test_megatron_counts_equal_the_passes(configs, real, key, kw):
    cfg = configs[kw.pop("cfg")]
    p = plan(cfg, layout="megatron", device="cpu", **kw)
    real_m = {r: real[r][key] for r in real}
    _equal(p.sources[0], real_m, key)
    assert real_m[0]["collectives"] > 0 and real_m[2]["collectives"] > 0
    for r in real_m:  # the memory estimate bounds the pass (rank 0: the units posted ahead, or an expert batch)
        assert real_m[r]["peak_extra_bytes"] <= p.sources[0].per_rank[r].peak_extra_bytes, (key, r)


def test_delta_wire_bytes_equal_the_round(configs, real):
    d = real[0]["delta"]
    assert not d["anchor"] and 0 < d["changed"] < d["elements"]
    p = plan(configs["dense"], world=4, replicas=2, backend="sparse", changed=d["changed"] / d["elements"])
    delta = p.sources[-1]
    assert delta.source == "DeltaSource(FSDPSource (HSDP))"
    assert d["elements"] == p.parameters  # every element of the checkpoint
    assert (delta.tensors, delta.bytes) == (d["tensors"], d["wire_bytes"]), (delta.tensors, delta.bytes, d)


def test_qwen3_30b_a3b_counts_in_seconds(tmp_path):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_experts=128, moe_intermediate_size=768,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                         intermediate_size=6144, num_experts_per_tok=8, tie_word_embeddings=False)
    cfg.save_pretrained(str(tmp_path))
    t0 = time.perf_counter()
    p = plan(str(tmp_path), world=8)
    took = time.perf_counter() - t0
    assert p.sources[0].tensors == 48 * (128 * 3 + 9) + 3 == 18_867
    # bf16 everywhere but the 48 fp32 routers [128, 2048]
    params = p.parameters
    assert p.sources[0].bytes == 2 * params + 2 * 48 * 128 * 2048
    assert p.total_s > 0 and set(p.time_s) == {"trainer_gathers", "host_per_tensor", "wire", "receiver_apply"}
    assert any("outside what was measured" in n for n in p.notes)
    assert took < 30, took
    text = render(p)
    assert "18,867 tensors" in text and "ASSUMED" in text


def test_cli_json_and_usage_errors(configs, capsys):
    from weightsync.plugins.cli import main

    assert main(["plan", "--config", configs["dense"], "--world", "4", "--replicas", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sources"][0]["tensors"] == 4 * 11 + 3 and out["time_s"]["total"] > 0
    assert main(["plan", "--config", configs["dense"], "--world", "3", "--replicas", "2"]) == 2
    assert "--world 3 is not a multiple of --replicas 2" in capsys.readouterr().err
    assert main(["plan", "--layout", "megatron", "--backend", "ipc"]) == 2
    assert "--backend ipc needs every rank to own every tensor" in capsys.readouterr().err


# --- issue 56: plan refuses the layouts check refuses, by the same rule, in the user's flags -------


@pytest.fixture(scope="module")
def big_configs(tmp_path_factory):
    """Configs with the head / expert counts of the issue's models (tiny widths: plan is meta-only)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    base = tmp_path_factory.mktemp("plan56")
    small = dict(hidden_size=64, head_dim=16, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    moe = Qwen3MoeConfig(num_hidden_layers=8, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=16,
                         intermediate_size=64, num_attention_heads=32, num_key_value_heads=4, **small)
    dense = Qwen3Config(num_hidden_layers=4, intermediate_size=64, num_attention_heads=32, num_key_value_heads=8, **small)
    return {"moe128": _write(base / "moe128", moe), "heads32": _write(base / "heads32", dense)}


@pytest.mark.parametrize("argv, rule", [
    (["--config", "moe128", "--layout", "megatron", "--ep", "3"], "--ep 3 must divide the number of experts (128)"),
    (["--config", "moe128", "--layout", "megatron", "--ep", "3", "--world", "6"],
     "--ep 3 must divide the number of experts (128)"),
    (["--model", "tiny-qwen3-moe", "--layout", "megatron", "--ep", "3"], "--ep 3 must divide the number of experts (4)"),
    (["--config", "heads32", "--layout", "megatron", "--tp", "3"],
     "--tp 3 must divide the attention heads (32) and key/value heads (8)"),
    (["--config", "heads32", "--layout", "megatron", "--tp", "2", "--world", "3"],
     "--world 3 must be a multiple of --tp x --pp x --ep = 2"),
    (["--config", "heads32", "--tp", "2"], "--tp applies to --layout megatron only"),
])
def test_plan_refuses_what_check_refuses_with_the_same_rule(big_configs, capsys, argv, rule):
    from weightsync.plugins.cli import main

    argv = [big_configs.get(a, a) for a in argv]
    t0 = time.perf_counter()
    assert main(["plan", *argv]) == 2
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("weightsync: error: ") and rule in err, err
    assert took < 5, took  # refused from the config's numbers, before the model is built
    # check refuses the same layout with the same rule (its world flag is --nproc)
    check = ["--nproc" if a == "--world" else a for a in argv]
    assert main(["check", *check]) == 2
    assert rule.replace("--world", "--nproc") in capsys.readouterr().err


def test_plan_library_refuses_an_impossible_layout(big_configs):
    with pytest.raises(ValueError, match=r"ep=3 must divide the number of experts \(128\)"):
        plan(big_configs["moe128"], layout="megatron", ep=3, world=6)


def test_plan_says_which_transport_it_assumed_and_one_byte_unit(big_configs, capsys):
    import re

    from weightsync.plugins.cli import main

    assert main(["plan", "--config", big_configs["moe128"], "--layout", "megatron", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "transport:" in x)
    assert "nccl (assumed" in line and "--backend ipc" in line, line
    assert "outside what was measured" in out  # the note that used to say GB beside the table's GiB
    units = set(re.findall(r"\d (B|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB)\b(?!/s)", out))
    assert units and units <= {"B", "KiB", "MiB", "GiB", "TiB"}, units
    assert main(["plan", "--config", big_configs["moe128"], "--backend", "ipc"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "transport:" in x)
    assert line.startswith("  transport: ipc (from --backend)") and "--backend nccl" in line, line
