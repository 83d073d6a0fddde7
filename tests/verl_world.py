"""The Ray side of tests/test_verl.py and bench/bench_verl.py: a verl actor group and rollout workers on CPU.

* ``ActorWorker`` -- a verl ``Worker`` on each of the actor ranks (gloo): a tiny Qwen3 trained with
  FSDP2, held by an instance of verl's real ``FSDPEngineWithLMHead`` (built without its CUDA-only
  ``__init__``: only the attributes its ``get_per_tensor_param`` reads). Its ``update_weights`` and
  ``execute_checkpoint_engine`` ARE verl's (``ActorRolloutRefWorker``'s functions, decorators included),
  and its checkpoint engine is built by the same lines as verl's ``init_model`` step 4.
* ``RecordingAdapter`` -- the rollout server adapter each verl ``CheckpointEngineWorker`` loads into: it
  writes every load (names, bytes, ``global_steps``, ``wire_format``) to a safetensors file per call,
  plus a line in a log, for the test process to read.
* ``Replica`` -- what verl's ``CheckpointEngineManager`` drives: the workers, and the abort / kv-cache /
  resume calls, logged in order.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

PRESET = "tiny-qwen3"


def build_config() -> Any:
    from weightsync.plugins.testbed.presets import load_config

    shape = os.environ.get("WS_VERL_SHAPE")  # "hidden,layers" (bench/bench_verl.py); default: the preset
    if not shape:
        return load_config(PRESET)
    hidden, layers = (int(x) for x in shape.split(","))
    return load_config(PRESET, hidden=hidden, layers=layers)


class ActorWorker(Worker):
    """One verl actor rank: FSDP2 model, verl's engine class, verl's update_weights (module docstring)."""

    update_weights = ActorRolloutRefWorker.update_weights
    execute_checkpoint_engine = ActorRolloutRefWorker.execute_checkpoint_engine

    def __init__(self, checkpoint_engine: dict[str, Any]) -> None:
        super().__init__()
        from omegaconf import OmegaConf
        from verl.utils.distributed import initialize_global_process_group_ray

        initialize_global_process_group_ray(timeout_second=300, backend="cpu:gloo")
        import logging

        self.records: list[str] = []
        records = self.records

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        logging.getLogger("weightsync.plugins.verl").addHandler(Keep(logging.ERROR))
        self.config = OmegaConf.create({"rollout": {"checkpoint_engine": checkpoint_engine}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import CheckpointEngineConfig
        from verl.utils.import_utils import import_external_libs
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        from weightsync.plugins.testbed.presets import build_model

        torch.manual_seed(0)
        self.hf_config = build_config()
        model = build_model(self.hf_config, seed=0)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
        engine.module = model
        engine.model_config = SimpleNamespace(hf_config=self.hf_config, lora={})
        engine._uses_fsdp2_cpu_offload_policy = False
        engine._is_offload_param = False
        engine._qat_enabled = False
        self.actor = SimpleNamespace(engine=engine)
        # verl's ActorRolloutRefWorker.init_model, step 4 (build checkpoint engine), line for line but
        # for dataclass_type= (verl's own call goes through hydra's _target_; hydra is not installed here)
        checkpoint_engine_config = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine,
                                                           dataclass_type=CheckpointEngineConfig)
        backend = checkpoint_engine_config.backend
        bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
        engine_kwargs = checkpoint_engine_config.engine_kwargs.get(backend, {})
        import_external_libs(checkpoint_engine_config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> float:
        torch.manual_seed(100 + step)
        ids = torch.randint(0, self.hf_config.vocab_size, (2, 16))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        return float(loss.detach())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_pretrained(self, path: str) -> None:
        """The oracle: transformers' ``save_pretrained`` of the trainer's full weights (rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from weightsync.plugins.testbed.presets import build_model

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            plain = build_model(self.hf_config, seed=0)
            plain.load_state_dict(full)
            plain.save_pretrained(path)
        dist.barrier()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def errors(self) -> list[str]:
        """What weightsync logged at ERROR on this rank."""
        return list(self.records)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def poison(self, name: str, rank: int) -> None:
        """NaN into one element of ``name``'s shard on ``rank`` only (a diverged step on one rank)."""
        if dist.get_rank() == rank:
            with torch.no_grad():
                dict(self.model.named_parameters())[name].to_local().view(-1)[0] = float("nan")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_with(self, which: str) -> None:
        """``"weightsync"``: verl's engine (tapped); ``"verl"``: verl's own export, untapped, on CPU."""
        from verl.workers.engine.fsdp import transformer_impl

        engine = self._engine = getattr(self, "_engine", None) or self.actor.engine
        if which == "weightsync":
            self.actor = SimpleNamespace(engine=engine)
            return
        # CPU shims for verl's export only: it asks CUDA for a device index and for memory usage
        transformer_impl.get_device_id = lambda: "cpu"
        transformer_impl.log_gpu_memory_usage = lambda *a, **k: None
        verl_export = type(engine).get_per_tensor_param.__wrapped__
        self.actor = SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=lambda: verl_export(engine)))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def collectives(self) -> int:
        """Collectives this rank has issued so far, over every process group it holds (each group's
        sequence number counts its collectives; verl runs its methods on other threads, so a
        dispatch mode would miss them)."""
        from torch.distributed import distributed_c10d as c10d

        total = 0
        for pg in list(c10d._world.pg_map):
            try:
                total += pg._get_sequence_number_for_group()
            except (RuntimeError, AttributeError):
                pass
        return total


