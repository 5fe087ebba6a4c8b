"""The tiny-gemma4 checkpoint: files, HF config and tensor names, tokenizer, loading through Tunix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from worker.training import tiny

# The state dict of transformers 5.12's Gemma4ForCausalLM for the tiny config, written out by hand
# from models/gemma4/modeling_gemma4.py (not from worker.training.tiny):
# - Gemma4ForCausalLM: self.model = Gemma4TextModel; lm_head tied to model.embed_tokens
#   (_tied_weights_keys), so it is not stored.
# - Gemma4TextModel: embed_tokens (its embed_scale buffer is non-persistent), layers, norm;
#   rotary_emb has only non-persistent buffers; no per-layer-input tensors when
#   hidden_size_per_layer_input == 0.
# - Gemma4TextDecoderLayer: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
#   post_feedforward_layernorm, mlp.{gate,up,down}_proj, and the persistent buffer layer_scalar (1,).
# - Gemma4TextAttention: head_dim = global_head_dim on full_attention layers; q_proj
#   (heads * head_dim, hidden), q_norm/k_norm (head_dim,), v_norm has no weight (with_scale=False);
#   k_proj (kv * head_dim, hidden) with kv = num_global_key_value_heads on K=V (attention_k_eq_v)
#   full layers, where v_proj is None; o_proj (hidden, heads * head_dim); no biases.
D, F, N = 64, 256, 8
EXPECTED_LAYER_0_SLIDING = {
    "self_attn.q_proj.weight": (N * 16, D),
    "self_attn.k_proj.weight": (4 * 16, D),
    "self_attn.v_proj.weight": (4 * 16, D),
    "self_attn.o_proj.weight": (D, N * 16),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
}
EXPECTED_LAYER_1_GLOBAL_K_EQ_V = {
    "self_attn.q_proj.weight": (N * 32, D),
    "self_attn.k_proj.weight": (2 * 32, D),
    "self_attn.o_proj.weight": (D, N * 32),
    "self_attn.q_norm.weight": (32,),
    "self_attn.k_norm.weight": (32,),
}
EXPECTED_EVERY_LAYER = {
    "input_layernorm.weight": (D,),
    "post_attention_layernorm.weight": (D,),
    "pre_feedforward_layernorm.weight": (D,),
    "post_feedforward_layernorm.weight": (D,),
    "mlp.gate_proj.weight": (F, D),
    "mlp.up_proj.weight": (F, D),
    "mlp.down_proj.weight": (D, F),
    "layer_scalar": (1,),
}


def expected_tensors(vocab: int, prefix: str = "model.") -> dict[str, tuple]:
    """``prefix``: ``model.`` (Gemma4ForCausalLM), ``model.language_model.`` (Gemma4ForConditionalGeneration,
    whose text model holds the same tensors under ``model.language_model``)."""
    out = {f"{prefix}embed_tokens.weight": (vocab, D), f"{prefix}norm.weight": (D,)}
    for i, layer in enumerate((EXPECTED_LAYER_0_SLIDING, EXPECTED_LAYER_1_GLOBAL_K_EQ_V)):
        for name, shape in {**layer, **EXPECTED_EVERY_LAYER}.items():
            out[f"{prefix}layers.{i}.{name}"] = shape
    return out


def tensors(path) -> dict[str, np.ndarray]:
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_files_and_config(tiny_model):
    names = sorted(p.name for p in tiny_model.iterdir())
    # the file set of a google/gemma-4-*-it repository (text files and one weights file)
    assert names == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    top = json.loads((tiny_model / "config.json").read_text())
    assert top["model_type"] == "gemma4" and top["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert top["vision_config"] is None and top["audio_config"] is None
    cfg = top["text_config"]
    assert cfg["model_type"] == "gemma4_text"
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["attention_k_eq_v"] is True and cfg["tie_word_embeddings"] is True
    assert cfg["hidden_size_per_layer_input"] == 0  # HF's default is 256 (per-layer embeddings)
    assert cfg["num_global_key_value_heads"] < cfg["num_key_value_heads"]  # like 31B (4 < 16)
    assert cfg["global_head_dim"] > cfg["head_dim"]  # like 31B (512 > 256)
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    turn_end = tiny.SPECIAL_TOKENS.index("<turn|>")
    assert gen["eos_token_id"] == [1, turn_end] and gen["bos_token_id"] == 2 and gen["pad_token_id"] == 0


def test_tensor_names_match_transformers_gemma4(tiny_model, tmp_path):
    cfg = json.loads((tiny_model / "config.json").read_text())["text_config"]
    got = {k: v.shape for k, v in tensors(tiny_model).items()}
    # every expected name, none extra, right shapes
    assert got == expected_tensors(cfg["vocab_size"], "model.language_model.")
    causal = tiny.create_tiny_gemma4(tmp_path / "causal", layout="causal_lm")
    assert {k: v.shape for k, v in tensors(causal).items()} == expected_tensors(cfg["vocab_size"])
    assert tiny.hf_tensor_shapes(cfg) == expected_tensors(cfg["vocab_size"])


def test_weights_are_seeded_and_sensible(tiny_model, tmp_path):
    t = tensors(tiny_model)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in t.values())
    p = "model.language_model."
    assert np.all(t[p + "norm.weight"] == 1.0) and np.all(t[p + "layers.1.layer_scalar"] == 1.0)
    assert 0.015 < t[p + "layers.0.mlp.up_proj.weight"].std() < 0.025
    again = tensors(tiny.create_tiny_gemma4(tmp_path / "again", seed=0))
    other = tensors(tiny.create_tiny_gemma4(tmp_path / "other", seed=1))
    name = p + "layers.1.self_attn.k_proj.weight"
    assert np.array_equal(again[name], t[name]) and not np.array_equal(other[name], t[name])
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (tiny_model / "tokenizer.json").read_text()


def test_existing_dest_is_returned_unchanged_and_failures_leave_nothing(tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "marker").write_text("x")
    assert tiny.create_tiny_gemma4(dest) == dest and os.listdir(dest) == ["marker"]
    with pytest.raises(ValueError, match="dtype"):
        tiny.create_tiny_gemma4(tmp_path / "bad", dtype="float8")
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no half-made model, no temp dir left behind


def test_transformers_reads_config_tokenizer_and_weights(tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(tiny_model))
    assert type(config).__name__ == "Gemma4Config" and config.vision_config is None
    text = config.text_config
    assert text.num_global_key_value_heads == 2 and text.global_head_dim == 32 and text.sliding_window == 32
    assert text.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert len(tok) == text.vocab_size
    assert [tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS] == list(range(len(tiny.SPECIAL_TOKENS)))
    # the release's named special tokens, read by transformers as the Gemma 4 processor reads them
    assert (tok.sot_token, tok.eot_token, tok.soc_token, tok.eoc_token) == (
        "<|turn>",
        "<turn|>",
        "<|channel>",
        "<channel|>",
    )
    assert tok.image_token_id == config.image_token_id and tok.boi_token == "<|image>"
    assert tok("hi").input_ids[0] == 2  # <bos> added, like Gemma's tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " What is the capital of France? "},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]
    # Gemma 4's format: a native system turn, <|turn>/<turn|> markers (from chat_template.jinja)
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWhat is the capital of France?<turn|>\n"
        "<|turn>model\nThe capital of France is Paris.<turn|>\n"
    )
    assert tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True).endswith(
        "<turn|>\n<|turn>model\n"
    )
    assert tok.apply_chat_template(messages[1:2], tokenize=False, enable_thinking=True).startswith(
        "<bos><|turn>system\n<|think|><turn|>\n"
    )
    # the demo's words are single tokens
    assert len(tok("The capital of France is Paris.", add_special_tokens=False).input_ids) == 7
    model, info = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_causal_lm_layout(tmp_path):
    """The same weights as Gemma4ForCausalLM (a text-only fine-tune saved by transformers)."""
    from transformers import AutoConfig

    path = tiny.create_tiny_gemma4(tmp_path / "causal", layout="causal_lm")
    config = AutoConfig.from_pretrained(str(path))
    assert type(config).__name__ == "Gemma4TextConfig" and config.num_hidden_layers == 2
    assert set(tensors(path)) == set(expected_tensors(config.vocab_size))


def test_loads_through_tunix_and_runs(tiny_model, tmp_path, jax_cache_dir):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.gemma4 import params_safetensors

    from worker.training import models

    config = models.resolve_config(tiny_model, "tiny-gemma4")
    # the text-only layout through models.load_base_model (Tunix 0.1.7 maps `model.language_model.` but
    # not the text-only `model.` prefix, which it adds), the release's layout through Tunix's own entry
    # point: the same parameters
    causal = tiny.create_tiny_gemma4(tmp_path / "causal", layout="causal_lm")
    model = models.load_base_model(causal, config)
    reference = params_safetensors.create_model_from_safe_tensors(str(tiny_model), config, mesh=None, dtype=jnp.float32)
    a, b = nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    # HF -> Tunix layouts: q_proj (N*H, D) -> q_einsum.w (N, D, H); K=V global layer -> k_einsum.
    t = tensors(causal)
    q = t["model.layers.1.self_attn.q_proj.weight"].reshape(8, 32, 64).transpose(0, 2, 1)
    assert np.array_equal(np.asarray(model.layers[1].attn.q_einsum.w[...]), q)
    assert model.layers[1].attn.k_einsum.w[...].shape == (2, 64, 32)
    assert model.layers[0].attn.kv_einsum.w[...].shape == (2, 4, 64, 16)
    assert np.array_equal(
        np.asarray(model.layers[0].mlp.down_proj.kernel[...]), t["model.layers.0.mlp.down_proj.weight"].T
    )

    tokens = jnp.asarray(np.random.default_rng(0).integers(6, config.num_embed, (2, 12)), jnp.int32)
    mask = jnp.tril(jnp.ones((12, 12), bool))[None].repeat(2, axis=0)
    logits, _ = nnx.jit(lambda m, x: m(x, None, None, mask))(model, tokens)
    assert logits.shape == (2, 12, config.num_embed)
    assert bool(jnp.isfinite(logits).all())
    assert 0.2 < float(logits.std()) < 10  # not degenerate


def test_wrong_layout_is_a_clear_error(tmp_path):
    from safetensors.numpy import save_file

    from worker.training import models

    src = tiny.create_tiny_gemma4(tmp_path / "m")
    t = tensors(src)
    save_file({"something.else." + k: v for k, v in t.items()}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="weights are missing"):
        models.load_base_model(src, models.resolve_config(src))
