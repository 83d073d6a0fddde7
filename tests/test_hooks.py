"""Training-loop hooks, each in a real loop on CPU: HF ``Trainer`` (2 ranks, accelerate FSDP2),
Lightning, and a Megatron-core training loop.

Receiver and oracle: weights arrive at the recording dev-route server in the parent (``test_json``
engine); the parent loads each committed version into a fresh transformers model built from the
same config (``load_state_dict(strict=True)``: names and shapes must be the checkpoint's) and its
logits must equal the logits the trainer's own (sharded) model produced right after that sync.
"""

from __future__ import annotations

import pytest
import torch

from vllm_devserver import DevServer
from worlds import run_world

pytestmark = pytest.mark.slow

_CFG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
_PROBE = [[3, 14, 15, 9, 2, 6, 5, 35], [8, 9, 7, 9, 3, 2, 38, 4]]


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_CFG))


def _receiver_logits(weights: dict) -> torch.Tensor:
    model = _llama(seed=123)  # different init: every value must come from the sync
    model.load_state_dict(weights, strict=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(_PROBE)).logits


# ---- HF Trainer + accelerate FSDP2 -----------------------------------------------------------------


def _accelerate_fsdp_on_cpu() -> None:
    """accelerate only turns its FSDP plugin on for accelerator device types (``MULTI_CPU`` never
    becomes ``FSDP``), although FSDP2 ``fully_shard`` itself works on CPU meshes over gloo. Let the
    Trainer's Accelerator take the FSDP path on CPU: test-only, everything after it is accelerate's
    own FSDP2 preparation."""
    import transformers.trainer as hf_trainer
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    class CPUFSDPAccelerator(Accelerator):
        def __init__(self, *a, fsdp_plugin=None, **kw):
            super().__init__(*a, fsdp_plugin=fsdp_plugin, **kw)
            if fsdp_plugin is not None:
                self.state.distributed_type = DistributedType.FSDP
                self.state.fsdp_plugin = fsdp_plugin

    hf_trainer.Accelerator = CPUFSDPAccelerator



def _hf_trainer_world(rank: int, world_size: int, url: str, out_dir: str) -> dict:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.driver import WeightSync
    from weightsync.plugins.http import VLLMHTTPClient
    from weightsync.plugins.transformers import WeightSyncCallback

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, _CFG["vocab_size"], (8,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
        learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=0,
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    _accelerate_fsdp_on_cpu()
    trainer = Trainer(model=_llama(), args=args, train_dataset=Tokens())
    seen: dict = {"logits": {}, "sharded": None, "dtype": None}

    def build(model):
        source = source_from_accelerator(trainer.accelerator, model)
        seen["sharded"] = type(model).__name__.startswith("FSDP") and all(
            type(p).__name__ == "DTensor" for p in model.parameters()
        )
        seen["dtype"] = str(source.wire.dtype) if hasattr(source, "wire") else None
        return WeightSync(source, JSONTrainerInitInfo(rank=rank, chunk=8), VLLMHTTPClient(url), every=2)

    sync_cb = WeightSyncCallback(build, trainer=trainer)

    class Probe(TrainerCallback):
        """After each sync: the trainer's own logits on the probe batch (an FSDP2 forward)."""

        def _probe(self, state, model):
            report = sync_cb.sync.last_report
            if report is None or report.step != state.global_step or report.weight_version in seen["logits"]:
                return
            was = model.training
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(_PROBE)).logits
            model.train(was)
            seen["logits"][report.weight_version] = logits.tolist()

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._probe(state, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            self._probe(state, model)

    trainer.add_callback(sync_cb)
    trainer.add_callback(Probe())
    trainer.train()
    logged = [
        {k: v for k, v in e.items() if k.startswith("weightsync/") or k == "step"}
        for e in trainer.state.log_history
        if "weightsync/bytes" in e
    ]
    return {
        "logits": seen["logits"] if rank == 0 else None,
        "sharded": seen["sharded"],
        "logged": logged,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def test_hf_trainer_fsdp2_callback(tmp_path):
    with DevServer() as server:
        out = run_world(_hf_trainer_world, 2, timeout=400, url=server.url, out_dir=str(tmp_path))
        snapshots = dict(server.snapshots)
        routes = server.routes()
    r0, r1 = out[0], out[1]
    assert r0["sharded"] and r1["sharded"]  # accelerate's FSDP2: every parameter a DTensor shard
    # cold sync at step 0, then every 2 optimizer steps (gradient accumulation 2: 10 micro-batches)
    assert sorted(snapshots, key=int) == ["0", "2", "4"]
    assert routes.count("pause") == routes.count("resume") == 3
    assert [e["step"] for e in r0["logged"]] == [e["step"] for e in r1["logged"]] == [0, 2, 4]
    n_params = sum(p.numel() for p in _llama().parameters())
    assert all(e["weightsync/bytes"] == 4 * n_params for e in r0["logged"])
    assert len(set(map(tuple, [r0["losses"]]))) == 1 and r0["losses"][0] != r0["losses"][-1]  # it trained
    previous = None
    for version in ("0", "2", "4"):
        want = torch.tensor(r0["logits"][version])
        got = _receiver_logits(snapshots[version])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"logits after sync {version}")
        if previous is not None:
            assert not torch.allclose(got, previous)  # the weights did change between syncs
        previous = got


# ---- Lightning (DDP, 2 ranks) --------------------------------------------------------------------


def _lightning_world(rank: int, world_size: int, url: str, out_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from vllm.distributed.weight_transfer.base import ModuleSource

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.driver import WeightSync
    from weightsync.plugins.http import VLLMHTTPClient
    from weightsync.plugins.lightning import WeightSyncCallback

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g))
    seen: dict = {}

    cb = WeightSyncCallback(
        lambda m: WeightSync(ModuleSource(m.net), JSONTrainerInitInfo(rank=rank), VLLMHTTPClient(url), every=2)
    )

    class Probe(pl.Callback):
        def _probe(self, module):
            rep = cb.sync.last_report
            if rep is not None and rep.weight_version not in seen:
                seen[rep.weight_version] = {k: v.detach().tolist() for k, v in module.net.named_parameters()}

        def on_train_start(self, trainer, module):
            self._probe(module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self._probe(module)

    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=6, accumulate_grad_batches=2,
        logger=pl.loggers.CSVLogger(out_dir), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, callbacks=[cb, Probe()],
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=4))
    return {
        "steps": [r.step for r in cb.reports],
        "params": seen if rank == 0 else None,
        "global_step": trainer.global_step,
    }


