"""Gemma 4 model configs: HF config.json -> Tunix ModelConfig, presets, LoRA target mapping, loading.

The same mapping serves the tiny model and the real checkpoints (``google/gemma-4-*``): the HF
``config.json`` (text-only ``gemma4_text`` or multimodal ``gemma4`` with a ``text_config``) is the
source of truth for the weights; a preset name only cross-checks it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from tunix.models.gemma4 import model as gemma4

from app.base_models import hf_config

ModelConfig = gemma4.ModelConfig
AttentionType = gemma4.AttentionType
RematConfig = gemma4.RematConfig

_LAYER_TYPES = {"sliding_attention": AttentionType.LOCAL_SLIDING, "full_attention": AttentionType.GLOBAL}


def _pattern(layer_types: list[str]) -> tuple[AttentionType, ...]:
    """The shortest repeating period of the per-layer attention types (Tunix cycles its pattern)."""
    types = [_LAYER_TYPES[t] for t in layer_types]
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return tuple(types[:p])
    raise AssertionError("unreachable")


def _rope(params: dict) -> tuple[int, float, float]:
    """(base frequency, scale factor, rotary proportion) from one layer type's rope parameters."""
    scale = float(params.get("factor", 1.0)) if params.get("rope_type") == "linear" else 1.0
    proportion = float(params.get("partial_rotary_factor", 1.0))
    return int(params["rope_theta"]), scale, proportion


def model_config_from_hf(config_json: dict) -> ModelConfig:
    """Map an HF Gemma 4 config.json (dict) to Tunix's ``gemma4.ModelConfig``.

    Raises ``hf_config.ConfigError`` (a ValueError naming the key) for settings Tunix's Gemma 4 cannot
    represent. The result's ``dtype``/``param_dtype``/``remat_config`` are Tunix's defaults; the caller
    sets them.
    """
    c = hf_config.normalized(config_json)
    n_layers = int(c["num_hidden_layers"])
    vocab = int(c["vocab_size"])
    per_layer = int(c["hidden_size_per_layer_input"] or 0)
    rope = c["rope_parameters"]
    local_base, local_scale, local_prop = _rope(rope["sliding_attention"])
    global_base, global_scale, global_prop = _rope(rope["full_attention"])
    hidden = int(c["intermediate_size"])
    moe = bool(c["enable_moe_block"])
    shared = int(c["num_kv_shared_layers"] or 0)
    return ModelConfig(
        num_layers=n_layers,
        num_embed=vocab,
        embed_dim=int(c["hidden_size"]),
        hidden_dim=hidden,
        num_heads=int(c["num_attention_heads"]),
        head_dim=int(c["head_dim"]),
        num_kv_heads=int(c["num_key_value_heads"]),
        final_logit_softcap=c["final_logit_softcapping"],
        sliding_window_size=c["sliding_window"],
        per_layer_input_dim=per_layer,
        num_global_kv_heads=c["num_global_key_value_heads"],
        global_key_size=int(c["global_head_dim"]),
        attention_pattern=_pattern(c["layer_types"]),
        frac_shared_layers=shared / n_layers if shared else 0.0,
        global_rope_proportion=global_prop,
        local_rope_proportion=local_prop,
        k_eq_v_global=bool(c["attention_k_eq_v"]),
        override_kv_shared_ffw_hidden=hidden * 2 if c["use_double_wide_mlp"] and shared else None,
        local_base_frequency=local_base,
        global_base_frequency=global_base,
        local_scale_factor=local_scale,
        global_scale_factor=global_scale,
        enable_moe=moe,
        num_experts=c.get("num_experts") if moe else None,
        num_experts_per_tok=c.get("top_k_experts") if moe else None,
        expert_dim=c.get("moe_intermediate_size") if moe else None,
        moe_dense_hidden_dim=hidden if moe else None,
    )


def _tiny_config() -> ModelConfig:
    from worker.training import tiny

    return model_config_from_hf(tiny.tiny_config_json(tiny.TOKENIZER_VOCAB_SIZE))


# Preset name -> how to build its Tunix config. 26B-A4B (MoE) is left out: Qwix LoRA does not
# reach its experts (ragged-dot MoE), so only its attention and dense MLP branch would train.
PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny-gemma4": _tiny_config,
    "gemma-4-e2b": ModelConfig.gemma4_e2b,
    "gemma-4-e4b": ModelConfig.gemma4_e4b,
    "gemma-4-31b": ModelConfig.gemma4_31b,
}

# Fields that describe the weights (a preset and a checkpoint's config.json must agree on them).
STRUCTURE_FIELDS = (
    "num_layers",
    "num_embed",
    "embed_dim",
    "hidden_dim",
    "num_heads",
    "head_dim",
    "num_kv_heads",
    "num_global_kv_heads",
    "global_key_size",
    "per_layer_input_dim",
    "k_eq_v_global",
    "attention_pattern",
    "frac_shared_layers",
    "override_kv_shared_ffw_hidden",
    "enable_moe",
    "num_experts",
    "expert_dim",
    "sliding_window_size",
    "final_logit_softcap",
)


