"""A megatron-core ``GPTModel`` for a transformers config, built on CPU ranks (``weightsync check``).

Invariant: the model has exactly the parameters -- names, TP/PP/VPP/EP shards, shapes -- that a
megatron-core trainer of the same config would hold (local spec, ``use_cpu_initialization=True``),
so ``MegatronSource`` over it declares and streams what it would over a real trainer. Values are
megatron's random init until ``load_hf_weights`` lays a Hugging Face checkpoint's tensors into it
(the CLI does, so that a preset is the same model in every layout).

Why each CPU concession is safe:

* MoE layers use the ``allgather`` token dispatcher: the others allocate CUDA buffers at
  construction. The dispatcher decides how tokens move in forward, not which parameters exist.
* ``torch.Tensor.cuda`` is the identity during construction: with tied embeddings under PP,
  ``GPTModel`` moves the shared weight with ``.cuda()`` before its first/last-stage all-reduce.
* ``torch.cuda.current_device`` / ``synchronize`` answer for the CPU during construction (the
  router's expert bias is allocated on the current device). Both are restored afterwards, and
  nothing is patched on a host with CUDA.

Multi-head latent attention (``deepseek_v3``: ``MLATransformerConfig``, the local spec with
``multi_latent_attention=True``) needs two more, on any host without Transformer Engine:

* ``MLACoreAttention`` replaces the spec's core attention: megatron-core's local
  ``DotProductAttention`` (0.16 and 0.19) does not accept MLA's different q/k and v head dims
  (``k_channels`` / ``v_channels``), only TE's does. Core attention has no parameters, so the
  parameters ``MegatronSource`` sees are megatron's own; it computes causal softmax attention with
  megatron's ``softmax_scale``, so the model also runs forward (CPU or GPU).
* megatron-core 0.16 compares ``linear_proj`` against ``TELinear`` with ``isinstance``; without TE
  that name is a mock, so it is a placeholder class during construction.

megatron-core 0.17+ cannot build MLA without ``q_lora_rank`` from the local spec (its
``QKNormConfigResolver`` then wants TE's fused norm + ``linear_q_proj``, a norm DeepseekV3 does not
have): that raises ``ValueError`` here; megatron-core 0.16 builds it.

Gated-delta-net hybrids (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``) are assembled layer
by layer from local-spec pieces (``_hybrid_spec``: megatron's own hybrid block spec asserts TE) with
zero-centered RMSNorms (``ZeroCenteredRMSNorm``: what TE computes under
``layernorm_zero_centered_gamma``, which the local spec refuses); ``GatedDeltaNet`` is constructed
without flash-linear-attention and, on CPU ranks, without the CUDA RNG tracker (``_gdn_construction``).

Supported: dense llama / mistral / qwen2 / qwen3, MoE qwen3_moe / qwen2_moe (shared expert + gate)
/ mixtral / glm4_moe (partial rotary: ``rotary_percent``), MLA + MoE deepseek_v3 (first-k dense
layers, shared experts, sigmoid group-limited routing with ``e_score_correction_bias``) and gpt_oss
(attention sinks as ``softmax_type="learnable"``, alternating sliding-window attention, clamped
SwiGLU as ``quick_gelu`` + ``glu_linear_offset`` + ``activation_func_clamp_value``, biases
everywhere: MoE at expert_tensor_parallel_size 1, the only size megatron-core supports MoE biases
at; YaRN rope as ``GPTModel``'s ``position_embedding_type="yarn"`` with its ``yarn_*`` config
attributes). Other families raise ``ValueError`` naming ``model_type``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.sources.toolkit import family_for, get_logger, model_types

__all__ = [
    "MegatronParallel",
    "MLACoreAttention",
    "SUPPORTED_MODEL_TYPES",
    "build_chunks",
    "build_megatron_gpt",
    "load_hf_weights",
    "megatron_config",
]

logger = get_logger(__name__)

#: every family in ``weightsync.sources.families`` (one module each: dense llama / mistral / qwen2 /
#: qwen3, MoE qwen3_moe / qwen2_moe / mixtral, MLA deepseek_v3).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = model_types()

#: megatron's default ``make_vocab_size_divisible_by``: vocabulary rows are padded to a multiple
#: of this times TP (``MegatronSource`` trims them back to ``vocab_size``).
VOCAB_DIVISIBLE_BY = 128


class MegatronParallel:
    """Sizes of the parallel layout (``vpp=None``: no virtual pipeline)."""

    def __init__(self, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1) -> None:
        self.tp, self.pp, self.vpp, self.ep = tp, pp, vpp, ep

    def __repr__(self) -> str:
        return f"tp{self.tp} pp{self.pp} vpp{self.vpp or 1} ep{self.ep}"


def _family(hf: Any) -> Any:
    """The family table of ``hf`` (``weightsync.sources.families``), or ``ValueError``."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={mt!r}: no CPU Megatron builder for it (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return family_for(hf, check=False)


