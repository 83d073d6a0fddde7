"""vLLM's own Qwen3-Next / Qwen3.5 MTP draft models, built on the meta device on a CPU host, and their
``load_weights`` run over a set of checkpoint tensors: the oracle for "these names and shapes are what
vLLM's draft loader consumes".

The draft classes (``Qwen3NextMTP``, ``Qwen3_5MTP``, ``Qwen3_5MoeMTP``) walk their module tree with
``AutoWeightsLoader`` (stacked q/k/v and gate/up, per-expert ``FusedMoE`` loaders, the in-projection
fusion of Qwen3.5), so unlike DeepSeek's / GLM's flat loaders they cannot be fed a stand-in parameter
list: the real module is built. Two construction-only answers make that possible without a GPU, and
neither changes which parameters exist or how they load:

* the attention layer's backend (``get_attn_backend``): vLLM's build here has no CPU platform, so no
  backend resolves; a stub backend with an implementation that holds nothing (attention implementations
  own no weights);
* the unquantized MoE kernel choice (``select_unquantized_moe_backend``): no backend is listed for an
  unspecified platform; Triton's is named (the expert weights' layout and loaders do not depend on it).

Run it in a fresh process (a 1-rank world): it initializes vLLM's distributed state and patches the two
names for the life of that process. Every parameter's ``weight_loader`` is wrapped to record which
checkpoint tensor reached it (shape-checked by vLLM's loaders against the meta parameter's shape).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

#: hf ``model_type`` -> the vLLM 0.34 draft class that serves it (``vllm/model_executor/models``).
DRAFT_CLASSES = {
    "qwen3_next": ("vllm.model_executor.models.qwen3_next_mtp", "Qwen3NextMTP"),
    "qwen3_5_text": ("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MTP"),
    "qwen3_5_moe_text": ("vllm.model_executor.models.qwen3_5_mtp", "Qwen3_5MoeMTP"),
}


class _NoImpl:
    """An attention implementation that holds no weights (construction only)."""

    supports_quant_query_input = False

    def __init__(self, *a: Any, **k: Any) -> None:
        pass


class _StubBackend:
    @staticmethod
    def supports_alibi_sqrt() -> bool:
        return False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type:
        return _NoImpl


def _construction_answers() -> None:
    import vllm.model_executor.layers.attention.attention as attention
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    attention.get_attn_backend = lambda *a, **k: _StubBackend
    unquantized.select_unquantized_moe_backend = lambda *a, **k: (UnquantizedMoeBackend.TRITON, None)


def load_draft(hf: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Build vLLM's draft model for ``hf`` (``DRAFT_CLASSES``) on the meta device and run its
    ``load_weights`` over ``tensors``. Returns ``{"cls", "loaded"`` (the parameter names
    ``load_weights`` reports loaded), ``"params"`` (every parameter of the draft), ``"calls"``
    (``(parameter, checkpoint shape, shard / expert keywords)`` per ``weight_loader`` call)}.
    Needs a process whose default process group is a 1-rank world (or none)."""
    import importlib

    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    _construction_answers()
    folder = tempfile.mkdtemp(prefix="ws-vllm-draft-")
    hf.save_pretrained(folder)
    config = VllmConfig(model_config=ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32"),
                        device_config=DeviceConfig(device="cpu"))
    module, name = DRAFT_CLASSES[hf.model_type]
    cls = getattr(importlib.import_module(module), name)
    with set_current_vllm_config(config):
        port = os.environ.get("MASTER_PORT", "29500")
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        with torch.device("meta"):
            model = cls(vllm_config=config, prefix="")
        calls: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []
        for pname, p in model.named_parameters():
            inner = getattr(p, "weight_loader", None)
            if inner is None:
                from vllm.model_executor.model_loader.weight_utils import default_weight_loader as inner

            def loader(*args: Any, _n: str = pname, _f: Any = inner, **kw: Any) -> Any:
                weight = args[1] if len(args) > 1 else kw["loaded_weight"]
                extra = {k: v for k, v in kw.items() if k not in ("param", "loaded_weight")}
                calls.append((_n, tuple(weight.shape), {**extra, "args": [a for a in args[2:] if not torch.is_tensor(a)]}))
                return _f(*args, **kw)

            p.weight_loader = loader
        loaded = model.load_weights(list(tensors.items()))
    return {"cls": name, "loaded": set(loaded), "params": {n for n, _ in model.named_parameters()}, "calls": calls}
