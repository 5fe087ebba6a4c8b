"""HF config.json -> Tunix ModelConfig, presets, and the LoRA target mapping."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from tunix.models.gemma4.model import AttentionType, ModelConfig

from worker.training import models, tiny


def gemma4_31b_config_json() -> dict:
    """A config.json shaped like Gemma 4 31B's (multimodal wrapper, text part as in TUNIX_NOTES):
    60 layers (5 sliding : 1 global), d_model 5376, ffn 21504, 32 heads of 256 (512 on global
    layers), 16 KV heads (4 on global layers), K = V on global layers, vocab 262144, window 1024,
    final logit softcap 30."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(60)]
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {
            "model_type": "gemma4_text",
            "vocab_size": 262144,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_hidden_layers": 60,
            "layer_types": layer_types,
            "num_attention_heads": 32,
            "head_dim": 256,
            "global_head_dim": 512,
            "num_key_value_heads": 16,
            "num_global_key_value_heads": 4,
            "attention_k_eq_v": True,
            "sliding_window": 1024,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 262144,
            "num_kv_shared_layers": 0,
            "enable_moe_block": False,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            },
            "tie_word_embeddings": True,
        },
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 1152},
        "tie_word_embeddings": True,
    }


def test_31b_config_maps_to_tunix_preset():
    mapped = models.model_config_from_hf(gemma4_31b_config_json())
    preset = ModelConfig.gemma4_31b()
    assert mapped == preset  # every field, including the attention pattern and the rope settings
    assert mapped.attention_pattern == (AttentionType.LOCAL_SLIDING,) * 5 + (AttentionType.GLOBAL,)
    # the same text config without the multimodal wrapper, and in its JSON round trip
    text_only = {**gemma4_31b_config_json()["text_config"], "architectures": ["Gemma4ForCausalLM"]}
    assert models.model_config_from_hf(json.loads(json.dumps(text_only))) == preset


def test_config_field_names_exist_in_tunix():
    """Every field model_config_from_hf sets is a ModelConfig field (a renamed field fails here)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(models.STRUCTURE_FIELDS) <= names
    mapped = models.model_config_from_hf(gemma4_31b_config_json())
    assert {f.name for f in dataclasses.fields(mapped)} == names


def test_tiny_config_and_presets():
    config = models.model_config_from_hf(tiny.tiny_config_json(1280))
    assert config.attention_pattern == (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
    assert (config.num_kv_heads, config.num_global_kv_heads, config.head_dim, config.global_key_size) == (4, 2, 16, 32)
    assert config.k_eq_v_global and config.per_layer_input_dim == 0 and config.sliding_window_size == 32
    assert set(models.PRESETS) == {"tiny-gemma4", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-31b"}
    for name, build in models.PRESETS.items():
        assert isinstance(build(), ModelConfig), name
    assert models.PRESETS["gemma-4-31b"]().num_layers == 60


def test_resolve_config_checks_the_preset(tiny_model):
    assert models.resolve_config(tiny_model, "tiny-gemma4").num_layers == 2
    with pytest.raises(ValueError, match="does not match preset 'gemma-4-31b'"):
        models.resolve_config(tiny_model, "gemma-4-31b")
    with pytest.raises(ValueError, match="unknown preset"):
        models.resolve_config(tiny_model, "llama")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"layer_types": ["sliding_attention"]}, "layer_types: 1 entries for num_hidden_layers=2"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "unsupported layer type"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        models.model_config_from_hf({**tiny.tiny_config_json(1280), **change})
    rope = {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 8.0}}
    with pytest.raises(ValueError, match="yarn"):
        models.model_config_from_hf({**tiny.tiny_config_json(1280), "rope_parameters": rope})


def test_lora_targets_map_to_tunix_module_paths():
    every = models.lora_module_path(models.HF_TARGET_MODULES)
    paths = [
        "layers/0/attn/q_einsum",
        "layers/0/attn/kv_einsum",
        "layers/5/attn/k_einsum",
        "layers/12/attn/attn_vec_einsum",
        "layers/0/mlp/gate_proj",
        "layers/59/mlp/up_proj",
        "layers/3/mlp/down_proj",
    ]
    assert all(re.fullmatch(every, p) for p in paths)
    assert not any(
        re.fullmatch(every, p)
        for p in (
            "embedder",
            "layers/0/attn",
            "layers/0/attn/_query_norm",
            "layers/0/mlp",
            "final_norm",
            "layers/0/moe",
        )
    )
    q_only = models.lora_module_path(["q_proj"])
    assert re.fullmatch(q_only, "layers/1/attn/q_einsum") and not re.fullmatch(q_only, "layers/1/attn/kv_einsum")
    v_only = models.lora_module_path(["v_proj"])  # K and V share Tunix modules
    assert re.fullmatch(v_only, "layers/0/attn/kv_einsum") and re.fullmatch(v_only, "layers/1/attn/k_einsum")
    with pytest.raises(ValueError, match="unknown target"):
        models.lora_module_path(["lm_head"])