def megatron_config(
    hf: Any, par: MegatronParallel, dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None
) -> Any:
    """The megatron-core ``TransformerConfig`` a trainer would use for transformers config ``hf``:
    its family's table (``Family.megatron_fields``, the one ``MegatronSource`` checks a model
    against) plus the parallel sizes, ``dtype`` and this builder's CPU choices. ``overrides``: fields
    to set differently (oracle knobs, or a variant that must be refused)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    family = _family(hf)
    fields = _fields(hf)
    if isinstance(fields.get("activation_func"), str):
        fields["activation_func"] = _activation(fields["activation_func"])
    build: dict[str, Any] = {}
    if fields.get("num_moe_experts"):
        build.update(
            moe_token_dispatcher_type="allgather",  # the others allocate CUDA buffers at construction
            moe_grouped_gemm=False,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=_expert_tp(hf, par),
        )
    mla = family.attention == "mla"
    if mla:  # no TE here; megatron refuses fused rope for rope_type="rope"
        build.update(transformer_impl="local", apply_rope_fusion=False)
    if fields.get("experimental_attention_variant") == "gated_delta_net":
        build.update(transformer_impl="local")
    base = dict(
        activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        sequence_parallel=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    cls = MLATransformerConfig if mla else TransformerConfig
    every = {**base, **fields, **build, **(overrides or {})}
    # GPTModel reads its YaRN settings as plain config attributes (``yarn_*``), not dataclass fields
    known = {f.name for f in dataclasses.fields(cls)}
    extra = {k: every.pop(k) for k in list(every) if k.startswith("yarn_") and k not in known}
    config = cls(**every)
    for k, v in extra.items():
        setattr(config, k, v)
    return config


def _fields(hf: Any) -> dict[str, Any]:
    """The family table's ``TransformerConfig`` values for ``hf`` (``ValueError`` if unbuildable)."""
    family = _family(hf)
    why = family.unbuildable(hf)
    if why:
        raise ValueError(why)
    return {k: f.value for k, f in family.megatron_fields(hf).items()}


def _expert_tp(hf: Any, par: MegatronParallel) -> int:
    """The expert tensor-parallel size: the TP size, but 1 for MoE layers with biases
    (``add_bias_linear``: megatron-core supports MoE biases at expert_tensor_parallel_size=1 only)."""
    fields = _fields(hf)
    return 1 if fields.get("num_moe_experts") and fields.get("add_bias_linear") else par.tp


