"""The web app's base-model facts (used to validate runs and estimate memory) match the real models."""

import pytest

from app.base_models.presets import BASE_MODELS
from worker.training.tiny import tiny_config_json


def test_tiny_registry_matches_the_checkpoint_the_worker_makes(tmp_path):
    import json

    from worker.training.tiny import create_tiny_gemma4

    config = json.loads((create_tiny_gemma4(tmp_path / "tiny") / "config.json").read_text())["text_config"]
    arch = BASE_MODELS["tiny-gemma4"].arch
    assert (arch.num_layers, arch.d_model, arch.ffn_dim) == (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["intermediate_size"],
    )
    assert (arch.num_heads, arch.head_dim, arch.num_kv_heads) == (
        config["num_attention_heads"],
        config["head_dim"],
        config["num_key_value_heads"],
    )
    assert (arch.global_head_dim, arch.num_global_kv_heads, arch.vocab_size) == (
        config["global_head_dim"],
        config["num_global_key_value_heads"],
        config["vocab_size"],
    )
    globals_ = sum(t == "full_attention" for t in config["layer_types"])
    assert arch.num_layers // arch.global_every == globals_
    assert tiny_config_json(config["vocab_size"], "float32")["hidden_size"] == arch.d_model


def _tunix_counts(preset: str, rank: int) -> tuple[int, int]:
    """(matrix params, LoRA params at ``rank`` on all seven projections) of Tunix's model for a
    preset, from its abstract shapes (nothing allocated): what the app's figures must equal."""
    import math

    from flax import nnx
    from tunix.models.gemma4 import model as gemma4

    from worker.training import models

    abstract = nnx.eval_shape(lambda: gemma4.Gemma4(models.PRESETS[preset](), rngs=nnx.Rngs(0)))
    params = lora = 0
    for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        shape = (leaf.get_value() if hasattr(leaf, "get_value") else leaf.value).shape
        if len(shape) < 2:
            continue  # norm scales
        params += math.prod(shape)
        name = "/".join(str(p) for p in path[-3:])
        # Qwix LoRA: A (in, r), B (r, out); einsum "in" is the model width, "out" the rest.
        if name.endswith(("attn/q_einsum/w", "attn/kv_einsum/w", "attn/k_einsum/w")):
            d = shape[-2]
            lora += rank * (d + math.prod(shape) // d)
        elif name.endswith("attn/attn_vec_einsum/w"):
            lora += rank * (math.prod(shape[:-1]) + shape[-1])
        elif name.endswith(("mlp/gate_proj/kernel", "mlp/up_proj/kernel", "mlp/down_proj/kernel")):
            lora += rank * (shape[0] + shape[1])
    return params, lora


@pytest.mark.parametrize("preset", ["tiny-gemma4", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-31b"])
def test_preset_figures_match_tunix(preset):
    from app.base_models.presets import HF_TARGET_MODULES, lora_params

    arch = BASE_MODELS[preset].arch
    params, lora = _tunix_counts(preset, 16)
    assert arch.params() == params
    assert lora_params(arch, 16, HF_TARGET_MODULES) == lora
