"""The web app's base-model facts (used to validate runs and estimate memory) match the real models."""

from app.runs.base_models import BASE_MODELS
from worker.training.tiny import tiny_config_json


def test_tiny_registry_matches_the_checkpoint_the_worker_makes(tmp_path):
    import json

    from worker.training.tiny import create_tiny_gemma4

    config = json.loads((create_tiny_gemma4(tmp_path / "tiny") / "config.json").read_text())
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