def _activation(name: str) -> Callable[..., Any]:
    """The activation function a family table names (tables import neither torch nor megatron)."""
    if name == "silu":
        return torch.nn.functional.silu
    if name == "quick_gelu":  # x * sigmoid(1.702 x): GPT-OSS's gate activation
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    raise ValueError(f"no activation function {name!r} in the builder (silu, quick_gelu)")


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention for megatron's ``MLASelfAttention`` where only TE provides one.

    Takes megatron's ``[s, b, heads, d]`` query/key (q/k head dim ``qk_head_dim +
    qk_pos_emb_head_dim``) and value (``v_head_dim``) and returns ``[s, b, heads * v_head_dim]``,
    scaled by MLA's ``softmax_scale``. No parameters: it never changes what ``MegatronSource``
    exports. ``attention_mask`` follows megatron (True = masked); None means causal.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None, **_: Any) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("MLACoreAttention does not take packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        out = out.permute(2, 0, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm computing ``x * (1 + weight)`` (weight initialised to zero): what Transformer Engine's
    norms compute under ``layernorm_zero_centered_gamma=True``, which megatron-core's local spec
    (``WrappedTorchNorm``) refuses. A hybrid gated-delta-net model's norms are built from it -- one
    ``weight`` each, under the local spec's names -- so it holds the parameters a TE-trained
    Qwen3-Next / Qwen3.5 has and computes what they compute."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _hybrid_spec(mcfg: Any, vp: int | None) -> Any:
    """The local-spec block of a gated-delta-net hybrid (Qwen3-Next / Qwen3.5), assembled layer by
    layer as megatron-core's ``get_transformer_block_with_experimental_attention_variant_spec``
    does (which asserts Transformer Engine): ``linear_attention_freq`` 1 -> ``GatedDeltaNet``
    (``in_proj`` column-parallel, ``out_norm``, ``out_proj`` row-parallel: the spec
    ``get_gated_delta_net_module_spec`` builds with a backend whose norm is not fused), 0 -> the
    local spec's attention (gated by ``attention_output_gate``, q/k norms); dense or MoE MLP per
    ``moe_layer_freq``; every norm ``ZeroCenteredRMSNorm``; this pipeline stage's layers only."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    L = mcfg.num_layers
    if mcfg.num_moe_experts:
        plain = copy.copy(mcfg)  # megatron-core 0.19 asserts no experimental variant here: the MLP specs only
        plain.experimental_attention_variant = None
        base = get_gpt_decoder_layer_specs(plain, use_transformer_engine=False, normalization="RMSNorm")
    else:
        base = [get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")] * L
    freq = mcfg.linear_attention_freq
    pattern = [0 if (i + 1) % freq == 0 else 1 for i in range(L)] if isinstance(freq, int) else list(freq)
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear
        ),
    )
    layers = []
    for i in range(L):
        spec = copy.deepcopy(base[i])
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if pattern[i]:
            sub.self_attention = copy.deepcopy(gdn)
        else:
            sub.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        layers.append(spec)
    offset = get_transformer_layer_offset(mcfg, vp_stage=vp)
    n = get_num_layers_to_build(mcfg, vp_stage=vp)
    return TransformerBlockSubmodules(layer_specs=layers[offset : offset + n], layer_norm=ZeroCenteredRMSNorm)


class _NoForkTracker:
    """Stands in for megatron's CUDA RNG tracker when it holds no model-parallel state (CPU ranks):
    ``GatedDeltaNet.reset_parameters`` draws ``A_log`` inside ``tracker.fork()``; here it draws from
    torch's default generator (the builder seeds it)."""

    def fork(self, *a: Any, **k: Any) -> Any:
        return contextlib.nullcontext()


@contextlib.contextmanager
def _gdn_construction() -> Iterator[None]:
    """Two construction-only concessions for ``GatedDeltaNet`` (its parameters do not depend on
    them): ``__init__`` raises unless flash-linear-attention imports, which only its forward uses
    (Triton kernels); ``reset_parameters`` forks megatron's CUDA RNG tracker, which on CPU ranks
    holds no state. Both are restored afterwards."""
    import sys

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # the module whose globals __init__ / reset_parameters read: ssm/gated_delta_net.py (0.16),
    # ssm/gated_delta_net/common.py (0.19, where the layer became a package)
    g = sys.modules[GatedDeltaNet.reset_parameters.__module__]
    saved = getattr(g, "HAVE_FLA", True), g.get_cuda_rng_tracker
    g.HAVE_FLA = True
    if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
        g.get_cuda_rng_tracker = _NoForkTracker
    # 0.19 also binds the delta-rule kernel at construction (``_setup_variant_attrs``, asserted not
    # None): without fla, one that says so if called (``deterministic_mode`` binds megatron's torch one)
    v = sys.modules[GatedDeltaNet._setup_variant_attrs.__module__] if hasattr(GatedDeltaNet, "_setup_variant_attrs") else None
    kernel = getattr(v, "chunk_gated_delta_rule", False)
    if v is not None and kernel is None:
        v.chunk_gated_delta_rule = _no_fla_kernel
    try:
        yield
    finally:
        g.HAVE_FLA, g.get_cuda_rng_tracker = saved
        if v is not None and kernel is None:
            v.chunk_gated_delta_rule = kernel


def _no_fla_kernel(*a: Any, **k: Any) -> Any:
    raise RuntimeError(
        "this GatedDeltaNet was built without flash-linear-attention: its forward needs fla's "
        "chunk_gated_delta_rule (pip install flash-linear-attention), or deterministic_mode=True "
        "(megatron's torch implementation)"
    )


def _mla_spec(spec: Any, dsa: bool = False) -> Any:
    """``spec`` (a block spec or one layer spec) with ``MLACoreAttention`` as core attention, or
    (``dsa``) megatron-core's ``DSAttention`` holding its ``DSAIndexer`` as
    ``get_dsa_module_spec_for_backend`` assembles it -- with ``DuplicatedLinear`` where that asks
    the backend for ``linear()``, which the local spec provider does not have."""
    core: Any = MLACoreAttention
    if dsa:
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexer, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules,
        )
        from megatron.core.transformer.spec_utils import ModuleSpec

        norm = LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True)
        core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=ModuleSpec(
            module=DSAIndexer, submodules=DSAIndexerSubmodules(
                linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=norm,
                linear_weights_proj=DuplicatedLinear,
            ),
        )))
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.submodules.core_attention = core
    return spec


