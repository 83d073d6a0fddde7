"""The megatron-core side of the GPU evidence: a TP1 ``GPTModel`` that computes the same function as
a transformers model of the same config, and its forward.

Invariant: ``megatron_config(hf_config)`` is weightsync's one builder's config for ``hf_config`` (the
family table: RMSNorm eps, rope theta and fraction, GQA groups and head_dim, qk-norm, qkv bias, tied
embeddings, SiLU-GLU MLP, MoE routing -- top-k with HF's ``norm_topk_prob``, sigmoid group-limited
routing with the score-correction bias, shared experts, first-k dense layers -- and DeepSeek-V3's
multi-latent attention), with everything that only Megatron does turned off (dropout, query-key
layer scaling, fused kernels). So the oracle checks the family table itself: a field mapped wrong
makes Megatron's logits differ from transformers'. ``forward_conditions`` names the configs whose
forward the two frameworks compute differently although the export is right.
The vocab is padded to a multiple of 128 on purpose, so the export's trimming is exercised.
Weights are Megatron's own init, then perturbed per parameter (norm weights away from 1, biases away
from 0) so a swapped or dropped tensor changes the logits.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from facts import log

__all__ = [
    "init_parallel",
    "megatron_config",
    "build_megatron",
    "perturb_",
    "megatron_logits",
    "MOE_FORMATS",
    "padded_vocab",
    "megatron_version",
    "allow_cpu_forward",
    "oracle_device",
    "forward_conditions",
    "ORACLE_OVERRIDES",
    "mla_core_attention",
    "FRONTIER_TYPES",
    "build_frontier",
]

#: Expert formats to try, in order; those that cannot be built here are reported as skips.
MOE_FORMATS = ("local/sequential", "local/grouped", "te/grouped")


def megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001
        return "?"


def init_parallel(device: str) -> None:
    """A 1-rank default process group (nccl on CUDA, gloo on CPU) and TP1/PP1 Megatron state."""
    if not dist.is_initialized():
        # one rank: an in-process store, so parallel parts never race for a port
        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
        )
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if device.startswith("cuda"):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    return -(-vocab // multiple) * multiple


def megatron_config(hf_config: Any, *, dtype: torch.dtype, cpu: bool, init: bool = True) -> Any:
    """The ``TransformerConfig`` of ``hf_config`` from weightsync's one builder
    (``weightsync.plugins.testbed.megatron.megatron_config``: the family table the CLI builds from and
    ``MegatronSource`` checks against), so this oracle tests that table's mapping -- if a family
    field were mapped wrong, Megatron's forward would not be transformers'. On top of it only what
    this oracle needs of a forward (``ORACLE_OVERRIDES``): no dropout, no fused kernels, fp32
    attention softmax and router, no load-balancing loss. ``forward_conditions`` refuses, naming the
    field, the configs the two frameworks compute differently although the export is right."""
    from weightsync.plugins.testbed.megatron import MegatronParallel
    from weightsync.plugins.testbed.megatron import megatron_config as builder_config

    forward_conditions(hf_config)
    overrides = dict(
        ORACLE_OVERRIDES,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu,
        perform_initialization=init,
    )
    config = builder_config(hf_config, MegatronParallel(), dtype, overrides=overrides)
    if getattr(config, "num_moe_experts", None):
        config.moe_router_dtype = "fp32"  # transformers' routers run in fp32
        config.moe_router_load_balancing_type = "none"
        config.moe_aux_loss_coeff = 0.0
    return config


#: ``TransformerConfig`` fields this oracle sets for a deterministic, unfused fp32-faithful forward.
ORACLE_OVERRIDES: dict[str, Any] = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    apply_query_key_layer_scaling=False,
    attention_softmax_in_fp32=True,
    apply_rope_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    init_method_std=0.02,
)


def forward_conditions(c: Any) -> None:
    """Raise ``ValueError`` naming the fields for a config whose forward megatron-core computes
    differently from transformers although the weights (and so the export) are the same -- this
    oracle compares logits, so it cannot take them. These are not refusals of the family: the
    builder builds and ``MegatronSource`` exports such models.

    DeepSeek-V3 (multi-latent attention):

    * transformers' ``q_a_layernorm`` / ``kv_a_layernorm`` use eps 1e-6 whatever ``rms_norm_eps``
      is, Megatron one ``layernorm_epsilon`` for every norm: the two agree only at 1e-6.
    * Megatron's group-limited routing scores a group by the sum of its top ``topk // group_topk``
      experts, transformers' by its top 2: equal only when ``num_experts_per_tok // topk_group == 2``
      (DeepSeek-V3: 8 // 4).
    * Megatron's sigmoid router always renormalises the top-k probabilities (``norm_topk_prob``).

    GLM-4.5 (``Glm4MoeConfig``): the same router, so the same two routing conditions (the group
    rule only matters when some groups are dropped, ``topk_group < n_group``).

    GPT-OSS (``GptOssConfig``): megatron's ``quick_gelu`` is ``x * sigmoid(1.702 x)`` (transformers:
    ``swiglu_alpha``); only the default rope and YaRN with its derived attention factor are mapped.
    """
    name = type(c).__name__
    if name == "DeepseekV3Config":
        problems = {
            "rms_norm_eps": c.rms_norm_eps == 1e-6,
            "num_experts_per_tok // topk_group": c.num_experts_per_tok // c.topk_group == 2,
            "norm_topk_prob": bool(c.norm_topk_prob),
        }
    elif name == "GptOssConfig":
        rope = getattr(c, "rope_parameters", None) or {}
        problems = {
            "swiglu_alpha": getattr(c, "swiglu_alpha", 1.702) == 1.702,  # transformers < 5.20: fixed 1.702
            "rope_parameters.rope_type": rope.get("rope_type", "default") in ("default", "yarn"),
            "rope_parameters.attention_factor": rope.get("attention_factor") is None,
        }
    elif name == "Glm4MoeConfig":
        problems = {
            "num_experts_per_tok // topk_group": c.topk_group == c.n_group or c.num_experts_per_tok // c.topk_group == 2,
            "norm_topk_prob": bool(c.norm_topk_prob),
        }
    else:
        return
    bad = [k for k, ok in problems.items() if not ok]
    if bad:
        raise ValueError(f"{name}: Megatron's forward differs from transformers' for {bad}")


def _layer_spec(config: Any, moe_format: str) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    num_experts = getattr(config, "num_moe_experts", None)
    backend, _, experts = moe_format.partition("/")
    if getattr(config, "multi_latent_attention", False):
        if moe_format != "local/sequential":
            raise ValueError(f"MLA oracle: only the local spec with SequentialMLP, not {moe_format!r}")
        return _mla_block_spec(config)
    grouped = experts == "grouped"
    if backend == "te":
        import transformer_engine  # noqa: F401  (raises here, reported as a skip, when absent)
    freq = getattr(config, "moe_layer_freq", 1)
    if num_experts and not isinstance(freq, int) and not all(freq):
        # dense layers among MoE layers (GLM-4.5's first_k_dense_replace): megatron's decoder-block
        # spec builds each layer as moe_layer_freq says, as the builder does
        config.moe_grouped_gemm = grouped
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te",
                                                normalization="RMSNorm")
    if backend == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped, qk_layernorm=config.qk_layernorm
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=grouped, qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )


def mla_core_attention() -> type:
    """megatron-core's own local ``DotProductAttention``, accepting the ``k_channels`` /
    ``v_channels`` that ``MLASelfAttention`` passes its core attention. Without Transformer Engine
    the stock local spec cannot build MLA at all (0.16 and 0.19: ``DotProductAttention`` takes no
    such arguments); its forward is shape-generic except the output width, which is heads x
    ``v_channels``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLACoreAttention


