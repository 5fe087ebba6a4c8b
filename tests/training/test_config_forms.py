"""Both forms of Gemma 4's config.json, as transformers writes them, read alike by registration and the
worker: the release form (``global_head_dim``, ``num_global_key_value_heads``; what the installed
transformers 5.12 writes) and the newer one (``per_layer_config``; what transformers 5.18 writes)."""

from __future__ import annotations

import json
import shutil

import pytest
from tunix.models.gemma4.model import ModelConfig

from app.base_models import hf_config
from app.base_models.presets import BASE_MODELS
from app.base_models.service import BaseModelError, check_source
from tests.checkpoints import config_by_new_transformers, configs_by_new_transformers
from tests.training.test_models import gemma4_31b_config_json
from worker.training import models, tiny

# Keys of a config.json that are not Gemma4TextConfig arguments.
NOT_ARGUMENTS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version")


def arguments(text: dict) -> dict:
    return {k: v for k, v in text.items() if k not in NOT_ARGUMENTS}


def e2b_arguments() -> dict:
    """Gemma 4 E2B's text config as Gemma4TextConfig arguments, from its model card's figures (35
    layers, 4 sliding : 1 global, per-layer embeddings of 256, the last 20 layers sharing KV caches with
    a double-wide MLP, one KV head): the preset a checkpoint of it is checked against is Tunix's."""
    return {
        "vocab_size": 262144,
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": 35,
        "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
        "num_attention_heads": 8,
        "head_dim": 256,
        "num_key_value_heads": 1,
        "global_head_dim": 512,
        "sliding_window": 512,
        "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "num_kv_shared_layers": 20,
        "use_double_wide_mlp": True,
    }


CASES = {
    "tiny-gemma4": (lambda: arguments(tiny.tiny_config_json(tiny.TOKENIZER_VOCAB_SIZE)), models.PRESETS["tiny-gemma4"]),
    "gemma-4-31b": (lambda: arguments(gemma4_31b_config_json()["text_config"]), ModelConfig.gemma4_31b),
    "gemma-4-e2b": (e2b_arguments, ModelConfig.gemma4_e2b),
}


def newer_form(kwargs: dict) -> dict:
    """``kwargs``' config as transformers 5.18 writes it; the first call writes every case's at once."""
    configs_by_new_transformers(*(make() for make, _ in CASES.values()))
    return config_by_new_transformers(**kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_both_forms_map_to_the_preset(name):
    make_arguments, preset = CASES[name]
    from transformers import Gemma4TextConfig

    release = Gemma4TextConfig(**make_arguments()).to_dict()  # the installed transformers (5.12)
    assert release["global_head_dim"] == make_arguments()["global_head_dim"]
    newer = newer_form(make_arguments())
    assert "global_head_dim" not in newer and "num_global_key_value_heads" not in newer
    assert newer["per_layer_config"]  # the global layers' overrides
    assert models.model_config_from_hf(release) == preset()
    assert models.model_config_from_hf(newer) == preset()
    # The web app's reader sees the same global shape in both, and registration takes both.
    shape = [
        (hf_config.normalized(c)["global_head_dim"], hf_config.normalized(c)["num_global_key_value_heads"])
        for c in (release, newer)
    ]
    assert shape[0] == shape[1]


def _source(tiny_model, tmp_path, text: dict):
    """A copy of the tiny checkpoint whose config.json's text part is ``text``."""
    dest = tmp_path / "source"
    shutil.copytree(tiny_model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["text_config"] = {**text, "model_type": "gemma4_text"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _newer_tiny() -> dict:
    """The tiny model's config as transformers 5.18 writes it."""
    return newer_form(arguments(tiny.tiny_config_json(tiny.TOKENIZER_VOCAB_SIZE)))


def _with(**changes):
    return lambda: {**tiny.tiny_config_json(tiny.TOKENIZER_VOCAB_SIZE), **changes}


def _override(entry: dict, layer: str = "1"):
    def make():
        c = _newer_tiny()
        c["per_layer_config"] = {**c["per_layer_config"], layer: {**c["per_layer_config"].get(layer, {}), **entry}}
        return c

    return make


# (config text, the key registration's error names, or None where it is a loadable tiny Gemma 4)
VARIANTS = {
    "release form": (_with(), None),
    "per_layer_config form": (_newer_tiny, None),
    "another vocabulary (the tiny tokenizer's size follows its corpus)": (_with(vocab_size=999), None),
    "per_layer_config: global head_dim": (
        _override({"head_dim": 64}),
        "per_layer_config (the full_attention layers' head_dim)",
    ),
    "per_layer_config: global KV heads": (
        _override({"num_key_value_heads": 1}),
        "per_layer_config (the full_attention layers' num_key_value_heads)",
    ),
    "per_layer_config: a sliding layer overridden": (_override({"head_dim": 32}, "0"), "per_layer_config"),
    "per_layer_config: a key Tunix cannot vary": (
        _override({"intermediate_size": 128}),
        "per_layer_config.1.intermediate_size",
    ),
    "global_head_dim": (_with(global_head_dim=64), "global_head_dim"),
    "num_global_key_value_heads": (_with(num_global_key_value_heads=1), "num_global_key_value_heads"),
    "attention_k_eq_v": (_with(attention_k_eq_v=False), "attention_k_eq_v"),
    "sliding_window": (_with(sliding_window=64), "sliding_window"),
    "final_logit_softcapping": (_with(final_logit_softcapping=None), "final_logit_softcapping"),
    "intermediate_size": (_with(intermediate_size=128), "intermediate_size"),
    "layer_types": (_with(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    "hidden_size_per_layer_input": (_with(hidden_size_per_layer_input=16), "hidden_size_per_layer_input"),
    "hidden_activation": (_with(hidden_activation="silu"), "hidden_activation"),
    "rope type": (
        _with(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 8.0}}),
        "rope_parameters.sliding_attention.rope_type",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_registration_refuses_what_the_worker_would(tiny_model, tmp_path, variant):
    """Every config the worker's loader refuses (or loads) against the preset, registration refuses
    (or takes) too, and its error names the config key."""
    make_text, key = VARIANTS[variant]
    source = _source(tiny_model, tmp_path, make_text())
    try:
        models.resolve_config(source, "tiny-gemma4")
        worker_error = None
    except ValueError as exc:
        worker_error = str(exc)
    try:
        check_source(str(source), BASE_MODELS["tiny-gemma4"])
        app_error = None
    except BaseModelError as exc:
        app_error = str(exc)
    if key is None:
        assert (worker_error, app_error) == (None, None)
    else:
        assert worker_error is not None, "the worker would have loaded it"
        assert app_error is not None and key in app_error, app_error


def test_a_per_layer_config_checkpoint_loads_the_same_weights(tiny_model, tmp_path):
    import numpy as np
    from flax import nnx

    newer = _source(tiny_model, tmp_path, _newer_tiny())
    config = models.resolve_config(newer, "tiny-gemma4")
    assert config == models.resolve_config(tiny_model, "tiny-gemma4")
    a = nnx.state(models.load_base_model(tiny_model, config), nnx.Param)
    b = nnx.state(models.load_base_model(newer, config), nnx.Param)
    for (path, x), (_, y) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))
