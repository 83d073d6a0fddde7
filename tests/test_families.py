"""The family registry (``weightsync.sources.families``): one module per family, listed without
importing torch, and one ``TransformerConfig`` table per family that the builder builds from and
``MegatronSource`` checks against (no world, no Megatron model)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightsync.sources import families

EXPECTED = (
    "deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "gpt_oss", "llama", "minimax_m2", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe_text",
    "qwen3_5_text", "qwen3_moe", "qwen3_next",
)


def test_registry_lists_one_module_per_family_without_importing_torch():
    code = (
        "import sys; from weightsync.sources import families; print(','.join(families.model_types())); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    listed, torch_loaded = out.stdout.split()
    assert tuple(listed.split(",")) == EXPECTED
    assert torch_loaded == "False"
    here = os.path.dirname(families.__file__)
    modules = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and f not in ("__init__.py", "base.py"))
    assert tuple(modules) == EXPECTED
    for t in EXPECTED:
        fam = families.get(t)
        assert fam.name == t and fam.architectures
    with pytest.raises(KeyError):
        families.get("gpt2")


def test_every_family_module_and_family_for_leave_torch_unimported():
    """``family_for(config, check=False)`` and every family module are plain data (``families/__init__``; the CLI's
    validator relies on it to refuse a layout in 0.3 s): importing all of them and asking
    ``family_for`` of a config of each family leaves torch out of ``sys.modules`` (DeepSeek-V3.2's module
    used to pull it in through the layout rows it imported for one function)."""
    code = (
        "import sys, importlib, types\n"
        "from weightsync.sources import families\n"
        "for t in families.model_types():\n"
        "    importlib.import_module(f'weightsync.sources.families.{t}')\n"
        "    fam = families.family_for(types.SimpleNamespace(model_type=t, architectures=None), check=False)\n"
        "    assert fam.name == t, (fam.name, t)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-qwen3-moe",
                                    "tiny-mixtral", "tiny-deepseek-v3", "tiny-deepseek-v32", "tiny-glm5", "tiny-glm4-moe", "tiny-gpt-oss",
                                    "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_the_builder_builds_exactly_the_family_table(preset):
    """Every field of the family's table is set on the builder's config to the table's value: there
    is no second mapping from HF config to TransformerConfig (the source checks the same table)."""
    from weightsync.plugins.testbed.megatron import MegatronParallel, SUPPORTED_MODEL_TYPES, megatron_config
    from weightsync.plugins.testbed.presets import MEGATRON_MODEL_TYPES, load_config

    assert SUPPORTED_MODEL_TYPES == MEGATRON_MODEL_TYPES == families.model_types()
    hf = load_config(preset)
    table = families.family_for(hf).megatron_fields(hf)
    assert {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"} <= set(table)
    mcfg = megatron_config(hf, MegatronParallel())

    def built(f):  # a table names an activation function (tables import neither torch nor megatron)
        value = getattr(mcfg, f)
        return value.__name__ if f == "activation_func" and callable(value) else value

    wrong = {f: (v.value, built(f)) for f, v in table.items() if built(f) != v.value}
    assert wrong == {}


def test_minimax_m2_is_refused_naming_the_whole_width_qk_norm():
    """MiniMax-M2 normalizes q/k over every head at once; megatron-core's q/k norms are per head:
    the family refuses at family_for (MegatronSource, every rank) and in the builder."""
    from transformers import AutoConfig

    from weightsync.plugins.testbed.megatron import MegatronParallel, megatron_config
    from weightsync.sources.core.ground.errors import UnmappedParameterError

    hf = AutoConfig.for_model("minimax_m2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_local_experts=4)
    hf.architectures = ["MiniMaxM2ForCausalLM"]
    with pytest.raises(UnmappedParameterError, match="whole projection width.*per attention head"):
        families.family_for(hf)
    with pytest.raises(ValueError, match="q_layernorm / k_layernorm per attention head"):
        megatron_config(hf, MegatronParallel())


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_vision_language_configs_are_refused_saying_to_pass_the_text_config(model_type):
    from transformers import AutoConfig

    from weightsync.sources.core.ground.errors import UnmappedParameterError

    hf = AutoConfig.for_model(model_type)
    hf.architectures = [{"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[model_type]]
    with pytest.raises(UnmappedParameterError, match=r"hf_config=config\.text_config .*_text"):
        families.family_for(hf)
    families.family_for(hf.text_config)  # the language model's family exports it
