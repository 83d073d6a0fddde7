"""A test-only vLLM trainer engine that ships tensors inside the HTTP ``update_weights`` body.

It follows the IPC engine's shape (vLLM's ``ipc_engine.py``, 0.33 and 0.34): sender-only RPCs, every rank drains
``iter_full()`` (so FSDP gathers line up), one ``update_weights`` per ``chunk`` tensors carrying a
base64 safetensors blob, then ``finish_weight_update()`` with no version (as vLLM's engines do).
Registered under backend ``"test_json"`` on import. Used to drive ``WeightSync`` end to end against
``tests/vllm_devserver.py`` without a GPU.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory


@dataclass
class JSONTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "test_json"
    chunk: int = 4
    call_finish: bool = True


class JSONTrainerEngine(TrainerWeightTransferEngine[JSONTrainerInitInfo]):
    init_info_cls = JSONTrainerInitInfo
    shutdowns = 0
    #: non-senders only iterate the source: a failed sender may finish the pass alone (driver).
    weightsync_finishable_pass = True

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None or not source.implements_iter_full():
            raise ValueError("test_json needs a WeightSource with iter_full")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        engine.chunk = init_info.chunk
        engine.call_finish = init_info.call_finish
        if engine.is_sender:
            client.init_weight_transfer_engine({"backend": "test_json", "chunk": init_info.chunk})
        return engine

    def send_weights(self) -> None:
        from safetensors.torch import save

        if self.is_sender:
            self.client.start_weight_update()
        batch: dict = {}

        def flush() -> None:
            if self.is_sender and batch:
                blob = base64.b64encode(save(dict(batch))).decode()
                self.client.update_weights({"names": list(batch), "safetensors_b64": blob})
            batch.clear()

        for name, tensor in self.source.iter_full():
            if self.is_sender:
                batch[name] = tensor.detach().cpu().contiguous().clone()
                if len(batch) >= self.chunk:
                    flush()
        flush()
        if self.is_sender and self.call_finish:
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        type(self).shutdowns += 1


if "test_json" not in WeightTransferTrainerFactory._registry:
    WeightTransferTrainerFactory.register_engine("test_json", JSONTrainerEngine)
