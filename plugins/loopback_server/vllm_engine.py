"""The worker side of the ``"loopback"`` backend inside a real vLLM server (vLLM 0.32 and 0.33).

vLLM's worker builds it through ``WeightTransferEngineFactory`` when the server runs with
``--weight-transfer-config '{"backend": "loopback"}'``; the registration comes from weightsync's
``vllm.general_plugins`` entry point (``weightsync.plugins.vllm_plugin``), so installing weightsync
into the server's environment is all it takes. The trainer side is unchanged
(``LoopbackTrainerInitInfo``, vLLM's HTTP dev-mode routes, gloo on CPU).

What it shares with our stand-in receiver (``LoopbackReceiver``): ``receiving.receive_dense`` --
validation before the go/no-go handshake, the chunk plan, the checksums. What it adds:

* **Strict against the served checkpoint.** The update must name exactly the served checkpoint's
  tensors (the ``.safetensors`` headers of the folder vLLM loaded), with their shapes, in the dtype
  the server runs (``--dtype``): anything else is answered "no" before any byte moves.
* **Loading through vLLM.** Everything is received and its checksums verified first; only then does
  the chunk go to the model's own ``load_weights``, inside vLLM's layerwise reload
  (``start_weight_update`` / ``finish_weight_update``), which repacks what CPU kernels need.
* **The server survives a failed update.** vLLM's worker drops a failed ``update_weights`` without
  finishing the reload, which leaves the layers on the meta device (the next forward kills the
  engine). On any failure this engine finalizes the reload itself: layers that loaded nothing get
  their previous tensors back, so a rejected update, a checksum mismatch or a sender that went away
  leaves the previous weights served. (A failure *inside* ``load_weights``, after validation, would
  leave the layers it already processed on the new weights; the round is not committed, so
  ``weight_version`` stays, and the next full sync repairs it.)
* **CPU.** It never calls ``torch.accelerator.synchronize()`` (vLLM's base ``update_weights`` does,
  and it raises on CPU): loading here is synchronous.

Not supported yet: sparse (delta) rounds (``LoopbackSparseTrainerInitInfo``) and draft models.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightsync.sources import MetadataMismatchError, get_logger

from .receiving import DenseRound, Plan, receive_dense, typed
from .transport import LoopbackWorkerInitInfo, open_transport_group

__all__ = ["LoopbackWorkerEngine", "served_checkpoint_table"]

logger = get_logger(__name__)

#: safetensors header dtype names -> torch dtypes (what a served checkpoint can hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def served_checkpoint_table(folder: str) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from the ``.safetensors`` headers in ``folder`` (no tensor is
    read); empty when the folder holds none."""
    table: dict[str, tuple[torch.dtype | None, tuple[int, ...]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            table[name] = (_ST_DTYPES.get(entry["dtype"]), tuple(int(x) for x in entry["shape"]))
    return table


class LoopbackWorkerEngine(WeightTransferEngine[LoopbackWorkerInitInfo, dict]):
    """One vLLM worker's end of the loopback transport (group rank ``rank_offset + worker rank``)."""

    init_info_cls = LoopbackWorkerInitInfo
    update_info_cls = dict
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.index = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._init: LoopbackWorkerInitInfo | None = None
        self._group: Any = None
        self._store: Any = None
        self._group_rank = -1
        self._last_plan: Plan | None = None
        self._reloading = False
        self._table: dict[str, tuple[torch.dtype | None, tuple[int, ...]]] | None = None

    # -- the served checkpoint ----------------------------------------------------------------

    def _served_table(self) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
        if self._table is None:
            folder = str(self.model_config.model)
            if not os.path.isdir(folder):  # a hub id: the snapshot vLLM downloaded, if cached
                try:
                    from huggingface_hub import snapshot_download

                    folder = snapshot_download(
                        folder, revision=getattr(self.model_config, "revision", None),
                        local_files_only=True, allow_patterns=["*.safetensors"],
                    )
                except Exception as e:  # noqa: BLE001 - reported below
                    logger.warning("loopback worker: no local snapshot of %s (%s)", folder, e)
            self._table = served_checkpoint_table(folder) if os.path.isdir(folder) else {}
            if not self._table:
                logger.warning(
                    "loopback worker: no .safetensors headers under %s: updates are checked by the "
                    "model's load_weights only", folder,
                )
        return self._table

    def _check_plan(self, plan: Plan) -> None:
        table = self._served_table()
        served = self.model_config.dtype
        problems = []
        for name, dtype, shape in plan:
            if table and name not in table:
                problems.append(f"the served model holds no tensor {name!r}")
                continue
            if table and table[name][1] != tuple(shape):
                problems.append(f"{name!r}: update sends shape {tuple(shape)}, served checkpoint has {table[name][1]}")
            if dtype.is_floating_point and dtype != served:
                problems.append(
                    f"{name!r}: update sends {str(dtype).removeprefix('torch.')}, the server runs "
                    f"{str(served).removeprefix('torch.')} (--dtype)"
                )
        if table:
            sent = {name for name, _, _ in plan}
            missing = [n for n in table if n not in sent]
            if missing:
                problems.append(
                    f"the update does not send {len(missing)} of the served checkpoint's "
                    f"{len(table)} tensors: {missing[:10]}" + (" ..." if len(missing) > 10 else "")
                )
        if problems:
            raise MetadataMismatchError(
                f"vLLM worker {self.index} (loopback) rejects the update ({len(problems)} problems): "
                + "; ".join(problems[:10]) + (" ..." if len(problems) > 10 else "")
            )
        self._last_plan = plan

    # -- vLLM's worker engine interface -------------------------------------------------------

    def init_transfer_engine(self, init_info: LoopbackWorkerInitInfo) -> None:
        if init_info.sparse:
            raise ValueError(
                "the loopback worker engine inside vLLM receives dense rounds only; sparse (delta) "
                "rounds go to weightsync's own receiver"
            )
        rank = init_info.rank_offset + self.index
        if rank >= init_info.world_size:
            raise ValueError(
                f"vLLM worker {self.index} needs loopback group rank {rank}, but init_info.world_size "
                f"is {init_info.world_size}"
            )
        self.shutdown()
        self._store, self._group = open_transport_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )
        self._init, self._group_rank, self._last_plan = init_info, rank, None
        self._served_table()
        logger.info("vLLM worker %d joined the loopback group as rank %d", self.index, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: that one ends in torch.accelerator.synchronize(), which raises on
        # CPU; loading here is synchronous. Any failure restores the previous weights.
        try:
            self.receive_weights(update_info)
        except BaseException:
            self._restore()
            raise

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        if self._group is None or self._init is None:
            raise RuntimeError("loopback worker: init_weight_transfer_engine was not called")
        received: list[tuple[str, torch.Tensor]] = []
        receive_dense(
            self._group,
            self._group_rank,
            self._init,
            update_info,
            index=self.index,
            last_plan=self._last_plan,
            check=self._check_plan,
            load=lambda entry, data: received.append((entry[0], typed(entry, data))),
            outcome=DenseRound(),
            precheck=self._require_reloading,
        )
        # Received whole and verified: only now does anything reach the model.
        with torch.no_grad():
            self.model.load_weights(received)

    def finish_weight_update(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._group = self._store = None
        self._init = None

    # -- failure ------------------------------------------------------------------------------

    def _require_reloading(self) -> None:
        if not self._reloading:
            raise RuntimeError("loopback worker: update_weights without start_weight_update")

    def _restore(self) -> None:
        """Finish the layerwise reload after a failed update: layers that loaded nothing get their
        previous tensors back (vLLM's worker would leave them on the meta device)."""
        if not self._reloading:
            return
        try:
            self.finish_weight_update()
            logger.warning("loopback worker: update failed; previous weights restored")
        except Exception as e:  # noqa: BLE001 - the update's own error is the one to raise
            logger.error("loopback worker: restoring the previous weights failed: %s", e)
