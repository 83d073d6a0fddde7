"""Helpers for the Megatron tests: tiny HF configs per family, Megatron models built on CPU, and a
test-only HF -> Megatron importer.

The importer writes Megatron's fused layouts *by index* (which row of ``linear_qkv`` is which head,
which rows of a ``linear_fc1`` shard are gate), independently of ``sources/core/layouts/tp.py``; megatron-core
ships no HF importer. Its last word is the GPU logits check (another issue); on CPU the layout is
also checked against Megatron's own ``get_query_key_value_tensors`` (test_megatron.py).
"""

from __future__ import annotations

import math
import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def hf_config(family: str, *, layers: int = 4, vocab: int = 250, tied: bool = False, **over):
    """A tiny transformers config of ``family`` (GQA: 4 heads, 2 kv heads)."""
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    common.update(over)
    cls, arch = {
        "llama": (tf.LlamaConfig, "LlamaForCausalLM"),
        "qwen2": (tf.Qwen2Config, "Qwen2ForCausalLM"),
        "qwen3": (tf.Qwen3Config, "Qwen3ForCausalLM"),
        "mistral": (tf.MistralConfig, "MistralForCausalLM"),
    }[family]
    if family == "qwen3":
        common.setdefault("head_dim", 32)  # != hidden / heads: kv_channels must come from head_dim
    cfg = cls(**common)
    cfg.architectures = [arch]
    return cfg


