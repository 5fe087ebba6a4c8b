"""Gemma 4's ``config.json``, read as transformers reads it: the one reader that registration, the
worker's Tunix config (and so the merge mapping) and the base-model checks use. Plain Python: the web
process reads configs without JAX.

Two forms state the global (``full_attention``) layers' shape:
- the released checkpoints': ``global_head_dim`` and ``num_global_key_value_heads`` (the latter only
  applies where ``attention_k_eq_v`` is set: transformers' ``Gemma4TextAttention`` reads it only on
  K=V layers);
- a newer transformers' (``Gemma4TextConfig.save_pretrained`` since 5.17): a sparse ``per_layer_config``
  of overrides by layer index, ``{"5": {"head_dim": 512, "num_key_value_heads": 4}}``, without the
  two keys above.

``normalized`` turns either into one text config with every key set (transformers' defaults for the
ones left out) and the global shape in the release form's keys, and refuses (``ConfigError``, naming
the key) what Tunix's Gemma 4 model cannot represent.
"""

from __future__ import annotations

from typing import Any

# transformers' Gemma4TextConfig defaults, for keys a config.json may leave out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "hidden_size_per_layer_input": 256,
    "num_global_key_value_heads": None,
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "attention_bias": False,
    "use_bidirectional_attention": None,
    "tie_word_embeddings": True,
}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
LAYER_TYPES = ("sliding_attention", "full_attention")
# What a per_layer_config entry may override: the attention shape, all Tunix lets differ by layer kind.
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


class ConfigError(ValueError):
    """A config.json that Tunix's Gemma 4 cannot load; ``key`` names the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def text_config(config_json: dict) -> dict:
    """The text model's part of a config.json (``text_config`` of a multimodal ``gemma4`` one)."""
    if "text_config" in config_json and isinstance(config_json["text_config"], dict):
        return config_json["text_config"]
    return config_json


def _int(c: dict, key: str, *, low: int = 1) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, f"expected an integer >= {low}, got {value!r}")
    return value


def _global_shape(c: dict, layer_types: list[str]) -> tuple[int, int | None]:
    """(head_dim, KV heads or None for num_key_value_heads) of the global layers, from either form."""
    overrides = c.get("per_layer_config")
    if overrides is None:
        kv = c["num_global_key_value_heads"] if c["attention_k_eq_v"] else None
        return int(c["global_head_dim"] or c["head_dim"]), None if kv == c["num_key_value_heads"] else kv
    if not isinstance(overrides, dict):
        raise ConfigError("per_layer_config", f"expected an object of layer index -> overrides, got {overrides!r}")
    by_layer: dict[int, dict] = {}
    for key, entry in overrides.items():
        where = f"per_layer_config.{key}"
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ConfigError(where, "keys are layer indices") from None
        if not 0 <= index < len(layer_types):
            raise ConfigError(where, f"no layer {index} (the model has {len(layer_types)})")
        if not isinstance(entry, dict):
            raise ConfigError(where, f"expected an object of overrides, got {entry!r}")
        for name in entry:
            if name not in PER_LAYER_KEYS:
                raise ConfigError(
                    f"{where}.{name}",
                    f"a per-layer {name} is not supported by Tunix's Gemma 4 (only {' and '.join(PER_LAYER_KEYS)})",
                )
        by_layer[index] = entry
    shapes: dict[str, set[tuple[int, int]]] = {t: set() for t in LAYER_TYPES}
    for i, kind in enumerate(layer_types):
        entry = by_layer.get(i, {})
        shapes[kind].add(
            (entry.get("head_dim", c["head_dim"]), entry.get("num_key_value_heads", c["num_key_value_heads"]))
        )
    if shapes["sliding_attention"] - {(c["head_dim"], c["num_key_value_heads"])}:
        raise ConfigError(
            "per_layer_config",
            "sliding layers with their own head_dim or num_key_value_heads are not supported by Tunix",
        )
    if len(shapes["full_attention"]) > 1:
        raise ConfigError(
            "per_layer_config",
            f"the full_attention layers differ in shape {sorted(shapes['full_attention'])}: Tunix has one",
        )
    if not shapes["full_attention"]:
        return int(c["head_dim"]), None
    ((head_dim, kv_heads),) = shapes["full_attention"]
    return head_dim, None if kv_heads == c["num_key_value_heads"] else kv_heads


def _rope(rope: dict, kind: str) -> None:
    params = rope.get(kind)
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters.{kind}", f"expected an object, got {params!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional", "linear"):
        raise ConfigError(f"rope_parameters.{kind}.rope_type", f"{rope_type!r} is not supported by Tunix's Gemma 4")
    if params.get("rope_theta") is None:
        raise ConfigError(f"rope_parameters.{kind}.rope_theta", "missing")


def normalized(config_json: dict) -> dict:
    """The text config with every key set: transformers' defaults for keys left out, ``layer_types``
    listed, ``rope_parameters`` for both kinds, and the global layers' shape as ``global_head_dim``
    and ``num_global_key_value_heads`` (None: as ``num_key_value_heads``) whichever form stated it.
    Raises ConfigError naming the key for what Tunix's Gemma 4 cannot represent."""
    if not isinstance(config_json, dict):
        raise ConfigError("config.json", "expected a JSON object")
    text = text_config(config_json)
    c = {**HF_DEFAULTS, **text}
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "head_dim",
        "vocab_size",
    ):
        _int(c, key)
    _int(c, "num_key_value_heads")
    n_layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)
    ]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError("layer_types", f"{len(layer_types)} entries for num_hidden_layers={n_layers}")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise ConfigError("layer_types", f"unsupported layer type {unknown[0]!r}; expected one of {list(LAYER_TYPES)}")
    if c["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError("hidden_activation", f"{c['hidden_activation']!r} is not supported (Tunix uses tanh GELU)")
    if c["attention_bias"]:
        raise ConfigError("attention_bias", "True is not supported by Tunix's Gemma 4 model")
    if c["use_bidirectional_attention"] not in (None, "vision"):
        raise ConfigError("use_bidirectional_attention", "'all' is not supported for causal LM training")
    if config_json.get("tie_word_embeddings", True) is False or c["tie_word_embeddings"] is False:
        raise ConfigError("tie_word_embeddings", "False is not supported (Tunix's Gemma 4 ties the output layer)")
    if c["hidden_size_per_layer_input"] and c.get("vocab_size_per_layer_input", c["vocab_size"]) != c["vocab_size"]:
        raise ConfigError("vocab_size_per_layer_input", "must equal vocab_size (Tunix shares one vocabulary)")
    rope = {**DEFAULT_ROPE, **(c.get("rope_parameters") or {})}
    for kind in LAYER_TYPES:
        _rope(rope, kind)
    global_head_dim, global_kv = _global_shape(c, layer_types)
    c.pop("per_layer_config", None)
    return {
        **c,
        "layer_types": list(layer_types),
        "rope_parameters": rope,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv,
    }
