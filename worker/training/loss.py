"""A chunked next-token loss for Tunix's ``PeftTrainer`` that never holds the whole (B, T, V) logits.

Tunix's default loss (``peft_trainer._default_loss_fn``) takes the model's f32 logits, drops the last
position, builds an f32 ``one_hot`` of the targets and an f32 ``log_softmax``: with Gemma 4's 262,144-
token vocabulary that is ~1 MiB per token per copy, and XLA keeps several copies alive for the
backward pass (the logits, the softcap's tanh, the log-softmax, the one-hot, their cotangents). At
8k tokens per chip it is tens of GiB, more than the rest of a 31B LoRA step.

``chunked_loss_fn(chunk)`` computes the same number: the hidden state after the final norm once, then
a ``lax.scan`` over chunks of ``chunk`` target tokens that computes each chunk's logits (the tied
embedding, cast to f32, with Gemma's final logit softcap), their log-sum-exp and the target's logit,
under ``jax.checkpoint`` so the backward pass recomputes one chunk at a time. Same masking and
normalisation as Tunix: token t+1 is the target of position t where ``input_mask[t + 1]`` is set,
and the sum of NLLs is divided by ``sum(input_mask[:, 1:]) + 1e-8``.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

_CAPTURE = threading.local()  # .hidden: a list while hidden_states() runs the model


def _install_capture() -> None:
    """Wrap Tunix's ``Embedder.decode`` (the tied output projection) once: while ``hidden_states``
    runs the model, it records its input and hands back a (B, T, 1) slice, so the model's
    f32 cast and softcap touch one column instead of the vocabulary. Outside that, it is untouched."""
    from tunix.models.gemma4 import model as gemma4

    original = gemma4.Embedder.decode
    if getattr(original, "_tunedeck_capture", False):
        return

    def decode(self, x):
        hidden = getattr(_CAPTURE, "hidden", None)
        if hidden is None:
            return original(self, x)
        hidden.append(x)
        return x[..., :1]

    decode._tunedeck_capture = True  # pyright: ignore[reportFunctionMemberAccess] (marks the wrapper: once only)
    gemma4.Embedder.decode = decode


def hidden_states(model, tokens, positions, attention_mask):
    """The final-norm hidden state (B, T, D) of Tunix's ``Gemma4``, through the model's own call:
    Qwix applies LoRA by intercepting that call (it swaps in a subclass whose ``__call__`` runs the
    model under its interceptors), so the layers cannot be run one by one from outside it. Nothing in
    the model's graph changes (nnx refuses that inside the trainer's jit); see ``_install_capture``."""
    _install_capture()
    _CAPTURE.hidden = captured = []
    try:
        model(tokens, positions, None, attention_mask)
    finally:
        _CAPTURE.hidden = None
    (hidden,) = captured
    return hidden


def chunked_loss_fn(chunk_tokens: int):
    """A Tunix ``loss_fn(model, input_tokens, input_mask, positions, attention_mask)`` equal to the
    default loss, computing the logits ``chunk_tokens`` target tokens at a time."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")

    def loss_fn(model, input_tokens, input_mask, positions, attention_mask, images=None):
        if images is not None:
            raise ValueError("the chunked loss is for text-only training")
        config = model.config
        h = hidden_states(model, input_tokens, positions, attention_mask)[:, :-1, :].astype(config.dtype)
        b, t, d = h.shape
        n = b * t
        targets = input_tokens[:, 1:].reshape(n)
        mask = input_mask[:, 1:].reshape(n).astype(jnp.float32)
        size = min(chunk_tokens, n)
        pad = -n % size
        h = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        mask = jnp.pad(mask, (0, pad))  # padded rows weigh 0
        steps = (n + pad) // size
        w = jnp.astype(model.embedder.input_embedding[...], config.dtype)
        softcap = config.final_logit_softcap

        @jax.checkpoint
        def chunk_nll(w, h_c, t_c, m_c):
            # As Embedder.decode + Gemma4.__call__: x @ w.T in the model dtype, then f32 and softcap.
            logits = jnp.dot(jnp.astype(h_c, config.dtype), w.T).astype(jnp.float32)
            if softcap is not None:
                logits = jnp.tanh(logits / softcap) * softcap
            lse = jax.nn.logsumexp(logits, axis=-1)
            target = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]
            return jnp.sum((lse - target) * m_c)

        def body(total, xs):
            return total + chunk_nll(w, *xs), None

        total, _ = jax.lax.scan(
            body,
            jnp.zeros((), jnp.float32),
            (h.reshape(steps, size, d), targets.reshape(steps, size), mask.reshape(steps, size)),
        )
        return total / (jnp.sum(mask) + 1e-8)

    return loss_fn
