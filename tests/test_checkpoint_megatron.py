"""Checkpoints written from Megatron-core by ``save_safetensors`` (dense TP2 / PP2 / PP2xVPP2; MoE EP2,
per-expert and fused), read back by ``SafetensorsSource`` through the loopback backend,
and failures injected on rank 1 of a PP2 export.

Oracles nobody here wrote:

* transformers ``save_pretrained`` of the same model, same ``max_shard_size``: file names, the split,
  the index's ``weight_map`` and ``total_size``, names, dtypes, shapes and bytes (dense models are
  imported into Megatron from that very model by the test importer in megatron_worlds.py);
* megatron-core's own resharding: ``dist_checkpointing`` saved at PP2xVPP2 and loaded at TP1 (dense,
  random Megatron init), and the full tensors torch's DCP reader assembles from an EP2 checkpoint
  (MoE), cut under HF names by the documented layout (DESIGN.md section 3);
* transformers ``from_pretrained`` (no missing / unexpected keys, logits) and ``save_pretrained`` of
  what it loaded; its own per-expert -> fused conversion for the fused MoE folder;
* the loopback receiver's SHA-256 of what it loaded (the vLLM ``/weight_checker`` digests).

Two gloo worlds of 2 ranks (dense, MoE), each running many exports; the parent process reads
the folders and asserts. The loopback receiver runs in a process of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import pytest
import torch

import megatron_worlds as mw
from worlds import CONTEXT, errors_of, run_world

pytestmark = pytest.mark.slow

#: Dense shard limit: at hidden 64 it splits a model into ~16 files, and the 250x64 fp32 embedding
#: (64000 bytes) exceeds it, so "a tensor above the limit gets a file of its own" is exercised too.
LIMIT = 60_000
#: MoE shard limit (hidden 16, 4 experts of 12): several shards, experts spread over them.
MOE_LIMIT = 4_000

#: Dense scenarios: family, tied embeddings, tp, pp, vpp, layers.
DENSE = {
    "tp2": ("qwen2", False, 2, 1, None, 4),  # qkv bias; vocab 250 padded to 256: shard 1 holds 122 rows
    "pp2": ("llama", True, 1, 2, None, 4),  # tied embeddings: the last stage's copy is never written
}
VPP = ("qwen3", 1, 2, 2, 4)  # family, tp, pp, vpp, layers: random Megatron init, dcp oracle
MOE = dict(layers=2, experts=4, hidden=16, moe_ffn=12, shared=None)
#: MoE parallel layouts exported in one world of MOE_RANKS ranks. TP2 x EP2 (``dict(tp=2, ep=2,
#: etp=1)``, 4 ranks) passes too, but its world doubles this file's MoE cost on a 2-core box.
MOE_PHASES = {"ep2": dict(ep=2)}
MOE_RANKS = 2
IDS = [[1, 5, 9, 200, 17], [7, 3, 249, 0, 42]]


def _report(r) -> dict:
    return dataclasses.asdict(r)  # SaveReport, picklable without the package's classes


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in mw.chunk_list(model) for n, p in c.named_parameters()}


def _unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for c in mw.chunk_list(model) for n, p in c.named_parameters())


# ---- the dense world ------------------------------------------------------------------------------


def _fail_after_sends(inner):
    """``inner`` whose rank 1 raises once its sends to rank 0 are done: rank 0 then holds every
    tensor when rank 1 fails, so only a cross-rank verdict can stop the rename."""
    from functools import cached_property

    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import WeightSource

    class FailAfterSends(WeightSource):
        @cached_property
        def metadata(self):
            return inner.metadata

        def iter_full(self):
            yield from inner.iter_full()
            if dist.get_rank() == 1:
                raise RuntimeError("injected failure on rank 1 after its sends")

    return FailAfterSends()


class _FailingIsend:
    """``torch.distributed.isend`` that raises on its ``after``-th call (rank 1 mid-export)."""

    def __init__(self, after: int):
        import torch.distributed as dist

        self.real, self.calls, self.after = dist.isend, 0, after

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.after:
            raise RuntimeError(f"injected failure on rank 1 at send {self.calls}")
        return self.real(*a, **k)


def _no_space(fd, offset, length):
    """``os.posix_fallocate`` on a full disk."""
    import errno

    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def _imported(family: str, tied: bool, tp: int, pp: int, layers: int, tmp: str):
    """HF model (seed 0) -> save_pretrained -> this rank's Megatron shards (test importer)."""
    cfg = mw.hf_config(family, tied=tied, layers=layers)
    saved = mw.shared_checkpoint(cfg, f"{tmp}/{family}-hf")
    mw.init_parallel(tp, pp)
    model = mw.megatron_model(cfg)
    mw.import_hf(model, saved, cfg)
    return cfg, model


