"""The hooks' adapter-only option (issue 43): ``adapter_only=`` on the HF Trainer / TRL callback and
the Lightning callback, ``source_from_accelerator(..., adapter_only=True)``.

One 2-rank gloo world (``world_hooks``): a real ``transformers.Trainer`` run (accelerate FSDP2 on
CPU, a PEFT LoRA Qwen3) with two callbacks -- the HF callback given a full ``WeightSync`` factory
plus ``adapter_only=`` (every=2 from the ``WeightSync``), and one whose factory returns a
``LoRAAdapterSync`` over ``source_from_accelerator(..., adapter_only=True)`` (every=3) -- then a
real Lightning run (DDP) whose callback gets ``adapter_only=``. Rank 0's control plane is a stand-in
that loads each adapter folder with PEFT itself (``PeftModel.from_pretrained`` on the base model):
its logits must equal the trainer's own (sharded) forward at the step the sync ran. Also on both
ranks: the option on a model without a LoRA adapter raises, naming the hook and the rank.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fsdp_worlds import pack, tiny_model, unpack
from worlds import errors_of, run_world

pytestmark = pytest.mark.slow

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = [[3, 14, 15, 9, 2, 6, 5, 35], [8, 9, 7, 9, 3, 2, 38, 4]]


def _peft(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model("qwen3", tied=False, seed=seed),
                          LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))


class PeftLoader:
    """Rank 0's control plane: ``load_lora_adapter`` loads the folder with PEFT onto the seed-0 base
    model and keeps its logits on ``IDS`` per (name, load); every call is recorded. The weight-transfer
    methods a ``WeightSync`` needs exist so it can be built, and must never be called."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.loads: list[tuple[str, list[list[float]]]] = []

    def server_info(self) -> dict[str, Any]:
        self.calls.append(("server_info",))
        lora = {"max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 2, "lora_dtype": "torch.float32"}
        return {"http://peft": {"vllm_config": {"lora_config": lora, "model_config": {"model": ""}}}}

    def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        from peft import PeftModel

        self.calls.append(("load", name))
        with torch.no_grad():
            m = PeftModel.from_pretrained(tiny_model("qwen3", tied=False, seed=0), path).eval()
            self.loads.append((name, m(input_ids=torch.tensor(IDS)).logits.tolist()))

    def __getattr__(self, name: str) -> Any:  # pause, resume, update_weight_version, and the 4 transfer calls
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append((name, *a))


def world_hooks(rank: int, world_size: int, *, out: str) -> bytes:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("peft").setLevel(logging.ERROR)
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import json_engine  # noqa: F401 - registers the test_json backend
    from json_engine import JSONTrainerInitInfo
    from test_hooks import _accelerate_fsdp_on_cpu
    from vllm.distributed.weight_transfer.base import ModuleSource

    from weightsync.plugins import LoRAAdapterSync, WeightSync
    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.lightning import WeightSyncCallback as PLCallback
    from weightsync.plugins.transformers import WeightSyncCallback

    client = PeftLoader()  # every rank builds the syncs with one; only rank 0's may be called
    adir = os.path.join(out, "adapters")
    info = JSONTrainerInitInfo(rank=rank)
    f: dict[str, Any] = {}

    # -- bad adapter_only values: at the hooks' construction --------------------------------------
    def never(model):
        raise AssertionError("not called")

    e: dict[str, Any] = {}
    for hook, cls in (("hf", WeightSyncCallback), ("pl", PLCallback)):
        for key, value in (("True", True), ("no dir", {"lora_name": "x"}), ("int", 3),
                           ("typo", {"adapter_dir": adir, "lora_nmae": "x"})):
            e[f"{hook} {key}"] = errors_of(cls, never, adapter_only=value)
    ready = LoRAAdapterSync(_peft(), client, adapter_dir=adir, every=4)
    e["ready + option"] = errors_of(WeightSyncCallback, ready, adapter_only=adir)
    e["factory ready + option"] = errors_of(
        PLCallback(lambda m: ready, adapter_only=adir).on_train_start, SimpleNamespace(global_step=0), None)
    e["ready taken"] = (WeightSyncCallback(ready).sync is ready, ready.should_sync(4), ready.should_sync(3))
    f["arg_errors"] = e

    # -- HF Trainer, accelerate FSDP2: two callbacks, one Trainer run --------------------------------
    class Tokens(Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 127, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    _accelerate_fsdp_on_cpu()
    args = TrainingArguments(
        output_dir=os.path.join(out, "hf"), per_device_train_batch_size=2, max_steps=3, learning_rate=5e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]},
    )
    trainer = Trainer(model=_peft(), args=args, train_dataset=Tokens())

    def full_sync(model):  # the user's merged (full) sync, as the README builds it
        f["hf_sharded"] = sorted({type(p).__name__ for p in model.parameters()})
        return WeightSync(source_from_accelerator(trainer.accelerator, model), info, client, every=2)

    hf = WeightSyncCallback(full_sync, trainer=trainer, adapter_only={"adapter_dir": adir, "lora_name": "hf"})
    acc = WeightSyncCallback(
        lambda model: LoRAAdapterSync(source_from_accelerator(trainer.accelerator, model, adapter_only=True), client,
                                      lora_name="acc", adapter_dir=adir, every=3, pause=None),
        trainer=trainer,
    )
    f["trainer_logits"] = {}

    class Probe(TrainerCallback):
        """After the syncs of a step: the trainer's own (FSDP2) logits, on every rank."""

        def _probe(self, state, model):
            if any(cb.sync.last_report and cb.sync.last_report.step == state.global_step for cb in (hf, acc)):
                was = model.training
                model.eval()
                with torch.no_grad():
                    f["trainer_logits"][state.global_step] = model(input_ids=torch.tensor(IDS)).logits.tolist()
                model.train(was)
                model.reshard()

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._probe(state, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            self._probe(state, model)

    for cb in (hf, acc, Probe()):
        trainer.add_callback(cb)
    trainer.train()
    f["hf_sync"] = (type(hf.sync).__name__, hf.sync.every, hf.sync.pause_mode)
    f["hf_steps"] = [e["step"] for e in trainer.state.log_history if "weightsync/bytes" in e]
    f["hf_bytes"] = sorted({e["weightsync/bytes"] for e in trainer.state.log_history if "weightsync/bytes" in e})
    f["adapter_bytes"] = hf.sync.source.nbytes
    f["reports"] = {"hf": [(r.step, r.weight_version) for r in [hf.sync.last_report]],
                    "acc": [(r.step, r.weight_version) for r in [acc.sync.last_report]]}
    f["hf_calls"] = [c for c in client.calls]
    f["hf_loads"] = list(client.loads)
    f["folders"] = {n: sorted(os.listdir(os.path.join(adir, n))) for n in ("hf", "acc")} if rank == 0 else None

    # -- the option on a model without a LoRA adapter: every rank, naming the hook and the rank ------
    plain = tiny_model("qwen3", tied=False, seed=0)
    state = SimpleNamespace(global_step=0, log_history=[], epoch=None)
    f["no_lora_hf"] = errors_of(WeightSyncCallback(lambda m: WeightSync(ModuleSource(m), info, client),
                                                   adapter_only=adir).on_train_begin, None, state, None, model=plain)
    f["no_lora_acc"] = errors_of(source_from_accelerator, trainer.accelerator, plain, adapter_only=True)
    holder = torch.nn.Module()
    holder.model = plain
    f["no_lora_pl"] = errors_of(PLCallback(lambda m: WeightSync(ModuleSource(m.model), info, client),
                                           adapter_only=adir).on_train_start, SimpleNamespace(global_step=0), holder)

    # -- Lightning, DDP: the callback with adapter_only= ----------------------------------------------
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class LitPeft(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _peft()

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    client.calls.clear()
    client.loads.clear()
    f["pl_logits"] = {}
    plcb = PLCallback(lambda m: WeightSync(ModuleSource(m.model), info, client, every=2, pause="wait"),
                      adapter_only={"adapter_dir": adir, "lora_name": "pl"})

    class PLProbe(pl.Callback):
        def _probe(self, trainer, module):
            rep = plcb.sync.last_report
            if rep is not None and rep.step == trainer.global_step and rep.step not in f["pl_logits"]:
                with torch.no_grad():
                    f["pl_logits"][rep.step] = module.model.eval()(input_ids=torch.tensor(IDS)).logits.tolist()
                module.model.train()

        def on_train_start(self, trainer, module):
            self._probe(trainer, module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self._probe(trainer, module)

    plt = pl.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=os.path.join(out, "pl"), callbacks=[plcb, PLProbe()])
    plt.fit(LitPeft(), DataLoader(Tokens(), batch_size=2))
    f["pl_steps"] = [r.step for r in plcb.reports]
    f["pl_sync"] = (type(plcb.sync).__name__, plcb.sync.every, plcb.sync.pause_mode)
    f["pl_calls"] = list(client.calls)
    f["pl_loads"] = list(client.loads)
    return pack(f)


@pytest.fixture(scope="module")
def hooks_world():
    out = tempfile.mkdtemp(prefix="ws-lora-hooks-")
    try:
        yield unpack(run_world(world_hooks, 2, timeout=300, out=out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_hf_callback_and_accelerate_adapter_only(hooks_world):
    for rank, f in hooks_world.items():
        # the option turned the WeightSync into an adapter-only sync with its cadence and pause mode
        assert f["hf_sync"] == ("LoRAAdapterSync", 2, "keep")
        assert f["hf_sharded"] == ["DTensor"]  # accelerate's FSDP2 shards: the adapter gathered from them
        # every=2 (hf): 0, 2 and the final step 3 at train end; every=3 (acc): 0, 3 (its last sync
        # already the final step's) -- in the Trainer's log history, on every rank
        assert sorted(f["hf_steps"]) == [0, 0, 2, 3, 3], f["hf_steps"]
        # the logged bytes are the adapter's: r=4 x (in + out) of 7 projections (512) x 2 layers, fp32
        assert f["hf_bytes"] == [f["adapter_bytes"]] == [4 * 512 * 2 * 4]
        assert f["reports"] == {"hf": [(3, "3")], "acc": [(3, "3")]}
        if rank != 0:
            assert f["hf_calls"] == [] and f["pl_calls"] == []  # only rank 0 talks to the server
    f0 = hooks_world[0]
    calls = [c[0] for c in f0["hf_calls"]]
    # rank 0 talked LoRA only: never the weight-transfer engine of the WeightSync it was given
    assert not {"init_weight_transfer_engine", "start_weight_update", "update_weights",
                "finish_weight_update"} & set(calls), calls
    assert [c for c in f0["hf_calls"] if c[0] == "load"] == [("load", "hf"), ("load", "acc"), ("load", "hf"),
                                                             ("load", "acc"), ("load", "hf")]
    assert calls.count("pause") == calls.count("resume") == 3  # hf: pause "keep"; acc: pause=None
    assert [c[1] for c in f0["hf_calls"] if c[0] == "update_weight_version"] == ["0", "0", "2", "3", "3"]
    # step 0: hf (limits, pause, load, commit, resume), then acc (limits, load, commit: no pause)
    assert calls[:8] == ["server_info", "pause", "load", "update_weight_version", "resume",
                         "server_info", "load", "update_weight_version"], calls
    steps = {"hf": [0, 2, 3], "acc": [0, 3]}
    for name, want_steps in steps.items():
        loaded = [lg for n, lg in f0["hf_loads"] if n == name]
        assert len(loaded) == len(want_steps)
        for step, logits in zip(want_steps, loaded):
            _close(logits, f0["trainer_logits"][step])  # PEFT's load of the folder == the trainer's forward
        assert not torch.allclose(torch.tensor(loaded[0]), torch.tensor(loaded[1]))  # it trained
        assert len(f0["folders"][name]) == 1  # the previous version's folder removed


def test_lightning_callback_adapter_only(hooks_world):
    for rank, f in hooks_world.items():
        assert f["pl_sync"] == ("LoRAAdapterSync", 2, "wait")
        assert f["pl_steps"] == [0, 2]
    f0 = hooks_world[0]
    assert [c for c in f0["pl_calls"] if c[0] == "load"] == [("load", "pl")] * 2
    assert not any(c[0].endswith("weight_update") or c[0] == "update_weights" for c in f0["pl_calls"])
    for step, (_, logits) in zip((0, 2), f0["pl_loads"]):
        _close(logits, f0["pl_logits"][step])
    assert not torch.allclose(torch.tensor(f0["pl_loads"][0][1]), torch.tensor(f0["pl_loads"][1][1]))


def test_option_on_a_model_without_lora_raises_on_every_rank(hooks_world):
    for rank, f in hooks_world.items():
        for key, who in (("no_lora_hf", "WeightSyncCallback(adapter_only=...)"),
                         ("no_lora_pl", "WeightSyncCallback(adapter_only=...)"),
                         ("no_lora_acc", "source_from_accelerator(adapter_only=True)")):
            msg = f[key]
            assert msg is not None and msg.startswith("UnsupportedAdapterError"), (key, msg)
            assert who in msg and f"rank {rank}" in msg and "holds no PEFT adapter" in msg, (key, msg)
            assert "drop it to send the whole (merged) model" in msg, (key, msg)


def test_adapter_only_argument_errors_before_training(hooks_world):
    """Bad ``adapter_only`` values fail at the hook's construction, before any training step."""
    for rank, f in hooks_world.items():
        e = f["arg_errors"]
        for hook in ("hf", "pl"):
            assert "adapter_only=True needs the folder the vLLM server reads" in e[f"{hook} True"], e
            assert "must hold adapter_dir" in e[f"{hook} no dir"], e
            assert "key(s) ['lora_nmae'] that LoRAAdapterSync does not take" in e[f"{hook} typo"], e
            assert "adapter_only must be a folder path or a dict" in e[f"{hook} int"], e
            assert all(e[f"{hook} {k}"].startswith(("ValueError", "TypeError")) for k in ("True", "no dir", "typo", "int"))
        assert "sync is a LoRAAdapterSync (adapter-only already); drop adapter_only=" in e["ready + option"], e
        assert "the sync factory returned a LoRAAdapterSync" in e["factory ready + option"], e
        assert e["ready taken"] == (True, True, False)  # taken as is, its own every=4 schedule
