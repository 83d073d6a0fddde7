"""The worker side of the ``"loopback"`` backend inside a real vLLM server (vLLM 0.32, 0.33 and 0.34).

vLLM's worker builds it through ``WeightTransferEngineFactory`` when the server runs with
``--weight-transfer-config '{"backend": "loopback"}'``; the registration comes from weightsync's
``vllm.general_plugins`` entry point (``weightsync.plugins.loopback.worker.plugin``), so installing weightsync
into the server's environment is all it takes. The trainer side is unchanged
(``LoopbackTrainerInitInfo``, vLLM's HTTP dev-mode routes, gloo on CPU).

What it shares with our stand-in receiver (``LoopbackReceiver``): ``receiving.receive_dense`` --
validation before the go/no-go handshake, the chunk plan, the checksums. What it adds:

* **Strict against the served checkpoint.** The update must name exactly the served checkpoint's
  tensors (the ``.safetensors`` headers of the folder vLLM loaded), with their shapes, in the dtype
  the server runs (``--dtype``): anything else is answered "no" before any byte moves.
* **Loading through vLLM, in the server's reload mode.** Everything is received and its checksums
  verified first; only then does the chunk go to the model's own ``load_weights``, inside vLLM's
  reload, which repacks what CPU kernels need. On vLLM 0.34 that is ``start_reload`` /
  ``finish_reload``, which follow the server's ``VLLM_RELOAD_MODE``: ``layerwise`` (the default)
  or ``direct`` (in place, into the served tensors' own memory). On 0.32 / 0.33 (no
  ``start_reload``) it is ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, as before.
  ``reload_mode()`` says which one this process runs.
* **The server survives a failed update** where the mode allows. vLLM's worker drops a failed
  ``update_weights`` without finishing the reload.

  - ``layerwise``: the reload starts at ``start_weight_update`` (the layers go to the meta device;
    a forward before the finish kills the engine). On any failure this engine finishes the reload
    itself: layers that loaded nothing get their previous tensors back, so a rejected update, a
    checksum mismatch or a sender that went away leaves the previous weights served.
  - ``direct``: vLLM has no rollback (``begin_direct_reload`` views re-laid-out tensors back to their
    checkpoint layout in place and zero-fills padding; "the next full update repairs it"). So this
    engine begins the direct reload only once the round has been received and verified, right
    before ``load_weights``: a rejected update, a checksum mismatch or a sender that went away
    never touches the model, and the previous weights stay served. What ``direct`` cannot restore:
    a failure *inside* ``load_weights`` or in the finish (post-load processing): the served tensors
    then hold a mix of new bytes and old ones reinterpreted in checkpoint layout. The engine still
    finishes (so the next update can begin) and logs that the weights are inconsistent until the
    next full sync.

  In both modes a failure inside ``load_weights`` leaves what it already loaded on the new weights;
  the round is not committed, so ``weight_version`` stays, and the next full sync repairs it. (On
  0.34 vLLM's worker also keeps reporting ``has_incomplete_weight_update()`` after a failed round,
  until the next successful one; that flag is informational: generation goes on.)
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

from weightsync.sources import MetadataMismatchError
from weightsync.sources.toolkit import get_logger

from ..receiver.receiving import DenseRound, Plan, receive_dense, typed
from ..receiver.transport import LoopbackWorkerInitInfo, open_transport_group

__all__ = ["LoopbackWorkerEngine", "reload_mode", "served_checkpoint_table"]

logger = get_logger(__name__)

#: safetensors header dtype names -> torch dtypes (what a served checkpoint can hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def reload_mode() -> str:
    """How this process reloads weights: ``"direct"`` or ``"layerwise"`` on vLLM 0.34 (its
    ``VLLM_RELOAD_MODE``), ``"layerwise-legacy"`` on 0.32 / 0.33 (no ``start_reload``)."""
    from vllm.model_executor.model_loader import reload as vllm_reload

    if not hasattr(vllm_reload, "start_reload"):
        return "layerwise-legacy"
    from vllm.model_executor.model_loader.reload.direct import direct_reload_enabled

    return "direct" if direct_reload_enabled() else "layerwise"


def _start_reload(model: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader import reload as vllm_reload

    if hasattr(vllm_reload, "start_reload"):
        vllm_reload.start_reload(model)
    else:
        vllm_reload.initialize_layerwise_reload(model)


def _finish_reload(model: torch.nn.Module, model_config: Any, device: torch.device) -> None:
    from vllm.model_executor.model_loader import reload as vllm_reload

    if hasattr(vllm_reload, "finish_reload"):
        vllm_reload.finish_reload(model, model_config, device)
    else:
        vllm_reload.finalize_layerwise_reload(model, model_config)


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
        #: ``start_weight_update`` was called and no finish yet (the round is open).
        self._reloading = False
        #: vLLM's reload has begun on the model (layerwise: at start; direct: right before loading).
        self._begun = False
        self._mode = reload_mode()
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
        self._reloading = True
        if self._mode != "direct":  # direct begins only once the round is received and verified
            self._begin()

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
        if not self._begun:
            self._begin()
        with torch.no_grad():
            self.model.load_weights(received)

    def finish_weight_update(self) -> None:
        self._reloading = False
        if self._begun:
            self._begun = False
            _finish_reload(self.model, self.model_config, self.device)

    def shutdown(self) -> None:
        self._group = self._store = None
        self._init = None

    # -- failure ------------------------------------------------------------------------------

    def _require_reloading(self) -> None:
        if not self._reloading:
            raise RuntimeError("loopback worker: update_weights without start_weight_update")

    def _begin(self) -> None:
        _start_reload(self.model)
        self._begun = True

    def _restore(self) -> None:
        """After a failed update. Layerwise: finish the reload, so layers that loaded nothing get
        their previous tensors back (vLLM's worker would leave them on the meta device). Direct, not
        begun (the failure came before loading): nothing touched the model. Direct, begun: no
        rollback exists; finish so the next update can begin, and say the weights are mixed."""
        if not self._reloading:
            return
        begun = self._begun
        try:
            self.finish_weight_update()
        except Exception as e:  # noqa: BLE001 - the update's own error is the one to raise
            logger.error("loopback worker: finishing the %s reload after a failed update failed: %s", self._mode, e)
            return
        if self._mode == "direct" and begun:
            logger.error(
                "loopback worker: update failed while loading in VLLM_RELOAD_MODE=direct, which has no "
                "rollback: the served weights are inconsistent until the next full sync"
            )
        elif begun:
            logger.warning("loopback worker: update failed; previous weights restored (%s reload)", self._mode)
        else:
            logger.warning("loopback worker: update failed before loading; the model was not touched")
