"""Would the servers take this adapter? Their LoRA limits (``server_limits``, from ``GET
/server_info``) and the verdict on an adapter against them (``check_adapter``).

Invariant: ``check_adapter`` is pure given the facts, so every rank, given the same facts (rank 0
asks, every rank receives them on the store), reaches the same verdict and raises alike -- before
any server sees the adapter. What it refuses: a rank above ``--max-lora-rank``, ``keep`` above
``--max-loras``, a target the served checkpoint lacks (when its folder is readable here), the output
embedding (vLLM serves no LoRA on it), and whatever vLLM's own ``PEFTHelper.validate_legal`` refuses.
"""

from __future__ import annotations

import json
import os
from typing import Any

from weightsync.sources import PreflightError, WeightSyncError

__all__ = ["check_adapter", "server_limits"]


def _served_names(model_dir: str) -> set[str] | None:
    """Tensor names of the served checkpoint folder, or None when it is not a readable folder here."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    files = [f for f in os.listdir(model_dir) if f.endswith(".safetensors") and not f.startswith("adapter")]
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(os.path.join(model_dir, f), framework="pt") as h:
            names.update(h.keys())
    return names


def server_limits(info: dict[str, Any], modules: list[str]) -> dict[str, Any]:
    """One server's facts from its ``/server_info`` JSON: ``lora`` (``None`` without
    ``--enable-lora``: ``max_lora_rank``, ``max_loras``, ``max_cpu_loras``, ``lora_dtype``), ``model``
    and ``missing`` -- which of ``modules`` (adapter targets) have no ``<module>.weight`` in the
    served checkpoint (``None``: the served folder is not readable from here, not checked)."""
    cfg = info.get("vllm_config") or {}
    if not isinstance(cfg, dict):
        raise WeightSyncError("GET /server_info returned vllm_config as text; this server's vLLM is too old "
                              "for config_format=json")
    lora = cfg.get("lora_config")
    model = (cfg.get("model_config") or {}).get("model", "")
    names = _served_names(model)
    out: dict[str, Any] = {"model": model, "missing": None, "lora": None}
    if names is not None:
        out["missing"] = [m for m in modules if f"{m}.weight" not in names]
    if isinstance(lora, dict):
        out["lora"] = {k: lora.get(k) for k in ("max_lora_rank", "max_loras", "max_cpu_loras", "lora_dtype")}
    return out


def check_adapter(source: Any, facts: dict[str, dict[str, Any]], *, mode: str, keep: int | None,
                  rank: int) -> None:
    """Raise ``PreflightError`` naming the rank, the server and every problem if any server would
    refuse ``source``'s adapter (``facts``: ``{url: server_limits(...)}``). Pure: the same verdict
    on every rank for the same facts."""
    problems: list[str] = []
    modules = source.modules
    out_emb = _output_embedding_path(source)
    for url, f in facts.items():
        lora = f.get("lora")
        if lora is None:
            problems.append(f"{url} serves without LoRA (start it with --enable-lora and "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
            continue
        limit = int(lora["max_lora_rank"])
        over = [m for m in modules if m.rank > limit]
        if over:
            problems.append(f"{url}: adapter rank {over[0].rank} of {over[0].module!r} ({len(over)} module(s)) is "
                            f"above the server's --max-lora-rank {limit}")
        if mode == "versioned" and keep is not None and keep > int(lora["max_loras"]):
            problems.append(f"{url}: keep={keep} versions loaded but the server's --max-loras is "
                            f"{lora['max_loras']}: raise --max-loras or lower keep")
        if f.get("missing"):
            miss = f["missing"]
            problems.append(f"{url}: target module {miss[0]!r} ({len(miss)} in all) has no weight in the served "
                            f"model {f.get('model')!r}: the adapter was trained on another architecture")
        if out_emb is not None and any(m.module == out_emb for m in modules):
            problems.append(f"{url}: the adapter targets the output embedding {out_emb!r}, which vLLM serves "
                            "no LoRA on; merge and send the whole model instead")
        vllm_reason = _vllm_validate(source.adapter_config())
        if vllm_reason:
            problems.append(f"{url}: vLLM's PEFTHelper.validate_legal refuses the adapter_config: {vllm_reason}")
    if problems:
        raise PreflightError(f"rank {rank}: LoRA adapter {source.adapter!r} would be refused: " + "; ".join(problems))


def _output_embedding_path(source: Any) -> str | None:
    hf = source.hf_model
    get = getattr(hf, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        return None
    for path, m in hf.named_modules():
        if m is emb or getattr(m, "base_layer", None) is emb:
            return path
    return None


def _vllm_validate(config: dict[str, Any]) -> str | None:
    """vLLM's own verdict on an ``adapter_config.json`` (``PEFTHelper.validate_legal``), or None."""
    try:
        from vllm.config.lora import LoRAConfig
        from vllm.lora.peft_helper import PEFTHelper
    except ImportError:  # pragma: no cover - vLLM without LoRA support
        return None
    try:
        # the features vLLM refuses (the rank against the server's limit is checked by the caller)
        PEFTHelper.from_dict(dict(config)).validate_legal(LoRAConfig(max_lora_rank=512))
    except Exception as e:  # noqa: BLE001 - its reason is the message
        return str(e)
    return None
