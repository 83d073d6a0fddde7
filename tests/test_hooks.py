"""Training-loop hooks, each in a real loop on CPU: HF ``Trainer`` (2 ranks, accelerate FSDP2),
Lightning, and a Megatron-core training loop.

HF Trainer: weights go through weightsync's ``loopback`` backend (vLLM's trainer factory, the
4-phase protocol over gloo) into a ``LoopbackReceiver`` process; after each sync the receiver's
logits on a probe batch must equal, bit for bit, the logits of the trainer's own FSDP2 model.

Lightning and Megatron: weights arrive at the recording dev-route server in the parent (``test_json``
engine) and each committed version is compared with what the trainer held at that step.
"""

from __future__ import annotations

import pytest
import torch

from vllm_devserver import DevServer
from worlds import CONTEXT, run_world

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



def _trainer_args(out_dir: str, max_steps: int):
    """accelerate FSDP2 (on CPU through ``_accelerate_fsdp_on_cpu``), logging every optimizer step."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=0,
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )


def _hf_trainer_world(rank: int, world_size: int, url: str, port: int, out_dir: str, json_url: str = "") -> dict:
    """A real ``Trainer.train()`` (accelerate FSDP2, 2 CPU ranks) whose ``WeightSyncCallback`` syncs
    through weightsync's ``loopback`` backend into the receiver process at ``url``. After each sync
    every rank runs the trainer's own (sharded) forward on the probe batch and rank 0 asks the
    receiver for its forward on the same batch; both come back for the parent to compare."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback

    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.loopback.receiver import ReceiverClient
    from weightsync.plugins.transformers import WeightSyncCallback

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, _CFG["vocab_size"], (8,), generator=g)
            return {"input_ids": ids, "labels": ids.clone()}

    args = _trainer_args(out_dir, max_steps=5)
    _accelerate_fsdp_on_cpu()
    trainer = Trainer(model=_llama(), args=args, train_dataset=Tokens())
    seen: dict = {"trainer": {}, "receiver": {}, "receiver_version": {}, "sharded": None, "engine": None}
    receiver = ReceiverClient(url) if rank == 0 else None

    def build(model):
        source = source_from_accelerator(trainer.accelerator, model)
        seen["sharded"] = type(model).__name__.startswith("FSDP") and all(
            type(p).__name__ == "DTensor" for p in model.parameters()
        )
        # 1 sender (trainer rank 0) + 1 receiver process in the loopback transport group.
        info = LoopbackTrainerInitInfo("127.0.0.1", port, 2, rank=rank, timeout_s=120)
        return WeightSync(source, info, VLLMHTTPClient(url), every=2)

    sync_cb = WeightSyncCallback(build, trainer=trainer)

    class Probe(TrainerCallback):
        """After each sync: the trainer's own logits on the probe batch (an FSDP2 forward, on every
        rank: it all-gathers) and, on rank 0, the receiver's logits on the same batch."""

        def _probe(self, state, model):
            report = sync_cb.sync.last_report
            if report is None or report.step != state.global_step or report.weight_version in seen["trainer"]:
                return
            seen["engine"] = type(sync_cb.sync.engine).__name__
            was = model.training
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(_PROBE)).logits
            model.train(was)
            seen["trainer"][report.weight_version] = logits.tolist()
            if receiver is not None:
                got, _ = receiver.logits(_PROBE)
                seen["receiver"][report.weight_version] = got.tolist()
                seen["receiver_version"][report.weight_version] = receiver.weight_version()

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._probe(state, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            self._probe(state, model)

        def on_train_end(self, args, state, control, model=None, **kw):  # after the final sync
            self._probe(state, model)

    trainer.add_callback(sync_cb)
    trainer.add_callback(Probe())
    trainer.train()
    log_runs = _hf_log_runs(rank, out_dir, json_url) if json_url else None
    logged = [
        {k: v for k, v in e.items() if k.startswith("weightsync/") or k == "step"}
        for e in trainer.state.log_history
        if "weightsync/bytes" in e
    ]
    return {
        "trainer_logits": seen["trainer"],
        "receiver_logits": seen["receiver"] if rank == 0 else None,
        "receiver_version": seen["receiver_version"] if rank == 0 else None,
        "sharded": seen["sharded"],
        "engine": seen["engine"],
        "logged": logged,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "loss_steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
        "log_runs": log_runs,
    }


def _hf_log_runs(rank: int, out_dir: str, url: str) -> dict:
    """The Trainer's own logs stay intact around the syncs: ``logging_steps=1`` with ``every=1`` and
    ``every=2``, in a Trainer whose ``log()`` flushes pending metrics of its own into its next entry
    (TRL's ``GRPOTrainer`` pattern: ``reward`` here, the step's value). Returns, per ``every``, the
    ``state.log_history`` and what every callback's ``on_log`` received (the ``report_to``
    integrations' view)."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.plugins.transformers import WeightSyncCallback

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, _CFG["vocab_size"], (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    class GRPOLike(Trainer):
        """Keeps per-step metrics and merges them into the next ``log()`` call, then clears them."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.pending: list[float] = []

        def training_step(self, *a, **kw):
            self.pending.append(float(self.state.global_step + 1))  # the optimizer step being trained
            return super().training_step(*a, **kw)

        def log(self, logs, start_time=None):
            if self.pending:
                logs = {**logs, "reward": sum(self.pending) / len(self.pending)}
                self.pending.clear()
            super().log(logs, start_time)

    out: dict = {}
    for every in (1, 2):
        trainer = GRPOLike(model=_llama(), args=_trainer_args(out_dir, max_steps=4), train_dataset=Tokens())
        seen: list[dict] = []

        class Recorder(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                seen.append({**logs, "at": state.global_step})

        def build(model, every=every, trainer=trainer):
            source = source_from_accelerator(trainer.accelerator, model)
            return WeightSync(source, JSONTrainerInitInfo(rank=rank), VLLMHTTPClient(url), every=every)

        trainer.add_callback(WeightSyncCallback(build, trainer=trainer))
        trainer.add_callback(Recorder())
        trainer.train()
        out[every] = {"history": list(trainer.state.log_history), "on_log": seen}
    return out


def test_hf_trainer_fsdp2_callback(tmp_path):
    """Issue: a real ``transformers.Trainer`` run, 2 ranks on CPU, accelerate FSDP2, callback syncing
    to loopback; the receiver's logits equal the trainer's after each sync."""
    import functools


    from weightsync.plugins.loopback.receiver import start_receiver_process

    # The receiver starts from another init (seed 123): every value it ends with came over the wire.
    client, handle = start_receiver_process(functools.partial(_llama, 123), mp_context=CONTEXT)
    with handle, DevServer() as server:
        before, _ = client.logits(_PROBE)
        out = run_world(
            _hf_trainer_world, 2, timeout=400, url=handle.url, port=0, out_dir=str(tmp_path),
            json_url=server.url,
        )
        calls = [c["path"] for c in client.calls()]
        state = client.state()
    r0, r1 = out[0], out[1]
    assert r0["sharded"] and r1["sharded"]  # accelerate's FSDP2: every parameter a DTensor shard
    assert r0["engine"] == r1["engine"] == "LoopbackTrainerWeightTransferEngine"
    # cold sync at step 0, then every 2 optimizer steps (gradient accumulation 2: 10 micro-batches),
    # then the final sync at train end: step 5 is not a multiple of 2, and the served model must end
    # on the trained weights (issue 56)
    assert [e["step"] for e in r0["logged"]] == [e["step"] for e in r1["logged"]] == [0, 2, 4, 5]
    n_params = sum(p.numel() for p in _llama().parameters())
    assert all(e["weightsync/bytes"] == 4 * n_params for e in r0["logged"])  # fp32 on the wire
    assert sorted(r0["trainer_logits"], key=int) == sorted(r1["trainer_logits"], key=int) == ["0", "2", "4", "5"]
    assert r0["losses"][0] != r0["losses"][-1]  # it trained
    # logging_steps=1: the Trainer's own loss line for every step, once, the sync steps included
    assert r0["loss_steps"] == r1["loss_steps"] == [1, 2, 3, 4, 5]
    _assert_logs_intact(out)
    # What the receiver saw, in order: the engine's init (built at the first sync), then per sync
    # pause / the 4-phase update / resume. (/weight_info: the probe's own version reads, dropped.)
    one = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
    # the world size checked against the receiver's workers before the init, then four syncs
    assert [c for c in calls if c != "/weight_info"] == ["/get_world_size", "/init_weight_transfer_engine"] + one * 4, calls
    assert state["weight_version"] == "5" and state["updates_finished"] == 4
    previous = before
    for version in ("0", "2", "4", "5"):
        # Each sync committed its step as the weight version before the probe ran.
        assert r0["receiver_version"][version] == version
        want = torch.tensor(r0["trainer_logits"][version])
        got = torch.tensor(r0["receiver_logits"][version])
        # Same fp32 bytes, same CPU kernels, one thread on both sides: bit-for-bit equal.
        assert torch.equal(got, want), (version, float((got - want).abs().max()))
        assert not torch.allclose(got, previous)  # the receiver's weights did change at this sync
        previous = got


def _assert_logs_intact(out: dict) -> None:
    """Issue 16: the sync report must reach the Trainer's loggers without suppressing or stealing any
    of the Trainer's own entries (``_hf_log_runs``: 4 steps, ``logging_steps=1``)."""
    for rank, r in out.items():
        for every, syncs in ((1, [0, 1, 2, 3, 4]), (2, [0, 2, 4])):
            history, on_log = r["log_runs"][every]["history"], r["log_runs"][every]["on_log"]
            where = f"rank {rank}, every={every}"
            own = [e for e in history if "loss" in e]
            # every step's loss exactly once, each with the Trainer's pending metric of that step
            assert [e["step"] for e in own] == [1, 2, 3, 4], (where, history)
            assert all(e["reward"] == e["step"] for e in own), (where, own)
            assert all(not any(k.startswith("weightsync/") for k in e) for e in own), (where, own)
            ws = [e for e in history if "weightsync/bytes" in e]
            assert [e["step"] for e in ws] == syncs, (where, history)
            assert all("loss" not in e and "reward" not in e for e in ws), (where, ws)
            # what the report_to integrations see: the same entries, through on_log
            assert [e["at"] for e in on_log if "loss" in e] == [1, 2, 3, 4], (where, on_log)
            assert [e["at"] for e in on_log if "weightsync/bytes" in e] == syncs, (where, on_log)


# ---- Lightning (DDP, 2 ranks) --------------------------------------------------------------------


def _lightning_world(rank: int, world_size: int, url: str, out_dir: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from vllm.distributed.weight_transfer.base import ModuleSource

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
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

        def on_train_end(self, trainer, module):  # after the callback's final sync
            self._probe(module)

    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp", max_steps=7, accumulate_grad_batches=2,
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
    assert out[0]["global_step"] == 7
    # cold sync, then every 2 optimizer steps (accumulate_grad_batches=2: 14 batches per rank), then
    # the final sync at train end of step 7 (not a multiple of 2): the server ends on the trained weights
    assert out[0]["steps"] == out[1]["steps"] == [0, 2, 4, 6, 7]
    assert sorted(snapshots, key=int) == ["0", "2", "4", "6", "7"]
    for version, params in out[0]["params"].items():
        assert set(snapshots[version]) == set(params)
        for k, v in params.items():
            torch.testing.assert_close(snapshots[version][k], torch.tensor(v), rtol=0, atol=0)
    assert not torch.equal(snapshots["6"]["0.weight"], snapshots["7"]["0.weight"])  # the last step trained
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "weightsync/bytes" in metrics and "weightsync/send_seconds" in metrics


# ---- Megatron-core loop (PP=2 x VPP=2 on 2 ranks) ---------------------------------------------------


def _megatron_world(rank: int, world_size: int, url: str) -> dict:
    import megatron_worlds as mw

    import json_engine  # noqa: F401
    from json_engine import JSONTrainerInitInfo

    from weightsync.plugins.sync import VLLMHTTPClient
    from weightsync.plugins.hooks.megatron import MegatronWeightSync

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


def test_hook_sync_argument_is_validated_before_training_and_after_the_factory():
    """Both callbacks take a ``WeightSync`` or a factory; anything else fails at construction, and a
    factory that returns something else fails when it is called, naming the hook and the type."""
    from types import SimpleNamespace

    from weightsync.plugins.lightning import WeightSyncCallback as LightningCallback
    from weightsync.plugins.transformers import WeightSyncCallback as HFCallback

    for cls, arg in ((HFCallback, "model"), (LightningCallback, "pl_module")):
        with pytest.raises(TypeError, match=rf"WeightSyncCallback: sync must be a WeightSync or a callable {arg} -> WeightSync, got int"):
            cls(42)
    seen: list = []

    def factory(model):
        seen.append(model)
        return "not a sync"

    model = torch.nn.Linear(2, 2)
    state = SimpleNamespace(global_step=0, log_history=[])
    with pytest.raises(TypeError, match="the sync factory returned str, not a WeightSync"):
        HFCallback(factory).on_train_begin(None, state, None, model=model)
    with pytest.raises(ValueError, match="passed no model"):
        HFCallback(factory).on_train_begin(None, state, None, model=None)
    with pytest.raises(TypeError, match="the sync factory returned str, not a WeightSync"):
        LightningCallback(factory).on_train_start(SimpleNamespace(global_step=0), model)
    assert seen == [model, model]  # called with the prepared model, once per hook; never with None
