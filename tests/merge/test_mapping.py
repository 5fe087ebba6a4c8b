"""The HF <-> Tunix LoRA mapping against Tunix's own safetensors loader and the trainer's LoRA targets."""

from __future__ import annotations

import re

import pytest
from tunix.models.gemma4 import params_safetensors
from tunix.utils.torch_utils import torch_key_to_jax_key

from worker.merge import load_lora
from worker.merge.mapping import projections
from worker.training import models


@pytest.mark.parametrize("preset", ["gemma-4-31b", "gemma-4-e4b", "tiny-gemma4"])
def test_projections_follow_tunix_loader(preset):
    """Tunix's loader sends each HF projection to the module the mapping says: q to q_einsum, k/v to a
    temporary its preprocessing fuses into kv_einsum (k alone, as k_einsum, on K=V global layers), o to
    attn_vec_einsum, the MLP to its Linear; and the trainer's target regex selects the same modules."""
    config = models.PRESETS[preset]()
    keys = params_safetensors._get_key_and_transform_mapping(config)
    table = projections(config)
    pattern = config.attention_pattern
    global_layers = {i for i in range(config.num_layers) if pattern[i % len(pattern)] == models.AttentionType.GLOBAL}
    k_eq_v = global_layers if config.k_eq_v_global else set()
    assert {m for m in table if m.endswith("/k_einsum")} == {f"layers/{i}/attn/k_einsum" for i in k_eq_v}
    assert len(table) == 6 * config.num_layers  # q, kv (or k), o, gate, up, down
    for module, projs in table.items():
        layer = int(module.split("/")[1])
        for p in projs:
            assert re.fullmatch(models.lora_module_path([p.target]), module), (module, p.target)
            target, (_, reshape) = torch_key_to_jax_key(keys, f"model.language_model.{p.hf_module}.weight")
            kind = p.target.removesuffix("_proj")
            if kind in ("q", "k", "v"):
                assert target == f"tmp.layers.{layer}.attn.{kind}"
                head_dim = config.global_key_size if layer in global_layers else config.head_dim
                assert reshape[-1] == head_dim
            elif kind == "o":
                assert target == f"layers.{layer}.attn.attn_vec_einsum.w"
            else:
                assert target == f"layers.{layer}.mlp.{p.target}.kernel"
        if module.endswith("kv_einsum"):
            assert [(p.target, p.part) for p in projs] == [("k_proj", 0), ("v_proj", 1)]


def test_load_lora_reads_the_trainer_checkpoint(lora_run, tmp_path):
    lora = load_lora(lora_run.checkpoint)
    assert lora["layers/0/attn/q_einsum"].a.shape == (64, 8) and lora["layers/0/attn/q_einsum"].b.shape == (8, 8, 16)
    assert lora["layers/0/attn/kv_einsum"].b.shape == (8, 2, 4, 16)
    assert lora["layers/1/attn/k_einsum"].b.shape == (8, 2, 32)
    assert lora["layers/1/attn/attn_vec_einsum"].a.shape == (8, 32, 8)
    assert lora["layers/1/mlp/down_proj"].a.shape == (256, 8)
    assert set(lora) == set(projections(models.resolve_config(lora_run.base_dir)))


def test_load_lora_refuses_a_checkpoint_of_other_weights(tmp_path):
    import numpy as np
    import orbax.checkpoint as ocp

    tree = {"layers": {"0": {"attn": {"q_einsum": {"w": {"value": np.zeros((2, 4, 2), np.float32)}}}}}}
    ocp.PyTreeCheckpointer().save(tmp_path / "1" / "model_params", tree)
    with pytest.raises(ValueError, match="layers/0/attn/q_einsum/w is not a LoRA weight"):
        load_lora(str(tmp_path / "1"))
