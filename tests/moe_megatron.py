"""Test-side builders for megatron-core MoE ``GPTModel``s on CPU gloo worlds (helpers, no tests).

MoE layers need the ``allgather`` token dispatcher to build on CPU. Legacy ``GroupedMLP`` asserts
that the ``grouped_gemm`` package is importable at construction only (its forward needs it, its
parameters do not), so ``build_gpt(..., expert_format="grouped")`` lifts that assertion for the
build: the parameters, their layout and ``sharded_state_dict`` are megatron-core's own.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


@contextlib.contextmanager
def cpu_cuda_shim():
    """On a CPU-only host, megatron-core code that allocates on ``torch.cuda.current_device()``
    (TopKRouter's expert_bias, dist_checkpointing's finalize) or calls ``torch.cuda.synchronize``
    gets the CPU instead. A no-op where CUDA exists."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    try:
        model_parallel_cuda_manual_seed(123)
    except Exception:  # CPU-only: no CUDA RNG tracker state to seed
        pass


def moe_config(
    *,
    layers: int = 2,
    hidden: int = 16,
    experts: int = 4,
    moe_ffn: int = 12,
    ffn: int = 40,
    shared_ffn: int | None = None,
    shared_gate: bool = False,
    expert_bias: bool = False,
    moe_layer_freq: Any = 1,
    expert_format: str = "sequential",
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    qk_norm: bool = False,
    qkv_bias: bool = False,
):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=ffn,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        qk_layernorm=qk_norm,
        add_qkv_bias=qkv_bias,
        num_moe_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=shared_ffn,
        moe_shared_expert_gate=shared_gate,
        moe_router_enable_expert_bias=expert_bias,
        moe_router_score_function="sigmoid" if expert_bias else "softmax",
        moe_layer_freq=moe_layer_freq,
        moe_grouped_gemm=expert_format == "grouped",
        moe_use_legacy_grouped_gemm=expert_format == "grouped",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        sequence_parallel=False,
    )


def build_gpt(cfg, *, vocab: int = 64, expert_format: str = "sequential", seed: int = 0):
    """A ``GPTModel`` (local spec) for ``cfg`` on this rank, every float tensor (router expert bias
    included) filled with rank-independent-per-global-tensor random values is NOT attempted:
    values come from megatron's own CPU initialisation plus a per-rank offset, which is what the
    oracle (megatron's own checkpoint) must reproduce anyway."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(seed + int(os.environ.get("RANK", "0")) * 1000)
    patch = None
    shim = cpu_cuda_shim()
    shim.__enter__()
    if expert_format == "grouped":
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        patch = gg.assert_grouped_gemm_is_available
        gg.assert_grouped_gemm_is_available = lambda: None
    try:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=32,
            pre_process=_is_first(),
            post_process=_is_last(),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
    finally:
        shim.__exit__(None, None, None)
        if patch is not None:
            gg.assert_grouped_gemm_is_available = patch
    with torch.no_grad():  # distinct values per rank and tensor (init may leave zeros / ones)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "expert_bias" in name or (t.is_floating_point() and t.requires_grad):
                t.copy_(torch.randn_like(t))
    return model


def _is_first() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage()


def _is_last() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def megatron_checkpoint(model, directory: str) -> None:
    """Save with megatron's own ``dist_checkpointing`` (every rank, collectively)."""
    from megatron.core import dist_checkpointing

    with cpu_cuda_shim():
        dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_full_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron ``torch_dist`` checkpoint as one full tensor (rank 0, no model):
    megatron's resharding metadata assembles the shards, not our code."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(directory, "full.pt")
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


def megatron_load(model, directory: str) -> None:
    """Load a ``megatron_checkpoint`` saved at any TP/PP/EP into ``model`` (this rank's layout) with
    megatron's own ``dist_checkpointing`` resharding; raises if any parameter was left out."""
    from megatron.core import dist_checkpointing

    with cpu_cuda_shim():
        loaded = dist_checkpointing.load(model.sharded_state_dict(), directory)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    bad = [k for k in missing + unexpected if not k.endswith("_extra_state")]
    if bad:
        raise AssertionError(f"dist_checkpointing load left {bad}")
