"""The LoRA exported as a PEFT adapter: what ``peft`` (and vLLM's ``--lora-modules``) load on the base."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file

from tests.merge.checkpoints import write_sharded
from worker.merge import export_peft, load_lora


def test_peft_adapter_loads_in_peft_and_computes_the_merge(lora_run, merged, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    result = export_peft(
        lora_run.base_dir, lora_run.checkpoint, str(out), **lora_run.lora, base_model_name_or_path="tiny-gemma4"
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "peft_adapter" and [f["path"] for f in manifest["files"]] == [
        f.path for f in result.files
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias", "base_model_name_or_path")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "bias": "none",
        "base_model_name_or_path": "tiny-gemma4",
    }
    assert config["target_modules"] == list(lora_run.targets)

    tensors = load_file(str(out / "adapter_model.safetensors"))
    # the base's own module paths (tiny-gemma4 has the release's layout: model.language_model.layers...)
    p0 = "base_model.model.model.language_model.layers.0.self_attn."
    p1 = "base_model.model.model.language_model.layers.1.self_attn."
    assert tensors[p0 + "q_proj.lora_A.weight"].shape == (8, 64)  # (r, in)
    assert tensors[p0 + "q_proj.lora_B.weight"].shape == (8 * 16, 8)  # (out, r)
    assert tensors[p0 + "o_proj.lora_A.weight"].shape == (8, 8 * 16)  # A (N, H, r) -> (r, N*H)
    assert tensors[p1 + "k_proj.lora_B.weight"].shape == (2 * 32, 8)  # the K=V layer's K, 2 global KV heads
    assert p1 + "v_proj.lora_A.weight" not in tensors  # ... and no v_proj there
    # the fused kv LoRA: one A shared by k_proj and v_proj, B split into its K and V halves
    lora = load_lora(lora_run.checkpoint)
    a, b = lora["layers/0/attn/kv_einsum"]
    for part, name in enumerate(("k_proj", "v_proj")):
        np.testing.assert_array_equal(tensors[p0 + name + ".lora_A.weight"], a.T)
        np.testing.assert_array_equal(tensors[p0 + name + ".lora_B.weight"], b[:, part].reshape(8, -1).T)
    assert len(tensors) == 2 * 13 == result.tensors

    base = AutoModelForCausalLM.from_pretrained(lora_run.base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out))
    loaded = {n: p.detach().numpy() for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(n.replace(".default", "") for n in loaded) == sorted(tensors)  # every adapter weight, no others
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, tensors[name.replace(".default", "")], err_msg=name)
    prompts = torch.tensor(np.random.default_rng(0).integers(6, 1280, (3, 20)))
    with torch.no_grad():
        got = model(prompts).logits.numpy()
        expected = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(prompts).logits.numpy()
    assert np.abs(got - expected).max() < 1e-4


def test_a_text_only_base_names_follow_its_module_paths(lora_run, tmp_path):
    from worker.training import tiny

    causal = tiny.create_tiny_gemma4(tmp_path / "causal", layout="causal_lm")
    base = write_sharded(causal, tmp_path / "base", 2, {})
    out = tmp_path / "adapter"
    export_peft(str(base), lora_run.checkpoint, str(out), **lora_run.lora, base_model_name_or_path="my-gemma-4")
    names = set(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert all(n.startswith("base_model.model.model.layers.") for n in names)
