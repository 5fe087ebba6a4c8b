"""The model server's sampling on its own: a seed's draw does not hang on rounding, top_p keeps the
nucleus, temperature 0 is greedy."""

import jax
import jax.numpy as jnp
import numpy as np

from worker.serve.generate import sample

ROWS, VOCAB = 2048, 256


def draw(logits, temperature=1.0, top_p=1.0, seed=0):
    keys = jax.random.split(jax.random.key(seed), logits.shape[0])
    n = logits.shape[0]
    return np.asarray(
        jax.jit(sample)(
            jnp.asarray(logits)[:, None, :], keys, jnp.zeros(n, jnp.int32), jnp.full(n, temperature), jnp.full(n, top_p)
        )
    )


def test_logits_a_rounding_apart_draw_the_same_tokens():
    # The same row computed at another cache column, or beside other rows, differs in the last bits.
    # Logits on a few levels tie often, so the nudge reorders many tokens of equal probability.
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 4, size=(ROWS, VOCAB)).astype(np.float32)
    nudged = logits + (rng.normal(size=logits.shape) * 1e-5).astype(np.float32)
    a, b = draw(logits), draw(nudged)
    assert (a != b).sum() == 0, f"{(a != b).sum()} of {ROWS} draws changed"


def test_top_p_keeps_the_nucleus_and_temperature_0_is_greedy():
    # Per row: token 5 has probability ~0.6, token 9 ~0.3, the rest share ~0.1.
    logits = np.full((ROWS, VOCAB), -20.0, np.float32)
    logits[:, 5], logits[:, 9] = np.log(0.6), np.log(0.3)
    logits[:, 100:200] = np.log(0.1 / 100)
    assert set(np.unique(draw(logits, top_p=0.8))) == {5, 9}
    assert set(np.unique(draw(logits, top_p=0.5))) == {5}
    counts = np.bincount(draw(logits), minlength=VOCAB)
    assert abs(counts[5] / ROWS - 0.6) < 0.03 and abs(counts[9] / ROWS - 0.3) < 0.03
    assert counts[100:200].sum() > 0.05 * ROWS
    assert set(np.unique(draw(logits, temperature=0.0))) == {5}
