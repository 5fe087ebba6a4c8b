"""The chunked loss: the same loss and LoRA gradients as Tunix's default loss (its memory gain, measured by
XLA, is in bench/memory.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.sft import peft_trainer

from worker.training import data, engine, loss, models


def _grads(model, loss_fn, inputs):
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
    value, grads = nnx.jit(grad_fn)(model, **inputs)
    return float(value), jax.tree.leaves(grads)


def test_chunked_loss_equals_tunix_default_loss_and_gradients(make_spec, tiny_model):
    spec = make_spec(lora_rank=4)
    config = models.resolve_config(tiny_model)
    model, _ = engine.apply_lora(models.load_base_model(tiny_model, config), spec, models.RematConfig.NONE)
    # LoRA B starts at zero (no gradient to A): give B a value so that every gradient is exercised.
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.unflatten(tree, [jnp.asarray(rng.normal(0, 0.05, x.shape), x.dtype) for x in leaves]))

    tokens = rng.integers(6, config.num_embed, (3, 40)).astype(np.int32)
    tokens[:, 0] = 2
    tokens[1, 30:] = 0  # padding
    mask = np.ones_like(tokens)
    mask[:, :12] = 0  # a prompt: not a target
    mask[1, 30:] = 0
    batch = peft_trainer.TrainingInput(input_tokens=jnp.asarray(tokens), input_mask=jnp.asarray(mask))
    inputs = data.model_inputs_fn(0, 2)(batch)

    want, want_grads = _grads(model, peft_trainer._default_loss_fn, inputs)
    for chunk in (7, 64, 10_000):  # uneven chunks, chunks across examples, one chunk for all
        got, got_grads = _grads(model, loss.chunked_loss_fn(chunk), inputs)
        assert got == pytest.approx(want, rel=1e-5), chunk
        assert len(got_grads) == len(want_grads) > 0
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6, err_msg=f"chunk {chunk}")