def test_lightning_callback_ddp(tmp_path):
    with DevServer() as server:
        out = run_world(_lightning_world, 2, timeout=300, url=server.url, out_dir=str(tmp_path))
        snapshots = dict(server.snapshots)
    assert out[0]["global_step"] == 6
    # cold sync, then every 2 optimizer steps (accumulate_grad_batches=2: 12 batches per rank)
    assert out[0]["steps"] == out[1]["steps"] == [0, 2, 4, 6]
    assert sorted(snapshots, key=int) == ["0", "2", "4", "6"]
    for version, params in out[0]["params"].items():
        assert set(snapshots[version]) == set(params)
        for k, v in params.items():
            torch.testing.assert_close(snapshots[version][k], torch.tensor(v), rtol=0, atol=0)
    assert not torch.equal(snapshots["0"]["0.weight"], snapshots["6"]["0.weight"])  # it trained
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "weightsync/bytes" in metrics and "weightsync/send_seconds" in metrics


# ---- Megatron-core loop (PP=2 x VPP=2 on 2 ranks) ---------------------------------------------------


def _megatron_world(rank: int, world_size: int, url: str) -> dict:
    import megatron_worlds as mw

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.http import VLLMHTTPClient
    from weightsync.plugins.megatron import MegatronWeightSync

    cfg = mw.hf_config("llama", layers=8)
    mw.init_parallel(1, 2, 2)
    chunks = mw.megatron_model(cfg)
    assert isinstance(chunks, list) and len(chunks) == 2
    hook = MegatronWeightSync(chunks, JSONTrainerInitInfo(rank=rank, chunk=16), VLLMHTTPClient(url),
                              hf_config=cfg, every=1, pause="abort")
    synced = []
    for iteration in range(4):
        # the "optimizer step": this iteration's weights, written by the test-only HF importer
        mw.import_hf(chunks, mw.hf_model(cfg, seed=iteration).state_dict(), cfg)
        if iteration == 0:
            rep = hook.sync_now(0)  # cold sync before the first step
        else:
            rep = hook(iteration, update_successful=iteration != 2)  # iteration 2: skipped update
        synced.append(None if rep is None else rep.weight_version)
    again = hook(3)  # the same iteration twice: nothing is sent twice
    hook.shutdown()
    return {"synced": synced, "again": again}


def test_megatron_hook_pp_vpp():
    import megatron_worlds as mw

    with DevServer() as server:
        out = run_world(_megatron_world, 2, timeout=300, url=server.url)
        snapshots = dict(server.snapshots)
        routes = server.routes()
    assert out[0]["synced"] == out[1]["synced"] == ["0", "1", None, "3"]
    assert out[0]["again"] is None
    assert sorted(snapshots, key=int) == ["0", "1", "3"] and routes.count("pause") == 3
    cfg = mw.hf_config("llama", layers=8)
    for version, got in snapshots.items():
        want = mw.hf_model(cfg, seed=int(version)).state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"{version}/{k}")
