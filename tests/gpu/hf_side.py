"""The transformers side of the GPU evidence: configs, models, a strict receiver, logits.

Invariants:
* ``HFReceiver.load_weights`` is strict: a name that is not a checkpoint name of the model raises
  (naming it), a shape or dtype that differs raises, and ``missing()`` lists every parameter that
  was not fully written. So "the receiver's logits equal the trainer's" cannot pass by a silent
  partial load.
* Checkpoint names are what ``save_pretrained`` writes. transformers 5 fuses MoE experts in memory
  (``mlp.experts.gate_up_proj`` [E, 2I, H], gate first; ``mlp.experts.down_proj`` [E, H, I]) while
  the checkpoint has per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the receiver
  accepts both spellings, exactly like vLLM's loaders do.
* Configs are tiny for correctness and Qwen3-1.7B-shaped for the benchmark; every family sets the
  knobs the Megatron side must mirror (rope theta, RMSNorm eps, GQA, qk-norm, qkv bias, tying).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "FRONTIER",
    "tiny_config",
    "bench_config",
    "build_hf",
    "HFReceiver",
    "fixed_batch",
    "hf_logits",
    "compare_logits",
    "digest",
    "saved_digests",
    "checkpoint_layout",
]

#: family -> (config class name, model class name)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # the frontier families (issue 27): tiny configs are weightsync's CLI presets (``FRONTIER``)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}

#: family -> the ``weightsync.plugins.testbed.presets`` preset its tiny config is (gated delta net hybrids,
#: DSA), with overrides: the DSA configs take ``rms_norm_eps=1e-6`` because megatron's indexer
#: ``k_norm`` uses ``layernorm_epsilon`` and transformers' a fixed 1e-6 (docs/families.md).
FRONTIER = {
    "qwen3_next": ("tiny-qwen3-next", {}),
    "qwen3_5_text": ("tiny-qwen3.5", {}),
    "qwen3_5_moe_text": ("tiny-qwen3.5-moe", {}),
    "deepseek_v32": ("tiny-deepseek-v32", {"rms_norm_eps": 1e-6}),
    "glm_moe_dsa": ("tiny-glm5", {"rms_norm_eps": 1e-6}),
}


def _classes(family: str) -> tuple[type, type]:
    import transformers

    cfg_name, model_name = FAMILIES[family]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def tiny_config(family: str, *, layers: int = 2, **overrides: Any) -> Any:
    """A small config of ``family`` whose every feature differs from the defaults somewhere
    (``FRONTIER`` families: weightsync's tiny preset, ``overrides`` applied):
    vocab not a multiple of 128 (Megatron pads it), rope theta and eps not the defaults,
    GQA (4 heads, 2 groups), head_dim not hidden/heads. ``overrides`` (DeepSeek-V3 only, e.g.
    ``q_lora_rank=None``) replace fields of the family's config."""
    if family in FRONTIER:
        from transformers import AutoConfig

        from weightsync.plugins.testbed.presets import PRESETS

        preset, over = FRONTIER[family]
        kw = {**PRESETS[preset], **over, **overrides}
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        cfg.architectures = [FAMILIES[family][1]]
        return cfg
    if overrides and family != "deepseek_v3":
        raise TypeError(f"tiny_config({family!r}): overrides are for deepseek_v3 only, got {sorted(overrides)}")
    cfg_cls, _ = _classes(family)
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        hidden_act="silu",
    )
    if family == "qwen3":
        return cfg_cls(**common, head_dim=80, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                       tie_word_embeddings=True, attention_bias=False)
    if family == "llama":
        return cfg_cls(**common, head_dim=64, rms_norm_eps=1e-5, rope_theta=500_000.0,
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if family == "qwen2":
        # Qwen2 attention always has q/k/v biases and no o_proj bias.
        return cfg_cls(**common, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return cfg_cls(**common, head_dim=64, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                       tie_word_embeddings=False, attention_bias=False, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    if family == "deepseek_v3":
        # MLA with every dimension distinct (q_lora 96, kv_lora 64, nope 32, rope 16, v 48), one
        # dense layer first, then MoE layers: 16 routed experts in 4 groups (top-4 from the best
        # 2 groups), 2 shared experts' worth of shared MLP, score-correction bias. rms_norm_eps
        # 1e-6: transformers' MLA norms use 1e-6 whatever the config says.
        kw = dict(common, num_hidden_layers=max(layers, 3), num_key_value_heads=4,
                  q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=48, moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=2,
                  num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
                  rope_theta=50_000.0, rope_interleave=True, tie_word_embeddings=False,
                  attention_bias=False)
        kw.update(overrides)
        return cfg_cls(**kw)
    if family == "glm4_moe":
        # GLM-4.5: partial rotary (40 of each 80-wide head), q/k/v biases, q/k norms, one dense
        # layer first, then 16 routed experts in 4 groups (top-4 from the best 2 groups: the group
        # rule both frameworks compute alike), one shared expert, score-correction bias, routed
        # scaling factor.
        return cfg_cls(**dict(common, num_hidden_layers=max(layers, 3)), head_dim=80,
                       partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                       moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=1,
                       num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                       routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5,
                       rope_theta=1_000_000.0, tie_word_embeddings=False)
    if family == "gpt_oss":
        # GPT-OSS: sinks, q/k/v/o biases, sliding-window (8) and full layers alternating, YaRN rope
        # (transformers' defaults: factor 32 over 4096), 8 biased experts held fused / transposed /
        # gate-up interleaved, a biased router; the batch (24 tokens) is longer than the window.
        return cfg_cls(**dict(common, intermediate_size=384, max_position_embeddings=131072), head_dim=80,
                       num_local_experts=8, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)
    raise KeyError(family)


def bench_config() -> Any:
    """Qwen3-1.7B's shapes (random weights): hidden 2048, 28 layers, 16 heads, 8 kv heads,
    head_dim 128, ffn 6144, vocab 151936, tied embeddings."""
    cfg_cls, _ = _classes("qwen3")
    return cfg_cls(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                   tie_word_embeddings=True, hidden_act="silu")


def family_of(config: Any) -> str:
    for fam, (cfg_name, _) in FAMILIES.items():
        if type(config).__name__ == cfg_name:
            return fam
    raise KeyError(type(config).__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_hf(config: Any, *, device: str | torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A transformers causal LM of ``config``, initialized on ``device`` in ``dtype`` with ``seed``,
    eager attention (the closest to Megatron's unfused softmax), in eval mode.

    Parameters are created in ``dtype`` (default-dtype context, as ``from_pretrained(dtype=...)``
    does); buffers keep the dtype the model gives them -- ``module.to(bf16)`` would also round
    RoPE's fp32 ``inv_freq`` to bf16, which Megatron never does."""
    _, model_cls = _classes(family_of(config))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model.eval()


def fsdp2_copy(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` under FSDP2 on a 1-rank mesh of ``device``'s type: ``fully_shard`` per
    decoder layer and at the root (the layout every GPU bench times against the plain model)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cuda" if str(device).startswith("cuda") else "cpu", (1,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return sharded


def saved_digests(model: torch.nn.Module) -> dict[str, str]:
    """``{name: digest}`` of what transformers' ``save_pretrained`` writes for ``model`` (its own
    dtypes; per-expert names for fused in-memory experts), read back from the files."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, str] = {}
        for fn in sorted(os.listdir(d)):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(d, fn), "pt") as f:
                    out.update({k: digest(f.get_tensor(k)) for k in f.keys()})
    return out


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes plus its dtype and shape: equal iff bit-identical."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()[:32]


_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")


class HFReceiver:
    """A transformers model behind vLLM's receiving interface, ``load_weights(iterable)``.

    Each received ``(name, tensor)`` is copied into the model's own storage (``state_dict()[name]``
    or, for per-expert names, the slice of the fused expert tensor); nothing is kept from the wire.
    ``track=True`` records a digest of every received tensor, in arrival order.
    """

    def __init__(self, model: torch.nn.Module, *, track: bool = True) -> None:
        self.model = model
        self.track = track
        self._sd = model.state_dict(keep_vars=True)
        # named_parameters() drops tied duplicates: these are the storages that must be written.
        self._targets = {n: p for n, p in model.named_parameters()}
        self.reset()

    def reset(self) -> None:
        self.received: list[tuple[str, str]] = []
        self._written: dict[str, int] = {}

    def _dest(self, name: str) -> tuple[str, torch.Tensor]:
        if name in self._sd:
            return name, self._sd[name]
        m = _EXPERT.match(name)
        if m and f"{m['prefix']}.gate_up_proj" in self._sd:
            e = int(m["e"])
            if m["w"] == "down_proj":
                key = f"{m['prefix']}.down_proj"
                return key, self._sd[key][e]
            key = f"{m['prefix']}.gate_up_proj"
            fused = self._sd[key][e]
            half = fused.shape[0] // 2
            return key, fused[:half] if m["w"] == "gate_proj" else fused[half:]
        raise KeyError(
            f"receiver: {name!r} is not a checkpoint name of {type(self.model).__name__} "
            f"(e.g. {sorted(self._sd)[:3]} ...)"
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, t in weights:
            key, dst = self._dest(name)
            if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
                raise ValueError(
                    f"receiver: {name!r} arrived as {t.dtype} {tuple(t.shape)}, the model holds "
                    f"{dst.dtype} {tuple(dst.shape)}"
                )
            dst.copy_(t)
            if self.track:
                self.received.append((name, digest(t)))
            self._written[key] = self._written.get(key, 0) + t.numel()
            loaded.add(name)
        return loaded

    def missing(self) -> list[str]:
        """Parameters not fully written since the last ``reset()``."""
        return [n for n, p in self._targets.items() if self._written.get(n, 0) < p.numel()]

    @torch.no_grad()
    def checksums(self) -> dict[str, float]:
        """fp64 sum per parameter (cheap, on device): for the benchmark's spot check."""
        return {n: float(p.double().sum().item()) for n, p in self._targets.items()}


def fixed_batch(vocab: int, *, batch: int = 2, seq: int = 24, seed: int = 1234,
                device: str | torch.device = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def compare_logits(got: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> dict[str, Any]:
    """max |got-ref| relative to max |ref|, top-1 agreement, bit equality and, with ``tol``, the
    fraction of positions whose own max error is within ``tol`` (MoE routing can flip a near-tie
    between two implementations in bf16; that moves a few positions, not all)."""
    got = got.float().cpu()
    ref = ref.float().cpu()
    if got.shape != ref.shape:
        return {"shape_equal": False, "got_shape": tuple(got.shape), "ref_shape": tuple(ref.shape),
                "rel_err": float("inf"), "max_abs": float("inf"), "top1": 0.0, "bitwise": False}
    diff = (got - ref).abs()
    scale = ref.abs().max().clamp_min(1e-6)
    extra = {}
    if tol is not None:
        per_pos = diff.amax(-1) / scale
        extra["pos_within_tol"] = float((per_pos <= tol).float().mean())
    return {
        **extra,
        "shape_equal": True,
        "max_abs": float(diff.max()),
        "rel_err": float(diff.max() / scale),
        "top1": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "bitwise": bool(torch.equal(got, ref)),
        "finite": bool(torch.isfinite(got).all() and torch.isfinite(ref).all()),
    }


def checkpoint_layout(config: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The oracle for exported names, dtypes and shapes: what transformers' own ``save_pretrained``
    writes for ``config`` (a CPU model, float32 on disk, read back with safetensors)."""
    from safetensors import safe_open

    model = build_hf(config, device="cpu", dtype=torch.float32, seed=0)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for fn in sorted(os.listdir(d)):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(d, fn), "pt") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out
