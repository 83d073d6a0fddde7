"""The loopback worker engine's reload, on the installed vLLM's own reload code (CPU, in process).

``LoopbackWorkerEngine`` runs inside a vLLM server; here it gets a small model that loads like a vLLM
model (each parameter's ``weight_loader``) and has vLLM's cold-start records (what the model loader
records before any reload), and the round's transport is replaced by one that hands the engine its
tensors (the transport itself is tested against a real server in ``test_vllm_server.py``). What runs
for real: the engine's checks, its choice of reload API, and vLLM's ``start_reload`` /
``finish_reload`` (0.34, both ``VLLM_RELOAD_MODE`` values) or ``initialize_layerwise_reload`` /
``finalize_layerwise_reload`` (0.33).

Oracle: the model's tensors before and after, against what was sent.
"""

from __future__ import annotations

import types

import pytest
import torch
import vllm

from weightsync.plugins.loopback.worker import engine as vllm_engine
from weightsync.plugins.loopback.worker.engine import LoopbackWorkerEngine, reload_mode
from weightsync.plugins.sync.http_client import parse_vllm_version
from weightsync.sources import IntegrityError, MetadataMismatchError

V034 = parse_vllm_version(vllm.__version__) >= (0, 34)
MODES = ["layerwise", "direct"] if V034 else ["layerwise-legacy"]


class Toy(torch.nn.Module):
    """Two layers; ``load_weights`` goes through each parameter's vLLM ``weight_loader`` and raises
    on the name ``"boom"`` (a failure inside vLLM's loading, after the round was verified)."""

    def __init__(self) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2)
        for p in self.parameters():
            p.requires_grad_(False)
            p.weight_loader = default_weight_loader

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "boom":
                raise RuntimeError("boom: a loader failed")
            params[name].weight_loader(params[name], w)


def _engine(monkeypatch, mode: str, tmp_path) -> LoopbackWorkerEngine:
    if mode in ("layerwise", "direct"):
        monkeypatch.setenv("VLLM_RELOAD_MODE", mode)
    model = Toy()
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(model)  # what vLLM's loader records at cold start
    if mode == "direct":
        from vllm.model_executor.model_loader.reload.direct import record_checkpoint_layout

        record_checkpoint_layout(model)
    model_config = types.SimpleNamespace(
        model=str(tmp_path), dtype=torch.float32, revision=None, quantization=None,
        word_embeddings_untied_by_checkpoint=True,
    )
    vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(), model_config=model_config)
    engine = LoopbackWorkerEngine(None, vllm_config, torch.device("cpu"), model)
    engine._group, engine._init = object(), object()  # "joined": the fake transport below needs neither
    return engine


def _fake_transport(monkeypatch, model: torch.nn.Module, begun_at: list) -> None:
    """``receive_dense`` stand-in: update_info ``{"tensors": [(name, tensor)], "fail": ...}``. Runs the
    engine's precheck and plan check as the real one does, then fails (``"checksum"``, ``"sender"``:
    before any tensor is handed over) or hands every tensor to ``load``."""

    def receive(group, group_rank, init, update_info, *, index, last_plan, check, load, outcome, precheck=None):
        if precheck is not None:
            precheck()
        plan = [(n, t.dtype, tuple(t.shape)) for n, t in update_info["tensors"]]
        check(plan)
        begun_at.append(getattr(model, "_direct_reload_begun", None))
        if update_info.get("fail") == "checksum":
            raise IntegrityError("receiver 0: checksum mismatch for 'a.weight'")
        if update_info.get("fail") == "sender":
            raise ConnectionError("the sender went away mid-stream")
        for entry, (_, t) in zip(plan, update_info["tensors"]):
            load(entry, t.contiguous().view(torch.uint8).flatten())
        return plan

    monkeypatch.setattr(vllm_engine, "receive_dense", receive)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _round(engine, tensors):
    engine.start_weight_update()
    engine.update_weights({"tensors": tensors})
    engine.finish_weight_update()