def hf_model(cfg, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # norms default to ones: randomize so a wrong mapping shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):
                p.normal_()
    return model


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    torch.manual_seed(seed)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def megatron_model(cfg, *, divisible_by: int = 128, dtype=torch.float32, spec=None):
    """This rank's GPTModel chunk(s) for HF config ``cfg`` under the current parallel_state, from the
    one builder (``weightsync.plugins.testbed.megatron``: the family's own config table); ``spec``
    replaces the layer spec. The importer below stays independent of the code under test."""
    from megatron.core import parallel_state as ps

    from weightsync.plugins.testbed.megatron import MegatronParallel, build_chunks, megatron_config

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    par = MegatronParallel(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(), vpp=vpp
    )
    chunks = build_chunks(
        cfg, megatron_config(cfg, par, dtype), par, divisible_by=divisible_by,
        spec_hook=None if spec is None else (lambda _: spec),
    )
    return chunks if vpp else chunks[0]


# ---- test-only importer: HF tensors -> this rank's Megatron shards ---------------------------


def _tp_rank_size():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _fused_qkv_rows(cfg, q, k, v):
    """Megatron's linear_qkv (full) built row by row: for each query group, its q heads, k, v."""
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    d = q.shape[0] // heads
    rows = []
    for g in range(groups):
        for h in range(g * (heads // groups), (g + 1) * (heads // groups)):
            rows.append(q[h * d : (h + 1) * d])
        rows.append(k[g * d : (g + 1) * d])
        rows.append(v[g * d : (g + 1) * d])
    return torch.cat(rows, 0)


def import_hf(chunks, hf_state: dict[str, torch.Tensor], cfg) -> None:
    """Copy HF tensors into this rank's Megatron chunk(s), in place (test-only)."""
    if not isinstance(chunks, (list, tuple)):
        chunks = [chunks]
    r, tp = _tp_rank_size()

    def rows(t, i, n):
        per = t.shape[0] // n
        return t[i * per : (i + 1) * per]

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name == "embedding.word_embeddings.weight" or name == "output_layer.weight":
                src = hf_state["model.embed_tokens.weight" if name.startswith("emb") or cfg.tie_word_embeddings else "lm_head.weight"]
                padded = torch.zeros(p.shape[0] * tp, src.shape[1], dtype=src.dtype)
                padded[: src.shape[0]] = src
                val = rows(padded, r, tp)
            elif name == "decoder.final_layernorm.weight":
                val = hf_state["model.norm.weight"]
            else:
                parts = name.split(".")
                layer = chunk.decoder.layers[int(parts[2])].layer_number - 1
                suffix = ".".join(parts[3:])
                pre = f"model.layers.{layer}."
                if suffix == "input_layernorm.weight":
                    val = hf_state[pre + "input_layernorm.weight"]
                elif suffix == "pre_mlp_layernorm.weight":
                    val = hf_state[pre + "post_attention_layernorm.weight"]
                elif suffix.startswith("self_attention.linear_qkv."):
                    kind = suffix.rsplit(".", 1)[1]
                    q, k, v = (hf_state[f"{pre}self_attn.{x}_proj.{kind}"] for x in "qkv")
                    val = rows(_fused_qkv_rows(cfg, q, k, v), r, tp)
                elif suffix == "self_attention.linear_proj.weight":
                    w = hf_state[pre + "self_attn.o_proj.weight"]
                    per = w.shape[1] // tp
                    val = w[:, r * per : (r + 1) * per]
                elif suffix in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                    val = hf_state[pre + f"self_attn.{suffix.split('.')[1][0]}_norm.weight"]
                elif suffix == "mlp.linear_fc1.weight":
                    gate, up = hf_state[pre + "mlp.gate_proj.weight"], hf_state[pre + "mlp.up_proj.weight"]
                    val = torch.cat([rows(gate, r, tp), rows(up, r, tp)], 0)
                elif suffix == "mlp.linear_fc2.weight":
                    w = hf_state[pre + "mlp.down_proj.weight"]
                    per = w.shape[1] // tp
                    val = w[:, r * per : (r + 1) * per]
                else:
                    raise KeyError(f"test importer does not know {name}")
            with torch.no_grad():
                p.copy_(val)


def saved_checkpoint(model, path: str) -> dict[str, torch.Tensor]:
    """``save_pretrained`` then read the safetensors back: the on-disk checkpoint tensors."""
    from safetensors.torch import load_file

    model.save_pretrained(path, safe_serialization=True)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


# ---- observing communication --------------------------------------------------------------------

_COMM = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "gather", "gather_object", "scatter", "reduce", "reduce_scatter_tensor", "all_to_all",
    "batch_isend_irecv", "new_group",
)


class count_comm:
    """Counts every torch.distributed communication call (by name) made inside the block."""

    def __enter__(self):
        import torch.distributed as dist

        self.counts: dict[str, int] = {}
        self._saved = {n: getattr(dist, n) for n in _COMM if hasattr(dist, n)}

        def wrap(n, f):
            def g(*a, **k):
                self.counts[n] = self.counts.get(n, 0) + 1
                return f(*a, **k)

            return g

        for n, f in self._saved.items():
            setattr(dist, n, wrap(n, f))
        return self.counts

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, f in self._saved.items():
            setattr(dist, n, f)
        return False


class cpu_checkpoint_shims:
    """megatron-core 0.16's torch_dist strategy calls ``torch.cuda.synchronize()`` and puts a
    failure flag on ``torch.cuda.current_device()``; on a CPU-only gloo world make those no-op/CPU
    for the duration of a save/load (test-only)."""

    def __enter__(self):
        self._saved = (torch.cuda.synchronize, torch.cuda.current_device)
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"

    def __exit__(self, *exc):
        torch.cuda.synchronize, torch.cuda.current_device = self._saved
        return False


def chunk_list(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def forked_write_results_queue() -> None:
    """Give megatron-core's ``torch_dist`` save its write-results queue from a *fork*-context
    manager, made once per rank, before megatron makes it from a *spawn*-context one.

    megatron-core (0.16) hands each rank's write results back through ``Manager().Queue()`` of a
    spawn context, created once per process: the manager is a fresh interpreter that imports torch
    and megatron-core to unpickle the first results, ~5 s of CPU per rank and per world -- most of a
    CPU test world that saves a checkpoint (a 4-rank TP2 x EP2 world: 11 s -> 3 s). Started by fork
    (as megatron starts its own writer processes, from the same rank), the manager has those modules
    already. The queue's semantics and everything the save writes -- files, metadata -- are
    unchanged. A megatron-core without this module-level queue is left as it is."""
    import multiprocessing as mp

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", False) is None:
        fa._results_queue = mp.get_context("fork").Manager().Queue()


def dcp_save(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    sd = {f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunk_list(model))}
    forked_write_results_queue()
    with cpu_checkpoint_shims():
        dist_checkpointing.save(sd, path)


def dcp_load(model, path: str) -> None:
    """Load a checkpoint saved at any TP/PP/VPP into an unsplit (TP1/PP1) model: sharded keys are
    global, so the chunk containers of the save do not matter."""
    from megatron.core import dist_checkpointing

    with cpu_checkpoint_shims():
        loaded = dist_checkpointing.load({"model0": model.sharded_state_dict()}, path)
    missing, unexpected = model.load_state_dict(loaded["model0"], strict=False)
    bad = [k for k in missing + unexpected if not k.endswith("_extra_state")]
    if bad:
        raise AssertionError(f"dist_checkpointing load left {bad}")


def gather_local_pieces(source) -> dict[str, torch.Tensor] | None:
    """Run ``iter_local`` on every rank and rebuild full tensors on rank 0 from the metadata's
    owners / placements with ``torch.cat`` (the contract ``nccl_m2n`` reads)."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import Shard

    mine = {n: t.clone() for n, t in source.iter_local()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    out = {}
    for m in source.metadata:
        pieces = [everyone[r][m.name] for r in m.owners]
        p = (m.placements or (None,))[0]
        out[m.name] = torch.cat(pieces, dim=p.dim) if isinstance(p, Shard) else pieces[0]
    return out


def megatron_module_outputs(model, cfg, seed: int = 7) -> dict:
    """Outputs of Megatron's own modules on this rank (CPU-safe pieces of forward): per local layer
    the q/k/v heads from ``get_query_key_value_tensors`` (after q/k layernorm), the input norm, the
    MLP; the embedding lookup on the first stage. Same inputs on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (2, 3), generator=g)
    out: dict = {"x": x, "ids": ids}
    with torch.no_grad():
        for chunk in chunk_list(model):
            chunk.eval()  # embedding dropout
            if getattr(chunk, "pre_process", False):
                out["embed"] = chunk.embedding(input_ids=ids, position_ids=None)
            for layer in chunk.decoder.layers:
                i = layer.layer_number - 1
                q, k, v = layer.self_attention.get_query_key_value_tensors(x)[:3]
                mlp_out, mlp_bias = layer.mlp(x)
                out[i] = {
                    "q": q, "k": k, "v": v,
                    "norm": layer.input_layernorm(x),
                    "mlp": mlp_out if mlp_bias is None else mlp_out + mlp_bias,
                }
    return out


def hf_module_mismatches(cfg, exported: dict[str, torch.Tensor], megatron_outs: list[dict], tp: int) -> list[str]:
    """Load the exported tensors into a transformers model and compare its modules' outputs with
    Megatron's (``megatron_outs``: one dict per TP rank of some stage(s), TP order). Returns the
    list of mismatching checks (empty = agree)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(exported, strict=False)
    bad = [f"missing {m}" for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    bad += [f"unexpected {u}" for u in unexpected]
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    ref = megatron_outs[0]
    x, ids = ref["x"], ref["ids"]
    with torch.no_grad():
        if "embed" in ref:
            want = model.model.embed_tokens(ids).transpose(0, 1)
            if not torch.allclose(ref["embed"], want, atol=1e-6):
                bad.append("embedding lookup")
        layers = sorted(k for k in ref if isinstance(k, int))
        for i in layers:
            layer = model.model.layers[i]
            attn = layer.self_attn
            hf = {
                "q": attn.q_proj(x).view(*x.shape[:2], heads, d),
                "k": attn.k_proj(x).view(*x.shape[:2], groups, d),
                "v": attn.v_proj(x).view(*x.shape[:2], groups, d),
            }
            if hasattr(attn, "q_norm"):
                hf["q"], hf["k"] = attn.q_norm(hf["q"]), attn.k_norm(hf["k"])
            for key in ("q", "k", "v"):
                got = torch.cat([o[i][key] for o in megatron_outs], dim=2)  # TP ranks hold heads
                if not torch.allclose(got, hf[key], atol=1e-5):
                    bad.append(f"layer {i} {key}")
            if not torch.allclose(ref[i]["norm"], layer.input_layernorm(x), atol=1e-5):
                bad.append(f"layer {i} input_layernorm")
            if not torch.allclose(ref[i]["mlp"], layer.mlp(x), atol=1e-5):
                bad.append(f"layer {i} mlp")
    return bad


def randomize_norms_and_biases(model) -> None:
    """Megatron initializes norms to 1 and biases to 0, which would hide a swapped mapping. Refill
    them with values seeded by the *global* name (replicated tensors stay equal across TP ranks)."""
    import zlib

    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunk_list(model):
            for name, p in chunk.named_parameters():
                if "norm" not in name and not name.endswith("bias"):
                    continue
                parts = name.split(".")
                if parts[:2] == ["decoder", "layers"]:
                    parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number)
                key = ".".join(parts)
                if getattr(p, "tensor_model_parallel", False):
                    key += f"@tp{tp_rank}"
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def shared_checkpoint(cfg, path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rank 0 runs ``save_pretrained``; every rank reads the same safetensors back."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    if dist.get_rank() == 0:
        hf_model(cfg, seed).save_pretrained(path, safe_serialization=True)
    dist.barrier()
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out