def structure_diff(a: ModelConfig, b: ModelConfig) -> dict[str, tuple]:
    """{field: (a's value, b's value)} for the STRUCTURE_FIELDS where two configs differ."""
    return {f: (getattr(a, f), getattr(b, f)) for f in STRUCTURE_FIELDS if getattr(a, f) != getattr(b, f)}


def read_config_json(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    return json.loads(path.read_text(encoding="utf-8"))


def resolve_config(model_dir: str | os.PathLike, preset: str | None = None) -> ModelConfig:
    """The Tunix config for an HF checkpoint dir, cross-checked against ``preset`` when given."""
    config = model_config_from_hf(read_config_json(model_dir))
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
        expected = PRESETS[preset]()
        diff = structure_diff(config, expected)
        if preset == "tiny-gemma4":
            diff.pop("num_embed", None)  # the tiny tokenizer's size may vary with the corpus
        if diff:
            shown = ", ".join(f"{k}: {v[0]!r} != {v[1]!r}" for k, v in diff.items())
            raise ValueError(f"{model_dir}/config.json does not match preset {preset!r} ({shown})")
    return config


# -- LoRA targets ------------------------------------------------------------------------------

HF_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# HF projection -> Tunix module names it lives in. Tunix fuses K and V into one `kv_einsum` on
# sliding (and non-K=V) layers, and global K=V layers have a single `k_einsum` used as both K and
# V: so k_proj and v_proj map to the same modules, and choosing either adapts both.
_TUNIX_MODULES = {
    "q_proj": ("attn/q_einsum",),
    "k_proj": ("attn/kv_einsum", "attn/k_einsum"),
    "v_proj": ("attn/kv_einsum", "attn/k_einsum"),
    "o_proj": ("attn/attn_vec_einsum",),
    "gate_proj": ("mlp/gate_proj",),
    "up_proj": ("mlp/up_proj",),
    "down_proj": ("mlp/down_proj",),
}


def lora_module_path(target_modules: Iterable[str]) -> str:
    """Qwix ``module_path`` regex (full-matched against paths like ``layers/0/attn/q_einsum``) for
    HF target module names."""
    targets = list(target_modules)
    if not targets:
        raise ValueError("target_modules is empty")
    unknown = [t for t in targets if t not in _TUNIX_MODULES]
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; expected some of {', '.join(HF_TARGET_MODULES)}")
    names: list[str] = []
    for t in HF_TARGET_MODULES:
        if t in targets:
            names += [m for m in _TUNIX_MODULES[t] if m not in names]
    return r"layers/\d+/(?:" + "|".join(re.escape(n) for n in names) + ")"


# -- loading -----------------------------------------------------------------------------------


_PREFIX = r"(?:model\.language_model\.)?"


def _key_mapping(cfg: ModelConfig) -> dict:
    """Tunix's Gemma 4 safetensors key mapping, also accepting the text-only ``model.`` prefix.

    Tunix 0.1.7 only accepts ``model.language_model.`` (the multimodal ``Gemma4ForConditionalGeneration``
    layout) or no prefix; a ``Gemma4ForCausalLM`` checkpoint (``model.layers.0...``) loads nothing.
    """
    from tunix.models.gemma4 import params_safetensors

    out = {}
    for pattern, target in params_safetensors._get_key_and_transform_mapping(cfg).items():
        if not pattern.startswith(_PREFIX):
            raise AssertionError(f"unexpected Tunix key pattern {pattern!r}")
        out[r"(?:model\.language_model\.|model\.)?" + pattern[len(_PREFIX) :]] = target
    return out


def load_base_model(model_dir: str | os.PathLike, config: ModelConfig, *, mesh=None, dtype: str = "float32"):
    """The Gemma 4 base model with its real weights, through Tunix's safetensors loader (Tunix's own
    key mapping and q/k/v preprocessing; text-only ``model.`` and multimodal ``model.language_model.``
    tensor names both load; vision/audio tensors are skipped)."""
    import jax.numpy as jnp
    from tunix.models import safetensors_loader
    from tunix.models.gemma4 import params_safetensors

    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    config = dataclasses.replace(config, dtype=jdtype, param_dtype=jdtype)
    try:
        return safetensors_loader.load_and_create_model(
            file_dir=str(model_dir),
            model_class=gemma4.Gemma4,
            config=config,
            key_mapping=_key_mapping,
            mesh=mesh,
            preprocess_fn=params_safetensors._make_preprocess_fn(config),
            dtype=jdtype,
        )
    except ValueError as exc:
        if "pytree structure" not in str(exc):
            raise
        raise ValueError(
            f"{model_dir}: some Gemma 4 weights are missing from the safetensors files (tensor names must follow "
            f"the Hugging Face Gemma 4 layout and match config.json): {str(exc).splitlines()[0]}"
        ) from exc