def _mla_block_spec(config: Any) -> Any:
    """megatron-core's local decoder-block spec for ``config`` (MLA; dense layers where
    ``moe_layer_freq`` says 0), with ``mla_core_attention()`` as every layer's core attention.

    megatron-core 0.16 without Transformer Engine sets ``HAVE_TE`` in ``multi_latent_attention``
    although its ``TELinear`` is a stand-in, not a class, so building ``MLASelfAttention`` fails on
    ``isinstance``; 0.19 reads ``HAVE_TE`` from the extension and is False. Only then is the flag
    set to False here (it guards FP8/FP4-only code)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    core = mla_core_attention()
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention.submodules
        attn.core_attention = core
        if config.q_lora_rank is None:  # no q latent to normalise; 0.19 refuses a norm it would not use
            attn.q_layernorm = IdentityOp
    return spec


def experts_class(model: torch.nn.Module) -> str | None:
    """The class name of the first MoE experts module, or None for a dense model."""
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            return type(mod).__name__
    return None


def build_megatron(
    hf_config: Any,
    *,
    dtype: torch.dtype,
    device: str,
    moe_format: str = "local/sequential",
    seed: int = 0,
    perturb: bool = True,
    init: bool = True,
) -> torch.nn.Module:
    """A TP1 ``GPTModel`` of ``hf_config`` on ``device`` (``init_parallel`` first)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from weightsync.sources.toolkit import family_for

    if getattr(hf_config, "model_type", None) in FRONTIER_TYPES:
        return build_frontier(hf_config, dtype=dtype, device=device, seed=seed, perturb=perturb)
    cpu = not device.startswith("cuda")
    config = megatron_config(hf_config, dtype=dtype, cpu=cpu, init=init)
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(config, moe_format),
        vocab_size=padded_vocab(hf_config.vocab_size),
        pre_process=True,
        post_process=True,
        # the family's GPTModel arguments (tied embeddings, rope base and fraction), as the builder's
        **{k: f.value for k, f in family_for(hf_config).gpt_model_fields(hf_config).items()},
    )
    model = model.to(device=device).eval()
    if perturb:
        perturb_(model, seed=seed + 1)
    return model


#: model types built by ``build_frontier`` (the one builder's hybrid gated-delta-net block and DSA spec).
FRONTIER_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v32", "glm_moe_dsa")


