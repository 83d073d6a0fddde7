"""Name tables and layout math on names and small tensors alone (no world, no Megatron model):
TE-spec fused-norm names, local-spec names, every family, and the vocabulary chunking rule."""

from __future__ import annotations

import pytest
import torch

import megatron_worlds as mw
from weightsync.sources.core.ground.errors import UnmappedParameterError
from weightsync.sources.families import megatron_to_hf
from weightsync.sources.core.layouts.rows import vocab_is_chunked, vocab_rows


@pytest.mark.parametrize("family", mw.FAMILIES)
def test_te_and_local_spec_names_map_to_the_same_checkpoint_names(family):
    cfg = mw.hf_config(family)
    layer_of = lambda j: j + 6  # a later pipeline stage: local layer 0 is global layer 6  # noqa: E731
    te = megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", hf_config=cfg, layer_of=layer_of)
    local = megatron_to_hf("decoder.layers.0.input_layernorm.weight", hf_config=cfg, layer_of=layer_of)
    assert te == local == ("model.layers.6.input_layernorm.weight",)
    te = megatron_to_hf("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", hf_config=cfg, layer_of=layer_of)
    local = megatron_to_hf("decoder.layers.1.pre_mlp_layernorm.weight", hf_config=cfg, layer_of=layer_of)
    assert te == local == ("model.layers.7.post_attention_layernorm.weight",)
    assert megatron_to_hf("decoder.layers.0.mlp.linear_fc1.weight", hf_config=cfg) == (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    assert megatron_to_hf("decoder.layers.2.self_attention.linear_qkv.weight", hf_config=cfg) == tuple(
        f"model.layers.2.self_attn.{x}_proj.weight" for x in "qkv"
    )
    assert megatron_to_hf("embedding.word_embeddings.weight", hf_config=cfg) == ("model.embed_tokens.weight",)
    assert megatron_to_hf("output_layer.weight", hf_config=cfg) == ("lm_head.weight",)
    if family == "qwen2":
        assert megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", hf_config=cfg)[0].endswith("q_proj.bias")
    else:
        with pytest.raises(UnmappedParameterError, match="linear_qkv.bias"):
            megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.bias", hf_config=cfg)
    if family == "qwen3":
        assert megatron_to_hf("decoder.layers.0.self_attention.k_layernorm.weight", hf_config=cfg) == (
            "model.layers.0.self_attn.k_norm.weight",
        )
    else:
        with pytest.raises(UnmappedParameterError, match="q_layernorm"):
            megatron_to_hf("decoder.layers.0.self_attention.q_layernorm.weight", hf_config=cfg)
    with pytest.raises(UnmappedParameterError, match="mlp.router.weight"):
        megatron_to_hf("decoder.layers.0.mlp.router.weight", hf_config=cfg)


def test_vocab_chunking_rule_matches_torch_chunk():
    # For every small case, the rule says "chunk" exactly when Megatron's trimmed shards have the
    # sizes torch.chunk gives (the oracle here is torch.chunk itself).
    for vocab in range(1, 40):
        for tp in (1, 2, 3, 4):
            for div in (1, 2, 4, 8):
                padded = mw.padded_vocab(vocab, tp, div)
                sizes = [b - a for a, b in (vocab_rows(vocab, padded, tp, r) for r in range(tp))]
                chunks = [c.shape[0] for c in torch.chunk(torch.empty(vocab), tp)]
                chunks += [0] * (tp - len(chunks))
                assert vocab_is_chunked(vocab, padded, tp) == (sizes == chunks), (vocab, tp, div)


def test_load_hf_weights_values_and_its_self_check():
    """``megatron.hf_weights.fill_values`` (rank 0 of ``load_hf_weights``): each exported id takes its HF
    value; an id exported twice (a split tensor taken for a copy), a non-vocabulary element never
    exported, or an HF tensor the export lacks is a problem in words, not a silent zero."""
    from weightsync.plugins.testbed.megatron.hf_weights import fill_values

    offsets = {(0, 0, "decoder.layers.0.linear_fc2.weight", 0): 0, (0, 0, "embedding.word_embeddings.weight", 0): 4}
    state = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "emb": torch.tensor([5.0, 6.0])}
    values = torch.full((7,), float("nan"))
    ok = {"w": torch.tensor([3, 2, 1, 0]), "emb": torch.tensor([4, 5])}  # element 6: vocab padding
    assert fill_values(values, ok, state, offsets, 7) == ""
    assert values[:6].tolist() == [4.0, 3.0, 2.0, 1.0, 5.0, 6.0] and values[6].isnan()
    twice = {"w": torch.tensor([3, 2, 1, 1]), "emb": torch.tensor([4, 5])}
    assert "linear_fc2.weight" in fill_values(values, twice, state, offsets, 7)
    assert "exported twice" in fill_values(values, twice, state, offsets, 7)
    never = {"w": torch.tensor([3, 2, 1, 4]), "emb": torch.tensor([5, 6])}  # element 0 of fc2: never
    assert "never exported" in fill_values(values, never, state, offsets, 7)
    assert "does not have: ['emb']" in fill_values(values, {"w": ok["w"]}, state, offsets, 7)