class RecordingAdapter:
    """A rollout server adapter that records what it loads (module docstring)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.replica_rank = 0
        self.is_leader_rank = True

    async def update_weights(self, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        from safetensors.torch import save_file

        rank = dist.get_rank() if dist.is_initialized() else 0
        got: dict[str, torch.Tensor] = {}
        order: list[str] = []
        async for name, tensor in weights:
            got[name] = tensor.clone()
            order.append(name)
        tag = f"rank{rank}-step{global_steps}"
        save_file(got, os.path.join(self.out_dir, f"{tag}.safetensors"))
        with open(os.path.join(self.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "global_steps": global_steps, "wire_format": wire_format,
                                "names": order, "t": time.time()}) + "\n")


class Replica:
    """What ``CheckpointEngineManager`` drives: ``workers`` and the calls it makes around a sync."""

    def __init__(self, workers: list[Any], calls: list[str]) -> None:
        self.workers = workers
        self.calls = calls

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.calls.append("abort_all_requests")

    async def release_kv_cache(self) -> None:
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        self.calls.append("resume_kv_cache")

    async def resume_generation(self) -> None:
        self.calls.append("resume_generation")


def start(tmp: str, actor_ranks: int = 2, rollout_workers: int = 2,
          bucket_mb: int = 1) -> tuple[Any, Any, list[str]]:
    """Start the actor group and the rollout workers; returns (manager, actor group, call log)."""
    from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig
    import ray

    ce = {"backend": "weightsync", "update_weights_bucket_megabytes": bucket_mb,
          "engine_kwargs": {"weightsync": {"dtype": "bfloat16", "timeout_s": 120}},
          "custom_backend_module": "weightsync.plugins.verl"}
    actor_wg = RayWorkerGroup(
        resource_pool=RayResourcePool([actor_ranks], use_gpu=False, name_prefix="actor", max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ActorWorker), checkpoint_engine=ce),
    )
    actor_wg.init_model()
    rollout_config = SimpleNamespace(checkpoint_engine=CheckpointEngineConfig(**ce), name="vllm", mode="async")
    rollout_wg = RayWorkerGroup(
        resource_pool=RayResourcePool([rollout_workers], use_gpu=False, name_prefix="rollout", max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker), rollout_config=rollout_config,
                                               model_config=None, server_adapter=RecordingAdapter(tmp)),
    )
    calls: list[str] = []
    manager = CheckpointEngineManager(CheckpointEngineConfig(**ce), actor_wg, [Replica(rollout_wg.workers, calls)])
    return manager, actor_wg, calls
