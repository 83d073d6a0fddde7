"""TRL's async GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, TRL 1.16) synced by weightsync:
``WeightSyncAsyncGRPOTrainer`` (``weightsync.plugins.trl``).

Here: the layout pin (a TRL without ``_sync_weight_merged`` is refused, naming the TRL version), and
the pieces ``tests/test_vllm_server.py::test_trl_async_grpo_generates_from_the_server_weightsync_syncs``
runs against the real vLLM CPU server that module starts (one server per module, so the real-server
test lives beside the others):

* ``ServerRollouts`` -- TRL's ``RolloutWorkerProtocol`` in process: a thread that samples groups of
  completions from the server's ``/v1/completions`` (token ids in, token ids and logprobs out),
  scores them, and queues TRL's ``RolloutSample``s tagged with the policy version it was told last.
  It stands in for TRL's default ``AsyncRolloutWorker``, a spawned child that imports torch,
  transformers, TRL and vLLM again and renders prompts through a chat template (the served
  word-level tokenizer has none); the trainer, its packing, loss and sync are TRL's own.
* ``cpu_tree_attention`` -- TRL 1.16's AsyncGRPO is GPU-only: the packed ("tree") attention it
  registers calls the FlashAttention-3 kernel, and ``__init__`` reads the CUDA device name for MFU.
  On CPU the world registers this torch version of the same varlen attention (each segment's queries
  against the K/V of its root-to-segment path, causal aligned to the path's end) under TRL's name,
  and MFU is off (``get_peak_flops_per_device`` -> None). Neither touches the sync.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
from typing import Any

import pytest

#: completions per prompt group and tokens per completion in the world below
GENERATIONS = 4
COMPLETION_TOKENS = 6


def cpu_tree_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *, scaling: Any = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """TRL's ``tree_attention`` (``trl.experimental.async_grpo.packing``) without the FA3 kernel;
    without tree arguments (an ordinary forward) it is transformers' SDPA attention."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if "tree_kv_index" not in kwargs:
        kwargs.pop("sliding_window", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_index, cu_q, cu_k = kwargs["tree_kv_index"], kwargs["tree_cu_seqlens_q"], kwargs["tree_cu_seqlens_k"]
    q = query[0].transpose(0, 1)  # [tokens, heads, dim]
    k = key[0].transpose(0, 1).index_select(0, kv_index)
    v = value[0].transpose(0, 1).index_select(0, kv_index)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = []
    for s in range(len(cu_q) - 1):
        qs = q[int(cu_q[s]):int(cu_q[s + 1])].transpose(0, 1)
        ks = k[int(cu_k[s]):int(cu_k[s + 1])].transpose(0, 1)
        vs = v[int(cu_k[s]):int(cu_k[s + 1])].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)  # the segment ends its path
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling).transpose(0, 1))
    return torch.cat(out, dim=0).unsqueeze(0), None