def test_reload_mode_follows_the_installed_vllm(monkeypatch):
    if not V034:
        assert reload_mode() == "layerwise-legacy"
        return
    monkeypatch.delenv("VLLM_RELOAD_MODE", raising=False)
    assert reload_mode() == "layerwise"
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    assert reload_mode() == "direct"


@pytest.mark.parametrize("mode", MODES)
def test_rounds_load_and_failures_before_loading_keep_the_previous_weights(monkeypatch, tmp_path, mode):
    engine = _engine(monkeypatch, mode, tmp_path)
    begun_at: list = []
    _fake_transport(monkeypatch, engine.model, begun_at)
    assert engine._mode == mode
    names = list(_state(engine.model))
    new = {k: torch.full_like(v, i + 1.0) for i, (k, v) in enumerate(_state(engine.model).items())}

    # 1. a good round: every tensor served is the sent one
    _round(engine, list(new.items()))
    got = _state(engine.model)
    assert all(torch.equal(got[k], new[k]) for k in names)
    if V034:
        from vllm.model_executor.model_loader.reload import weight_update_active

        assert not weight_update_active()
    if mode == "direct":  # the direct reload began only after the round was received and verified
        assert begun_at == [None] and not getattr(engine.model, "_direct_reload_begun", False)

    # 2. failures before anything reaches the model: rejected by the plan check (a float64 update
    #    for a float32 server), a checksum mismatch, a sender that went away. Previous weights stay.
    before = _state(engine.model)
    newer = {k: v + 10 for k, v in new.items()}
    for fail, tensors, err in (
        (None, [(k, v.double()) for k, v in newer.items()], MetadataMismatchError),
        ("checksum", list(newer.items()), IntegrityError),
        ("sender", list(newer.items()), ConnectionError),
    ):
        engine.start_weight_update()  # a failed update is not finished by vLLM's worker
        with pytest.raises(err):
            engine.update_weights({"tensors": tensors, "fail": fail})
        after = _state(engine.model)
        assert all(torch.equal(after[k], before[k]) for k in names), (mode, fail)
        assert all(t.device.type == "cpu" for t in engine.model.state_dict().values())
        assert not engine._reloading and not engine._begun
        if mode == "direct":
            assert not getattr(engine.model, "_direct_reload_begun", False)

    # 3. the next round works
    _round(engine, list(newer.items()))
    got = _state(engine.model)
    assert all(torch.equal(got[k], newer[k]) for k in names)


@pytest.mark.parametrize("mode", MODES)
def test_failure_inside_load_weights(monkeypatch, tmp_path, mode, caplog):
    """A loader fails after 'a.weight' loaded. Layerwise: layer b, which loaded nothing, gets its
    previous tensors back. Direct: no rollback (here nothing was re-laid out, so the bytes are the
    mix of what loaded and what was there), logged as inconsistent. Both: the engine is finished,
    and the next full round repairs everything."""
    engine = _engine(monkeypatch, mode, tmp_path)
    _fake_transport(monkeypatch, engine.model, [])
    before = _state(engine.model)
    sent = {k: v + 5 for k, v in before.items()}
    engine.start_weight_update()
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="boom"):
        engine.update_weights({"tensors": [("a.weight", sent["a.weight"]), ("boom", torch.zeros(1))]})
    after = _state(engine.model)
    assert torch.equal(after["a.weight"], sent["a.weight"])  # loaded before the failure
    for k in ("b.weight", "b.bias"):
        assert torch.equal(after[k], before[k]), (mode, k)  # never loaded: previous weights
    assert not engine._reloading and not engine._begun
    if mode == "direct":
        assert "no rollback" in caplog.text and "inconsistent until the next full sync" in caplog.text
    else:
        assert "previous weights restored" in caplog.text
    _round(engine, list(sent.items()))
    got = _state(engine.model)
    assert all(torch.equal(got[k], sent[k]) for k in sent)