def _dense_world(rank, world_size, *, tmp, url, port):
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.sources import MegatronSource, SafetensorsSource

    facts: dict = {}

    def save(src, name, **kw):
        kw.setdefault("max_shard_bytes", LIMIT)
        return _report(save_safetensors(src, f"{tmp}/{name}", **kw))

    # -- TP2 (qwen2): fp32 and bf16 wires, a non-empty target, overwrite over a stale shard --------
    family, tied, tp, pp, _, layers = DENSE["tp2"]
    cfg, model = _imported(family, tied, tp, pp, layers, tmp)
    before = _params(model)
    facts["tp2"] = save(MegatronSource(model, hf_config=cfg), "tp2")  # config.json + split order from source.hf_config
    src16 = MegatronSource(model, hf_config=cfg, dtype=torch.bfloat16)
    facts["tp2_bf16"] = save(src16, "tp2_bf16", config=cfg)
    facts["tp2_nonempty"] = errors_of(save, src16, "tp2", config=cfg)  # tp2 holds a checkpoint
    if rank == 0:  # a stale shard of a bigger, older save: overwrite must not leave it behind
        os.makedirs(f"{tmp}/tp2_over")
        torch.save({}, f"{tmp}/tp2_over/model-00001-of-00099.safetensors")
    dist.barrier()
    facts["tp2_over"] = save(src16, "tp2_over", config=cfg, overwrite=True)
    facts["tp2_unchanged"] = _unchanged(model, before)

    # -- PP2 x VPP2 (qwen3, random Megatron init): Megatron's own resharding is the oracle ----------
    family, tp, pp, vpp, layers = VPP
    cfg = mw.hf_config(family, layers=layers)
    mw.init_parallel(tp, pp, vpp, seed=11 + rank)
    model = mw.megatron_model(cfg)
    mw.randomize_norms_and_biases(model)
    facts["vpp"] = save(MegatronSource(model, hf_config=cfg), "vpp", config=cfg)
    os.makedirs(f"{tmp}/vpp-dcp", exist_ok=True)
    mw.dcp_save(model, f"{tmp}/vpp-dcp")
    mw.init_parallel(1, 1, seed=1000 + rank)
    flat = mw.megatron_model(cfg)
    fresh = _params(flat)
    mw.dcp_load(flat, f"{tmp}/vpp-dcp")
    if rank == 0:
        ref = _params(flat)
        facts["vpp_dcp_n"] = len(ref)
        facts["vpp_dcp_loaded"] = sum(not torch.equal(fresh[n], t) for n, t in ref.items())
        # the folder's tensors, written into a TP1 model by the documented layout (test importer),
        # must be exactly what Megatron's resharding put there; vocab padding rows are not exported
        from safetensors.torch import load_file

        folder = {}
        for f in sorted(os.listdir(f"{tmp}/vpp")):
            if f.endswith(".safetensors"):
                folder.update(load_file(f"{tmp}/vpp/{f}"))
        back = mw.megatron_model(cfg)
        mw.import_hf(back, folder, cfg)
        got = _params(back)
        for n in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got[n], ref[n] = got[n][: cfg.vocab_size], ref[n][: cfg.vocab_size]
        facts["vpp_vs_dcp"] = sorted(set(got) ^ set(ref)) + [
            n for n in ref if n in got and not torch.equal(got[n], ref[n])
        ]

    # -- PP2 (llama, tied): export, SafetensorsSource -> loopback, injected failures ------------------
    family, tied, tp, pp, _, layers = DENSE["pp2"]
    cfg, model = _imported(family, tied, tp, pp, layers, tmp)
    before = _params(model)
    facts["pp2"] = save(MegatronSource(model, hf_config=cfg), "pp2")  # config from source.hf_config
    facts["pp2_unchanged"] = _unchanged(model, before)
    reader = SafetensorsSource(f"{tmp}/pp2")
    facts["reader_meta"] = [(m.name, str(m.dtype), tuple(m.shape), m.owners) for m in reader.metadata]
    info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=120)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=ReceiverClient(url), source=reader)
    engine.send_weights()
    facts["loopback_tensors"] = engine.last_send.tensors
    src = MegatronSource(model, hf_config=cfg, timeout_s=20)  # the failures below wait 20 s at most
    # rank 0's disk cannot hold the checkpoint: the writer's up-front reservation fails (ENOSPC)
    real_fallocate = os.posix_fallocate
    if rank == 0:
        os.posix_fallocate = _no_space
    try:
        facts["disk_full"] = errors_of(save, src, "disk_full", config=cfg)
    finally:
        os.posix_fallocate = real_fallocate
    # rank 1 fails after every send completed: rank 0 has all the bytes and must still not commit
    facts["fail_after"] = errors_of(save, _fail_after_sends(src), "fail_after", config=cfg)
    # rank 1 fails at its 3rd send (mid-export); the process group is spent after this: last step
    if rank == 1:
        dist.isend = _FailingIsend(after=3)
    facts["fail_mid"] = errors_of(save, src, "fail_mid", config=cfg)
    if rank == 1:
        facts["fail_mid_sends"] = dist.isend.calls
    return facts