class DuplicatedLinear(torch.nn.Module):
    """A linear layer every TP rank holds whole (Transformer Engine's ``TELinear(parallel_mode=
    "duplicated")``, what megatron-core's DSA spec builds the indexer's projections from): one
    ``weight`` ``[out, in]``, no TP attributes, so ``dist_checkpointing`` saves it replicated."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable[..., Any],
                 bias: bool = False, skip_bias_add: bool = False, **_: Any) -> None:
        super().__init__()
        if bias:
            raise NotImplementedError("DuplicatedLinear holds no bias (the DSA indexer asks for none)")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


@contextlib.contextmanager
def _mla_without_te() -> Iterator[None]:
    """megatron-core 0.16 without TE: its ``isinstance(linear_proj, TELinear)`` gets a class."""
    import megatron.core.transformer.multi_latent_attention as mla

    saved = getattr(mla, "TELinear", None)
    if isinstance(saved, type) or not hasattr(mla, "TELinear"):
        yield
        return
    mla.TELinear = type("TELinearUnavailable", (), {})
    try:
        yield
    finally:
        mla.TELinear = saved


@contextlib.contextmanager
def _cpu_construction() -> Iterator[None]:
    """See the module docstring: CUDA calls megatron-core makes while constructing, on a CPU host."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize = saved


def build_megatron_gpt(
    hf: Any,
    par: MegatronParallel,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    spec_hook: Callable[[Any], Any] | None = None,
) -> list[torch.nn.Module]:
    """Initialize megatron's parallel state for ``par`` over the default process group (gloo is
    fine) and build this rank's ``GPTModel`` chunk(s) for ``hf``: one per virtual-pipeline stage,
    in order. The caller owns ``parallel_state`` afterwards (``destroy_model_parallel``).

    ``overrides`` sets ``TransformerConfig`` fields; ``spec_hook(spec) -> spec`` edits the layer
    spec before the build (both for tests that need a variant megatron-core can build but a
    trainer config of ``hf`` would not)."""
    from megatron.core import parallel_state as ps

    mcfg = megatron_config(hf, par, dtype, overrides)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=_expert_tp(hf, par) if mcfg.num_moe_experts else None,
    )
    torch.manual_seed(seed)
    return build_chunks(hf, mcfg, par, spec_hook=spec_hook)