class ServerRollouts:
    """TRL's ``RolloutWorkerProtocol``, in process (module docstring). Each group: one prompt of
    ``prompts`` (token ids), ``n`` sampled completions from the server, reward ``reward(tokens)``,
    advantage = reward - group mean over the group's std. ``versions`` records the policy version each
    group was requested under."""

    def __init__(self, url: str, model_dir: str, prompts: list[list[int]], *, n: int, max_tokens: int,
                 reward: Any, ahead: int = 2) -> None:
        self.url, self.model_dir, self.prompts = url, model_dir, prompts
        self.n, self.max_tokens, self.reward, self.ahead = n, max_tokens, reward, ahead
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self.versions: list[int] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="server-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"ServerRollouts failed: {type(self._error).__name__}: {self._error}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("ServerRollouts' thread exited")

    def _run(self) -> None:
        group = 0
        try:
            while not self._stop.is_set():
                if self.rollout_buffer.qsize() >= self.ahead * self.n:
                    self._stop.wait(0.05)
                    continue
                self._group(group)
                group += 1
        except BaseException as e:  # noqa: BLE001 - reported through check_health
            self._error = e

    def _group(self, group: int) -> None:
        import numpy as np
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        prompt = self.prompts[group % len(self.prompts)]
        version = self.model_version
        self.versions.append(version)
        req = urllib.request.Request(
            self.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({
                "model": self.model_dir, "prompt": prompt, "n": self.n, "max_tokens": self.max_tokens,
                "temperature": 1.0, "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True,
            }).encode(),
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            choices = json.loads(r.read())["choices"]
        completions = []
        for c in choices:
            lp = c["logprobs"]
            completions.append(([int(t.removeprefix("token_id:")) for t in lp["tokens"]],
                                [float(x) for x in lp["token_logprobs"]]))
        rewards = [float(self.reward(tokens)) for tokens, _ in completions]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        text = " ".join(f"w{t}" for t in prompt)
        for (tokens, logprobs), reward in zip(completions, rewards):
            self.rollout_buffer.put(RolloutSample(
                prompt=[{"role": "user", "content": text}],
                completion=[{"role": "assistant", "content": " ".join(f"w{t}" for t in tokens)}],
                input_ids=np.array(prompt + tokens, dtype=np.int64),
                completion_mask=np.array([0] * len(prompt) + [1] * len(tokens), dtype=np.int64),
                old_log_probs=np.array([0.0] * len(prompt) + logprobs, dtype=np.float32),
                advantage=(reward - mean) / (std + 1e-4), model_version=version, group_id=group,
                metrics={"reward": reward}, enqueued_at=time.time(),
            ))


def world_trl_async_grpo(rank: int, world_size: int, *, url: str, model_dir: str, work: str) -> dict:
    """TRL's ``AsyncGRPOTrainer`` with rollouts from the real server (``ServerRollouts``, rank 0) and
    its sync replaced by weightsync (``WeightSyncAsyncGRPOTrainer``; loopback backend, the source from
    ``source_from_accelerator``: DDP on CPU), 2 steps, a sync after each (``weight_sync_steps=1``)
    besides the cold one. After each sync the test's subclass records, on every rank, the trainer's
    ``model_version`` and the step of weightsync's report, the server's version and greedy tokens of
    ``PROMPTS``, and transformers' greedy tokens of a fresh model holding the rank's weights."""
    import torch
    import trl.experimental.async_grpo.async_grpo_trainer as agt
    from datasets import Dataset
    from transformers import AttentionInterface, PreTrainedTokenizerFast
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    from weightsync.plugins.accelerate import source_from_accelerator
    from weightsync.plugins.loopback import LoopbackTrainerInitInfo
    from weightsync.plugins.sync import VLLMHTTPClient, WeightSync
    from weightsync.plugins.testbed.vllm_server import (
        PROMPTS, VLLMServer, greedy, save_served_model, served_model,
    )
    from weightsync.plugins.trl import WeightSyncAsyncGRPOTrainer

    agt.get_peak_flops_per_device = lambda accelerator, dtype: None  # reads the CUDA device name
    mine = os.path.join(work, "trainer")
    if rank == 0:
        save_served_model(mine, seed=7)  # the trainer starts from other weights than the server's
    if world_size > 1:
        torch.distributed.barrier()
    srv = VLLMServer(url, None, os.path.join(work, "none.log"), model_dir)
    checks: list[dict] = []
    holder: list = []

    class Checked(WeightSyncAsyncGRPOTrainer):
        def _sync_weight_merged(self, t0):
            marks = super()._sync_weight_merged(t0)
            oracle = served_model(0)
            oracle.load_state_dict(self.accelerator.unwrap_model(self.model).state_dict())
            checks.append({
                "model_version": self.model_version, "report_step": self.weight_sync.last_report.step,
                "version": srv.weight_version(), "paused": srv.is_paused(),
                "want": [greedy(oracle, p) for p in PROMPTS], "got": [srv.generate(p) for p in PROMPTS],
            })
            return marks

    def build(model):
        source = source_from_accelerator(holder[0].accelerator, model)
        info = LoopbackTrainerInitInfo("127.0.0.1", 0, 2, rank=rank, timeout_s=60)
        return WeightSync(source, info, VLLMHTTPClient(url, timeout=30), pause="keep")

    args = AsyncGRPOConfig(
        output_dir=os.path.join(work, "out"), vllm_server_base_url=url, per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=COMPLETION_TOKENS, max_steps=2, weight_sync_steps=1,
        token_budget=0, learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, bf16=False, dtype="float32",  # fp32, as the server
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(mine, padding_side="left")
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{t}" for t in p) for p in PROMPTS]})
    worker = ServerRollouts(url, model_dir, PROMPTS, n=GENERATIONS, max_tokens=COMPLETION_TOKENS,
                            reward=lambda tokens: sum(tokens) / (len(tokens) * 256))  # no two alike
    common = dict(model=mine, reward_funcs=[], args=args, train_dataset=prompts, processing_class=tokenizer,
                  rollout_worker=worker)
    try:
        WeightSyncAsyncGRPOTrainer(sync=build, weight_transfer=object(), **common)
        refused = None
    except ValueError as e:
        refused = str(e)
    trainer = Checked(sync=build, **common)
    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)  # after TRL registered its FA3 one
    holder.append(trainer)
    trainer.train()
    trainer.weight_sync.shutdown()
    return {"checks": checks, "history": list(trainer.state.log_history), "refused": refused,
            "versions": list(worker.versions), "model_version": trainer.model_version}


def test_a_trl_without_the_merged_sync_is_refused_naming_its_version():
    """``check_trl_async_layout``: a TRL whose AsyncGRPOTrainer lacks TRL 1.16's
    ``_sync_weight_merged(self, t0)`` or ``weight_transfer=`` is refused when the class is built,
    naming the version found, what is missing and the layout it needs -- never a silent fallback."""
    from weightsync.plugins.hooks.trl_async import check_trl_async_layout

    class Renamed:
        def __init__(self, model, weight_transfer=None, rollout_worker=None):
            pass

        def _sync_weights_full(self, t0):
            pass

    class OtherArgs:
        def __init__(self, model, rollout_worker=None):
            pass

        def _sync_weight_merged(self, t0, force):
            pass

    with pytest.raises(ImportError) as e:
        check_trl_async_layout(Renamed, "9.9.0")
    for needle in ("TRL 9.9.0", "no _sync_weight_merged", "TRL 1.16", "trl==1.16"):
        assert needle in str(e.value), (needle, str(e.value))
    with pytest.raises(ImportError) as e:
        check_trl_async_layout(OtherArgs, "9.9.0")
    assert "not (self, t0)" in str(e.value) and "no weight_transfer=" in str(e.value), str(e.value)

    class Fits:
        def __init__(self, model, weight_transfer=None, rollout_worker=None):
            pass

        def _sync_weight_merged(self, t0):
            pass

    check_trl_async_layout(Fits, "1.16.0")


def test_the_installed_trl_fits_the_pin():
    """The TRL this suite installs has the layout (the import builds the class)."""
    pytest.importorskip("trl")
    from weightsync.plugins.trl import WeightSyncAsyncGRPOTrainer

    assert WeightSyncAsyncGRPOTrainer.__mro__[1].__name__ == "AsyncGRPOTrainer"