def _receiver(family: str, tied: bool):
    return mw.hf_model(mw.hf_config(family, tied=tied), seed=1)  # differs from the exported weights


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from weightsync.plugins.loopback.receiver import start_receiver_process

    tmp = tmp_path_factory.mktemp("dense")
    family, tied, *_ = DENSE["pp2"]
    client, handle = start_receiver_process(functools.partial(_receiver, family, tied), mp_context=CONTEXT)
    with handle:
        before = client.weight_digests()
        facts = run_world(_dense_world, 2, timeout=500, tmp=str(tmp), url=handle.url, port=0)
        receiver = dict(before=before, after=client.weight_digests(), logits=client.logits(IDS)[0])
    return dict(tmp=tmp, facts=facts, receiver=receiver)


# ---- reading folders (parent side) -----------------------------------------------------------------


def _folder(path) -> dict:
    """Everything a loader sees: shard files with their tensor names, header metadata, index, tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict = {"files": {}, "headers": {}, "tensors": {}, "index": None, "listing": sorted(os.listdir(path))}
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as h:
            out["headers"][f] = h.metadata()
        t = load_file(os.path.join(path, f))
        out["files"][f] = sorted(t)
        out["tensors"].update(t)
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as fh:
            out["index"] = json.load(fh)
    return out


def _diff(got: dict, want: dict, *, values: bool = True, split: bool = True) -> list[str]:
    """What differs between two folders read by ``_folder``: names, dtypes, shapes, (bytes), (the
    split into files and the index's weight_map), total_size."""
    bad = []
    g, w = got["tensors"], want["tensors"]
    bad += [f"missing {n}" for n in sorted(set(w) - set(g))] + [f"extra {n}" for n in sorted(set(g) - set(w))]
    for n in sorted(set(g) & set(w)):
        if g[n].dtype != w[n].dtype or g[n].shape != w[n].shape:
            bad.append(f"{n}: {g[n].dtype} {tuple(g[n].shape)} != {w[n].dtype} {tuple(w[n].shape)}")
        elif values and not torch.equal(g[n], w[n]):
            bad.append(f"{n}: bytes differ")
    if split and got["files"] != want["files"]:
        bad.append(f"split: {got['files']} != {want['files']}")
    if split and (got["index"] or {}).get("weight_map") != (want["index"] or {}).get("weight_map"):
        bad.append("index weight_map differs")
    tot = [(x["index"] or {}).get("metadata", {}).get("total_size") for x in (got, want)]
    if tot[0] != tot[1]:
        bad.append(f"index total_size {tot[0]} != {tot[1]}")
    return bad


def _raw(path) -> dict[str, str]:
    """SHA-256 of the bytes of every shard and of the index (what a checksum of the folder sees)."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            with open(os.path.join(path, f), "rb") as fh:
                out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _save_pretrained(model, path, limit: int) -> dict:
    model.save_pretrained(str(path), max_shard_size=limit)
    return _folder(path)


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    problems = {k: sorted(v) for k, v in info.items() if v}
    return model.eval(), problems


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _check_loadable(folder_path, folder: dict, tmp, limit: int) -> "torch.nn.Module":
    """from_pretrained loads it with nothing missing or unexpected; save_pretrained of what it
    loaded writes the same tensors (names, dtypes, shapes, bytes). Not the same split: transformers
    saves a model it loaded in sorted-name order, a freshly built one in module order."""
    model, problems = _from_pretrained(folder_path)
    assert problems == {}, problems
    resaved = _save_pretrained(model, tmp, limit)
    assert _diff(resaved, folder, split=False) == []
    return model


def _check_report(rep: dict, folder: dict, path) -> None:
    """What save_safetensors reports on rank 0 is what is on disk, and its memory stays within one
    shard plus one tensor (the issue's bound; the writer's own accounting)."""
    assert os.path.realpath(str(rep["path"])) == os.path.realpath(str(path))
    shards = sorted(os.path.basename(str(f)) for f in rep["files"] if str(f).endswith(".safetensors"))
    assert shards == sorted(folder["files"])
    assert rep["num_tensors"] == len(folder["tensors"])
    assert rep["total_size"] == sum(t.numel() * t.element_size() for t in folder["tensors"].values())
    biggest_tensor = max(t.numel() * t.element_size() for t in folder["tensors"].values())
    biggest_shard = max(
        sum(folder["tensors"][n].numel() * folder["tensors"][n].element_size() for n in names)
        for names in folder["files"].values()
    )
    assert 0 <= rep["peak_extra_bytes"] <= biggest_shard + biggest_tensor, (rep["peak_extra_bytes"], biggest_shard)


# ---- dense tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(DENSE))
def test_dense_folder_equals_save_pretrained(dense, scenario, tmp_path):
    """TP2 (qwen2) / PP2 (llama, tied): the folder is save_pretrained's folder of the HF model the
    Megatron weights were imported from -- same files, split, index, names, dtypes, shapes, bytes --
    carries the config, loads with from_pretrained into the same logits, and round-trips through it."""
    family, tied, *_, layers = DENSE[scenario]
    facts, path = dense["facts"], dense["tmp"] / scenario
    cfg = mw.hf_config(family, tied=tied, layers=layers)
    hf = mw.hf_model(cfg, seed=0)
    want = _save_pretrained(hf, tmp_path / "oracle", LIMIT)
    got = _folder(path)
    assert len(want["files"]) > 3  # the limit really splits the model
    assert _diff(got, want) == []
    other = _save_pretrained(mw.hf_model(cfg, seed=1), tmp_path / "other", LIMIT)  # negative control:
    assert len(_diff(got, other)) == len(got["tensors"])  # other weights differ in every tensor
    assert got["listing"] == want["listing"]  # config.json, generation_config.json, index, shards
    assert _raw(path) == _raw(tmp_path / "oracle")  # and every shard and the index byte for byte
    _check_report(facts[0][scenario], got, path)
    assert facts[1][scenario]["path"] == facts[0][scenario]["path"]  # every rank gets the report
    assert facts[0][f"{scenario}_unchanged"] and facts[1][f"{scenario}_unchanged"]
    loaded = _check_loadable(path, got, tmp_path / "resaved", LIMIT)
    assert torch.equal(_logits(loaded), _logits(hf.eval()))
    if tied:
        assert "lm_head.weight" not in got["tensors"]


def test_tp2_bf16_wire_and_overwrite(dense, tmp_path):
    """A bf16 wire writes save_pretrained of the bf16 model; overwrite=True replaces a folder with a
    stale shard in it; a non-empty target without overwrite raises CheckpointError on every rank and
    leaves the folder as it was."""
    family, tied, *_, layers = DENSE["tp2"]
    facts, tmp = dense["facts"], dense["tmp"]
    hf16 = mw.hf_model(mw.hf_config(family, tied=tied, layers=layers), seed=0).to(torch.bfloat16)
    want = _save_pretrained(hf16, tmp_path / "oracle16", LIMIT)
    for name in ("tp2_bf16", "tp2_over"):
        got = _folder(tmp / name)
        assert _diff(got, want) == [], name
        assert _raw(tmp / name) == _raw(tmp_path / "oracle16"), name
        assert "model-00001-of-00099.safetensors" not in got["listing"], name
        _check_report(facts[0][name], got, tmp / name)
    for r in (0, 1):
        err = facts[r]["tp2_nonempty"]
        assert err is not None and err.startswith("CheckpointError"), (r, err)
        assert "tp2" in err and "overwrite" in err, err
    assert all(t.dtype == torch.float32 for t in _folder(tmp / "tp2")["tensors"].values())


def test_vpp_folder_equals_megatron_dist_checkpointing_reshard(dense, tmp_path):
    """PP2 x VPP2 (qwen3, q/k norm, head_dim != hidden/heads) with Megatron's random init: the folder's
    tensors, written into a TP1 GPTModel by the documented QKV/GLU layout, are exactly what
    Megatron's dist_checkpointing resharding (saved at PP2xVPP2, loaded at TP1) put there; names,
    dtypes, shapes and split are save_pretrained's."""
    family, _, _, _, layers = VPP
    facts, path = dense["facts"], dense["tmp"] / "vpp"
    cfg = mw.hf_config(family, layers=layers)
    got = _folder(path)
    want = _save_pretrained(mw.hf_model(cfg), tmp_path / "oracle", LIMIT)
    assert _diff(got, want, values=False) == []
    assert facts[0]["vpp_vs_dcp"] == []
    assert facts[0]["vpp_dcp_loaded"] == facts[0]["vpp_dcp_n"] > 0  # the load replaced every tensor
    _check_report(facts[0]["vpp"], got, path)
    _check_loadable(path, got, tmp_path / "resaved", LIMIT)


def test_safetensors_source_of_megatron_folder_through_loopback(dense):
    """SafetensorsSource(pp2 folder) on both ranks -> vLLM's trainer factory (loopback engine) -> a
    receiver: its SHA-256 per parameter equals the folder's tensors, its logits from_pretrained's."""
    facts, path, rec = dense["facts"], dense["tmp"] / "pp2", dense["receiver"]
    folder = _folder(path)
    want = {n: _sha(t) for n, t in folder["tensors"].items()}
    assert rec["before"] != rec["after"]  # the receiver started from other weights
    assert rec["after"] == want
    assert facts[0]["loopback_tensors"] == len(want)
    meta = facts[0]["reader_meta"]
    assert meta == facts[1]["reader_meta"]
    assert {n: (d.removeprefix("torch."), s) for n, d, s, _ in meta} == {
        n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in folder["tensors"].items()
    }
    assert all(o == (0,) for *_, o in meta)
    model, _ = _from_pretrained(path)
    assert torch.equal(rec["logits"], _logits(model).float())


def test_failure_on_any_rank_leaves_no_folder_and_every_rank_raises(dense):
    """PP2: rank 1 fails after its sends (rank 0 holds every byte) or at its 3rd send (rank 0 waits on
    it), or rank 0's disk is full: no folder under the path, nothing left beside it, both ranks raise
    CheckpointError naming the folder and the cause."""
    facts, tmp = dense["facts"], dense["tmp"]
    for case in ("fail_after", "fail_mid"):
        errs = {r: facts[r][case] for r in (0, 1)}
        assert all(e is not None and e.startswith("CheckpointError") for e in errs.values()), (case, errs)
        assert all(str(tmp / case) in e for e in errs.values()), (case, errs)  # names the folder
        assert "injected failure on rank 1" in errs[1], errs[1]
        assert "rank 1" in errs[0], (case, errs[0])  # rank 0 says who failed (or whom it waited for)
        assert not os.path.exists(tmp / case), case
    assert "injected failure on rank 1 after its sends" in facts[0]["fail_after"]  # quotes rank 1's error
    # a full disk on the writer: both ranks raise before any tensor moves, quoting ENOSPC
    for r in (0, 1):
        err = facts[r]["disk_full"]
        assert err is not None and err.startswith("CheckpointError") and "No space left" in err, (r, err)
    assert not os.path.exists(tmp / "disk_full")
    assert facts[1]["fail_mid_sends"] == 3
    # rank 0 hears rank 1's failure, or gives up after the source's timeout_s (20 s), not a default
    mid = facts[0]["fail_mid"]
    assert "injected failure on rank 1" in mid or "within 20s" in mid, mid
    # nothing else beside them either: no staging folder left behind
    written = {"tp2", "tp2_bf16", "tp2_over", "vpp", "vpp-dcp", "pp2", "qwen2-hf", "llama-hf"}
    assert set(os.listdir(tmp)) == written


# ---- the MoE world --------------------------------------------------------------------------------


def _moe_world(rank, world_size, *, tmp):
    from moe_megatron import build_gpt, init_parallel, megatron_checkpoint, moe_config
    from test_moe_megatron import _hf_config

    from weightsync.plugins.checkpoint import save_safetensors
    from weightsync.sources import MegatronSource

    hf = _hf_config("qwen3_moe", **MOE)
    facts: dict = {}
    for phase, par in MOE_PHASES.items():
        init_parallel(**par)
        model = build_gpt(hf, moe_config(hf, **par))
        os.makedirs(f"{tmp}/{phase}/megatron", exist_ok=True)
        megatron_checkpoint(model, f"{tmp}/{phase}/megatron")
        before = _params(model)
        for layout in ("per_expert", "fused"):
            src = MegatronSource(model, hf_config=hf, expert_layout=layout)
            out = f"{tmp}/{phase}/{layout}"
            facts[phase, layout] = _report(save_safetensors(src, out, max_shard_bytes=MOE_LIMIT, config=hf))
        facts[phase, "unchanged"] = _unchanged(model, before)
    return facts


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from moe_megatron import load_full_checkpoint

    tmp = tmp_path_factory.mktemp("moe")
    facts = run_world(_moe_world, MOE_RANKS, timeout=500, tmp=str(tmp))
    return dict(tmp=tmp, facts=facts, ck={p: load_full_checkpoint(str(tmp / p / "megatron")) for p in MOE_PHASES})


def _expected_moe_model(ck, hf) -> dict[str, torch.Tensor]:
    """Every HF tensor of the MoE model except q/k/v, cut from Megatron's full checkpoint: experts,
    router by test_moe_megatron's oracle; the rest by Megatron's (TE-compatible) checkpoint keys --
    the input norm rides on linear_qkv, the post-attention norm on linear_fc1."""
    from test_moe_megatron import _ck, _expected_moe

    from weightsync.sources.megatron.moe_names import HFMoENames

    layers = range(hf.num_hidden_layers)
    want = _expected_moe(ck, HFMoENames(hf), list(layers))
    # megatron pads the vocabulary rows (make_vocab_size_divisible_by x TP); the checkpoint has hf's
    want["model.embed_tokens.weight"] = ck["embedding.word_embeddings.weight"][: hf.vocab_size]
    want["lm_head.weight"] = ck["output_layer.weight"][: hf.vocab_size]
    want["model.norm.weight"] = ck["decoder.final_layernorm.weight"]
    for i in layers:
        p = f"model.layers.{i}."
        want[p + "input_layernorm.weight"] = _ck(ck, "self_attention.linear_qkv.layer_norm_weight", i)
        want[p + "post_attention_layernorm.weight"] = _ck(ck, "mlp.linear_fc1.layer_norm_weight", i)
        want[p + "self_attn.o_proj.weight"] = _ck(ck, "self_attention.linear_proj.weight", i)
        want[p + "self_attn.q_norm.weight"] = _ck(ck, "self_attention.q_layernorm.weight", i)
        want[p + "self_attn.k_norm.weight"] = _ck(ck, "self_attention.k_layernorm.weight", i)
    return want


@pytest.mark.parametrize("phase", list(MOE_PHASES))
def test_moe_per_expert_folder_equals_megatron_checkpoint(moe, phase, tmp_path):
    """qwen3-MoE at EP2, per-expert: names, dtypes, shapes, the split and the index are
    save_pretrained's for the same config; every tensor is Megatron's own (dist_checkpointing saved
    sharded, assembled full by torch's DCP reader) under its HF name, q/k/v through the per-group
    fused layout; from_pretrained loads it whole and save_pretrained writes the same tensors back."""
    from test_moe_megatron import _ck, _hf_config
    from transformers import AutoModelForCausalLM

    hf = _hf_config("qwen3_moe", **MOE)
    path, ck, facts = moe["tmp"] / phase / "per_expert", moe["ck"][phase], moe["facts"]
    got = _folder(path)
    want = _save_pretrained(AutoModelForCausalLM.from_config(hf), tmp_path / "oracle", MOE_LIMIT)
    assert len(got["files"]) > 2
    assert _diff(got, want, values=False) == []
    g = got["tensors"]
    expected = _expected_moe_model(ck, hf)
    assert len(expected) + 3 * hf.num_hidden_layers == len(g)  # all but q/k/v
    assert [n for n, t in expected.items() if not (g[n].dtype == t.dtype and torch.equal(g[n], t))] == []
    for i in range(hf.num_hidden_layers):
        q, k, v = (g[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv")
        assert torch.equal(mw._fused_qkv_rows(hf, q, k, v), _ck(ck, "self_attention.linear_qkv.weight", i)), i
    assert all(facts[r][phase, "unchanged"] for r in facts)
    assert all(facts[r][phase, "per_expert"]["path"] == str(path) for r in facts)
    _check_report(facts[0][phase, "per_expert"], got, path)
    _check_loadable(path, got, tmp_path / "resaved", MOE_LIMIT)


@pytest.mark.parametrize("phase", list(MOE_PHASES))
def test_moe_fused_folder_is_the_refusion_of_per_expert(moe, phase):
    """Fused: transformers' in-memory names and shapes ([E, 2I, H] gate first, [E, H, I]), claimed by
    vLLM's routed-expert mapping (gate_up = shards w1, w3; down = w2); each fused tensor is the
    stack of the Megatron-checkpoint oracle's per-expert tensors by that layout, every other tensor
    equals the per-expert folder's; from_pretrained of it equals from_pretrained of the per-expert
    folder (transformers' own per-expert -> fused conversion)."""
    from test_moe_megatron import _hf_config
    from transformers import AutoModelForCausalLM
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from weightsync.sources.megatron.moe_names import HFMoENames

    hf = _hf_config("qwen3_moe", **MOE)
    tmp = moe["tmp"] / phase
    fused, per = _folder(tmp / "fused"), _folder(tmp / "per_expert")
    f, p = fused["tensors"], per["tensors"]
    memory = {n: (t.dtype, tuple(t.shape)) for n, t in AutoModelForCausalLM.from_config(hf).state_dict().items()}
    assert {n: (t.dtype, tuple(t.shape)) for n, t in f.items()} == memory
    expected = _expected_moe_model(moe["ck"][phase], hf)
    E = hf.num_experts
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", E, include_fused=True)
    for i in range(hf.num_hidden_layers):
        spec = HFMoENames(hf).layer(i).experts
        piece = lambda e, kind: expected[spec.expert_name(e, kind)]  # noqa: E731
        gate_up = torch.stack([torch.cat([piece(e, "gate"), piece(e, "up")]) for e in range(E)])
        down = torch.stack([piece(e, "down") for e in range(E)])
        assert torch.equal(f[spec.fused_gate_up], gate_up) and torch.equal(f[spec.fused_down], down), i
        for name, shards in ((spec.fused_gate_up, [(0, "w1"), (1, "w3")]), (spec.fused_down, [(0, "w2")])):
            hits = [(e, sid) for _, w, e, sid in mapping if w in name and "." not in w.split("experts.", 1)[1]]
            assert hits == shards, (name, hits)
    rest = [n for n in f if ".experts." not in n]
    assert sorted(rest) == sorted(n for n in p if ".experts." not in n)
    assert [n for n in rest if not torch.equal(f[n], p[n])] == []
    _check_report(moe["facts"][0][phase, "fused"], fused, tmp / "fused")
    a, problems_a = _from_pretrained(tmp / "fused")
    b, problems_b = _from_pretrained(tmp / "per_expert")
    assert problems_a == {} and problems_b == {}
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and [n for n in sa if not torch.equal(sa[n], sb[n])] == []