def build_chunks(
    hf: Any,
    mcfg: Any,
    par: MegatronParallel,
    *,
    divisible_by: int = VOCAB_DIVISIBLE_BY,
    spec_hook: Callable[[Any], Any] | None = None,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) for ``hf`` and its config ``mcfg`` under the parallel state
    already initialized for ``par`` (``divisible_by``: megatron's ``make_vocab_size_divisible_by``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    multiple = divisible_by * par.tp
    vocab = int(math.ceil(hf.vocab_size / multiple) * multiple)
    chunks: list[torch.nn.Module] = []
    mla = bool(getattr(mcfg, "multi_latent_attention", False))
    hybrid = getattr(mcfg, "experimental_attention_variant", None) == "gated_delta_net"
    with _cpu_construction(), (_mla_without_te() if mla else contextlib.nullcontext()), (
        _gdn_construction() if hybrid else contextlib.nullcontext()
    ):
        for v in range(par.vpp or 1):
            vp = v if par.vpp else None
            if hybrid:
                spec = _hybrid_spec(mcfg, vp)
            elif mcfg.num_moe_experts:
                # megatron-core 0.19 asserts no experimental attention variant in the decoder-block
                # spec (0.16 ignores it): the MLP / MLA layer specs from a copy without it; DSA's
                # core attention is put in by _mla_spec below, and GPTModel gets the real config
                spec_cfg = mcfg
                if getattr(mcfg, "experimental_attention_variant", None) == "dsa":
                    spec_cfg = copy.copy(mcfg)
                    spec_cfg.experimental_attention_variant = None
                spec = get_gpt_decoder_block_spec(
                    spec_cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp
                )
            else:
                spec = get_gpt_layer_local_spec(
                    qk_layernorm=mcfg.qk_layernorm, multi_latent_attention=mla, normalization="RMSNorm"
                )
            if mla:
                spec = _mla_spec(spec, dsa=getattr(mcfg, "experimental_attention_variant", None) == "dsa")
            if spec_hook is not None:
                spec = spec_hook(spec)
            mtp: dict[str, Any] = {}
            if getattr(mcfg, "mtp_num_layers", None):  # multi-token prediction: megatron's own MTP block spec
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

                mtp_spec = get_gpt_mtp_block_spec(mcfg, spec, use_transformer_engine=False, vp_stage=vp)
                mtp = {"mtp_block_spec": mtp_spec} if mtp_spec is not None else {}
            chunks.append(
                GPTModel(
                    mcfg,
                    spec,
                    vocab_size=vocab,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                    **{k: f.value for k, f in _family(hf).gpt_model_fields(hf).items()},
                    vp_stage=vp,
                    **mtp,
                )
            )
    logger.info("built megatron GPTModel (%s, %s): %d chunk(s)", hf.model_type, par, len(chunks))
    return chunks


#: float32 holds every integer up to 2**24 exactly: the probe's ids per round.
_IDS_PER_ROUND = 2**24 - 1


def load_hf_weights(chunks: list[torch.nn.Module], hf: Any, state: dict[str, torch.Tensor] | None) -> None:
    """Collective (every rank of the default group): set this rank's ``GPTModel`` chunks to the Hugging
    Face checkpoint tensors ``state`` (checkpoint names, as ``save_pretrained`` writes them; needed on
    rank 0 only), laid out as Megatron holds them -- TP shards, QKV groups, GLU halves, PP stages,
    expert-parallel experts, vocabulary padding (zeros), the tied output copy.

    How: the layout is read off ``MegatronSource``'s own export instead of being written a second
    time. Every distinct Megatron element gets an id (copies of one tensor -- TP-replicated norms,
    data-parallel replicas, a last-stage tied output layer -- share their id); the chunks are filled
    with the ids and exported once (float32 holds ids below 2**24 exactly; larger models take more
    passes); where each id lands in the export is where its value comes from. It is checked: an id
    exported twice, or a non-padding element never exported, raises ``ValueError`` on every rank.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from weightsync.sources import MegatronSource

    targets = _probe_targets(chunks, hf)
    sizes = {key: t.numel() for key, _, t in targets}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sizes)
    offsets: dict[tuple, int] = {}
    total = 0
    for key in sorted({k for s in everyone for k in s}, key=repr):
        offsets[key] = total
        total += max(s[key] for s in everyone if key in s)
    rank0 = dist.get_rank() == 0
    where: dict[str, torch.Tensor] = {}  # rank 0: HF name -> id of each element (-1: none)
    saved = [t.detach().clone() for _, _, t in targets]
    shift: dict[str, float] = {}
    try:
        for base in range(0, max(total, 1), _IDS_PER_ROUND):
            with torch.no_grad():
                for key, _, t in targets:
                    ids = torch.arange(offsets[key], offsets[key] + t.numel(), dtype=torch.int64)
                    inside = (ids >= base) & (ids < base + _IDS_PER_ROUND)
                    t.copy_(torch.where(inside, ids - base + 1, 0).to(t.dtype).view(t.shape))
            source = MegatronSource(chunks if len(chunks) > 1 else chunks[0], hf_config=hf, mode="full")
            # kinds whose export adds a constant (a zero-centered norm HF stores uncentered)
            shift = {n: float(u.kind.shift) for u in source.plan if u.kind.shifts_values for n in u.names}
            for name, got in source.iter_full():
                if rank0:
                    v = (got.detach().reshape(-1) - shift.get(name, 0.0)).to(torch.int64)
                    found = torch.where(v > 0, v - 1 + base, -1)
                    where[name] = torch.maximum(where[name], found) if name in where else found
    finally:
        with torch.no_grad():
            for (_, _, t), before in zip(targets, saved):
                t.copy_(before)
    values = torch.full((total,), float("nan"), dtype=torch.float32)
    problem = ""
    if rank0:
        problem = _fill_values(values, where, state or {}, offsets, total, shift)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ValueError(f"rank {dist.get_rank()}: load_hf_weights: {box[0]}")
    dist.broadcast(values, src=0)
    with torch.no_grad():
        for key, vocab_rows, t in targets:
            v = values[offsets[key] : offsets[key] + t.numel()].view(t.shape)
            if vocab_rows:  # padding rows past the HF vocabulary: never exported
                v = torch.nan_to_num(v, nan=0.0)
            t.copy_(v.to(t.dtype))
    logger.info("laid out %d HF elements into %d local Megatron tensors (tp rank %d)", total, len(targets),
                ps.get_tensor_model_parallel_rank())


def _probe_targets(chunks: list[torch.nn.Module], hf: Any) -> list[tuple[tuple, bool, torch.Tensor]]:
    """``(key, is_vocab, tensor)`` for every local parameter and router expert-bias buffer; ``key`` is
    equal on every rank holding a copy of the same elements (the ranks it is split over are in it,
    the ranks it is replicated over are not)."""
    from megatron.core import parallel_state as ps

    from weightsync.sources.toolkit import tp_split_dim

    pp = ps.get_pipeline_model_parallel_rank()
    out: list[tuple[tuple, bool, torch.Tensor]] = []
    for v, chunk in enumerate(chunks):
        owner: dict[int, tuple[torch.nn.Module, str]] = {}
        for _, mod in chunk.named_modules():
            for attr, p in mod.named_parameters(recurse=False):
                owner.setdefault(id(p), (mod, attr))
        tied_copy = bool(getattr(chunk, "share_embeddings_and_output_weights", False)) and not chunk.pre_process
        for name, p in chunk.named_parameters():
            if name.startswith("mtp."):  # the MTP block (the draft) is no part of the policy checkpoint
                continue
            mod, attr = owner[id(p)]
            split = tp_split_dim(mod, attr, p) is not None
            expert = ".experts." in f".{name}"
            if expert:
                tp = ps.get_expert_tensor_parallel_rank() if split else None
                key: tuple = (pp, v, name, tp, ps.get_expert_model_parallel_rank())
            else:
                key = (pp, v, name, ps.get_tensor_model_parallel_rank() if split else None)
            if (tied_copy and name == "output_layer.weight") or (
                not chunk.pre_process and name == "embedding.word_embeddings.weight"
            ):  # the last stage's copy of the tied embedding, or an MTP stage's embedding copy
                # (megatron keeps them equal to the first stage's)
                key = (0, 0, "embedding.word_embeddings.weight", ps.get_tensor_model_parallel_rank())
            vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            out.append((key, vocab, p))
        for name, b in chunk.named_buffers():
            if name.endswith("router.expert_bias") and not name.startswith("mtp."):
                out.append(((pp, v, name), False, b))
    return out


def _fill_values(
    values: torch.Tensor, where: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
    offsets: dict[tuple, int], total: int, shift: dict[str, float] | None = None,
) -> str:
    """Rank 0: ``values[id] = state[name].flat[i]`` for every exported element; the first problem in
    words ('' when none)."""
    seen = torch.zeros(total, dtype=torch.int32)
    for name, ids in where.items():
        if name not in state:
            return f"the export has {name!r}, the HF checkpoint does not"
        flat = state[name].detach().reshape(-1).to(torch.float32) - (shift or {}).get(name, 0.0)
        if flat.numel() != ids.numel():
            return f"{name!r}: the export has {ids.numel()} elements, the HF checkpoint {flat.numel()}"
        ok = ids >= 0
        if not bool(ok.all()):
            return f"{name!r}: {int((~ok).sum())} exported elements carry no Megatron id"
        values[ids] = flat
        seen.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    missing = sorted(set(state) - set(where))
    if missing:
        return f"HF checkpoint tensors the export does not have: {missing[:5]}"
    ends = sorted(offsets.items(), key=lambda kv: kv[1])
    for j, (key, start) in enumerate(ends):
        stop = ends[j + 1][1] if j + 1 < len(ends) else total
        counts = seen[start:stop]
        if bool((counts > 1).any()):
            return f"Megatron tensor {key} has elements exported twice (a split tensor taken for a copy)"
        vocab = "word_embeddings" in key[2] or "output_layer" in key[2]  # padding rows are never exported
        if not vocab and bool((counts == 0).any()):
            return f"Megatron tensor {key} has {int((counts == 0).sum())} elements never exported"
    return ""