def build_frontier(
    hf_config: Any,
    *,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    perturb: bool = True,
    fla: bool = False,
    overrides: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """A TP1 ``GPTModel`` of a frontier family (``FRONTIER_TYPES``) from weightsync's one builder
    (``weightsync.plugins.testbed.megatron.build_megatron_gpt``: the local-spec hybrid block of
    ``GatedDeltaNet`` and gated attention, or MLA with megatron's ``DSAttention`` / ``DSAIndexer``),
    with ``ORACLE_OVERRIDES`` and ``init_method_std`` 0.1 (sharper attention, routing and indexer
    scores, so a mistake shows), built on the CPU (``use_cpu_initialization``) and moved to
    ``device``. Gated delta net: ``deterministic_mode`` (megatron's torch chunked delta rule and
    conv1d) unless ``fla`` (flash-linear-attention's Triton kernels, megatron's default path). MoE:
    fp32 router, no load-balancing loss, as ``megatron_config``. Rebuilds megatron's parallel state
    (TP1) over the default process group. ``perturb``: norms / biases off 1 / 0 per global name
    (``tests/megatron_worlds.randomize_norms_and_biases``) and the routers' expert bias random."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import mla_models as mm

    from weightsync.plugins.testbed.megatron import MegatronParallel, build_megatron_gpt

    over = dict(ORACLE_OVERRIDES, init_method_std=0.1, **(overrides or {}))
    if hf_config.model_type.startswith("qwen3"):
        over.setdefault("deterministic_mode", not fla)
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None):
        over.update(moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    build = mm.build_megatron if perturb else build_megatron_gpt
    (model,) = build(hf_config, MegatronParallel(), seed=seed, dtype=dtype, overrides=over)
    if device.startswith("cuda"):
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    return model.to(device=device).eval()


@torch.no_grad()
def perturb_(model: torch.nn.Module, *, seed: int) -> None:
    """Give every parameter distinctive values, deterministically (CPU generator, sorted names):
    matrices N(0, 0.02) ... N(0, 0.05), norm weights 1 + N(0, 0.1), other vectors N(0, 0.05);
    then the routers' expert-bias buffers (DeepSeek) N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() >= 2:
            v = torch.randn(p.shape, generator=g) * 0.03
        elif "norm" in name:
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            v = 0.05 * torch.randn(p.shape, generator=g)
        p.copy_(v.to(p.dtype))
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("router.expert_bias"):  # DeepSeek's score-correction bias: moves routing
            b.copy_((0.1 * torch.randn(b.shape, generator=g)).to(b.dtype))


def allow_cpu_forward() -> None:
    """Dry run only: megatron-core's local-spec forward is CPU-clean except that rotary embedding
    moves ``inv_freq`` to ``torch.cuda.current_device()``, attention forks the CUDA RNG tracker and
    the unfused softmax allocates its own masks on "cuda" (sliding-window layers, or no mask given);
    point the first at the CPU, make the second a no-op and build the masks on the CPU, in this
    process. (``megatron_logits`` passes the causal mask explicitly on CPU as well.)"""
    if torch.cuda.is_available():
        return
    import contextlib

    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # Attention forks the CUDA RNG for dropout (0 here); there is no CUDA RNG on CPU.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # megatron-core 0.16's router reads an undefined ``te_general_gemm`` without Transformer
    # Engine (0.19 defines it as None); give it the value 0.19 has.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The masks megatron's unfused softmax builds itself (a sliding window always; causal without a
    # mask) are allocated on "cuda": the same masks on the CPU.
    from megatron.core.fusions import fused_softmax

    def sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def oracle_device(dry_run: bool, facts: Any) -> str | None:
    """Set up a Megatron-vs-transformers oracle part's process and return its device: CUDA with
    TF32 off (the fp32 comparison must be fp32 on both sides), or for a dry run the CPU with
    ``allow_cpu_forward``; then ``init_parallel``. None, with a failed check recorded in ``facts``,
    when that is impossible."""
    device = "cpu" if dry_run else "cuda:0"
    if not dry_run:
        if not torch.cuda.is_available():
            facts.check("CUDA available", False, "no CUDA device; use --dry-run on CPU")
            return None
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        allow_cpu_forward()
    log(f"[{facts.part}] megatron-core {megatron_version()} torch {torch.__version__}")
    try:
        init_parallel(device)
    except Exception as e:  # noqa: BLE001
        facts.error("init_parallel", e)
        return None
    return device


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Megatron's own forward (on CUDA ``attention_mask=None``: the causal mask comes from the layer
    spec; on CPU an explicit causal mask, True = masked), logits ``[b, s, vocab]`` with the padding
    columns dropped, float32."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    mask = None
    if ids.device.type == "cpu":
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    out = model(ids, pos, attention_mask=mask)
    if out.shape[0] == s and out.shape[1] == b:  # [s, b, v] in some versions
        out = out.transpose(0, 1)
    return out[..., :vocab].float()


def describe(model: torch.nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__} params={n} experts={experts_class(model)}"


def log_env() -> None:
    log(f"megatron-core {megatron_version()}")
