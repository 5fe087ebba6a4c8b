"""The pre-flight estimate's arithmetic (no JAX): chip memory in real bytes, and the 31B fit grid."""

from __future__ import annotations

import pytest

from app.base_models.presets import BASE_MODELS
from app.pools.models import ACCELERATORS, GiB, Pool
from app.runs import estimate
from app.runs.models import RunConfig

GB = 10**9


@pytest.mark.parametrize(
    ("accelerator", "bytes_"),
    [("tpu-v5p-8", 95 * GB), ("tpu-v5e-8", 16 * GB), ("tpu-v6e-8", 31.25 * GiB)],
)
def test_tpu_memory_is_in_real_bytes(accelerator, bytes_):
    # Google quotes HBM in GB (10^9 bytes); a v6e chip shows 31.25 GiB to JAX.
    assert ACCELERATORS[accelerator].memory == bytes_


def test_31b_on_a_v5p_8_fits_short_rows_and_names_the_field_to_lower():
    base = BASE_MODELS["gemma-4-31b"]
    pool = Pool(name="tpu-v5p-8", accelerator="tpu-v5p-8", chips=4, price_per_chip_hour=4.2)
    short = estimate.estimate(base, RunConfig(batch_size=4, max_seq_len=1024, dtype="bfloat16"), pool, 4, 1, None)
    assert short.fits and short.lower is None
    long = estimate.estimate(base, RunConfig(batch_size=4, max_seq_len=8192, dtype="bfloat16"), pool, 4, 1, None)
    assert not long.fits and long.lower == "config.max_seq_len" and "GiB" in long.warning
    # 8k tokens of f32 logits per chip are 8 GiB a copy: the loss is chunked on its own
    assert long.loss_chunk_tokens == 1024 and long.logits_gib_per_chip < 4


def test_the_estimate_lists_the_settings_that_fit():
    base = BASE_MODELS["gemma-4-31b"]
    pool = Pool(name="tpu-v5p-8", accelerator="tpu-v5p-8", chips=4, price_per_chip_hour=4.2)
    e = estimate.estimate(base, RunConfig(batch_size=4, max_seq_len=8192, dtype="bfloat16"), pool, 4, 1, None)
    fitting = {(f["batch_size"], f["max_seq_len"], f["remat"]) for f in e.fitting}
    assert (4, 1024, "block") in fitting and (4, 512, "none") in fitting
    assert not any(seq >= 8192 for _, seq, _ in fitting)
    for batch, seq, remat in fitting:  # each listed setting, asked for, fits
        config = RunConfig(batch_size=batch, max_seq_len=seq, remat=remat, dtype="bfloat16")
        assert estimate.estimate(base, config, pool, 4, 1, None).fits


def test_replicas_each_hold_the_weights_over_their_own_chips():
    base = BASE_MODELS["gemma-4-31b"]
    pool = Pool(name="tpu-v5p-8", accelerator="tpu-v5p-8", chips=4, price_per_chip_hour=4.2)
    config = RunConfig(batch_size=4, max_seq_len=512, dtype="bfloat16", max_steps=100)
    sharded = estimate.estimate(base, config, pool, 4, 1, 10**6)
    halves = estimate.estimate(base, config, pool, 2, 1, 10**6, dp=2)
    whole = estimate.estimate(base, config, pool, 1, 1, 10**6, dp=4)
    assert halves.mesh == "dp=2 x fsdp=2 x tp=1" and sharded.mesh == "fsdp=4 x tp=1"
    # Two replicas of two chips each: each chip holds half of the 57 GiB, twice what four shards hold.
    assert halves.weights_gib_per_chip == pytest.approx(2 * sharded.weights_gib_per_chip)
    assert halves.fits and halves.seconds == sharded.seconds  # the same chips at work on the same tokens
    # Four replicas of one chip: the weights and the step's second copy of them exceed a chip's 95 GB.
    assert not whole.fits and whole.lower == "config.mesh_dp" and "mesh_dp" in whole.warning


def test_auto_chunking_kicks_in_above_256_mib_of_logits():
    """The engine's choice of loss (estimate.loss_chunk, which worker/training/engine.py calls)."""
    assert estimate.loss_chunk(None, 128, 1280) is None
    assert estimate.loss_chunk(None, 8192, 262_144) == estimate.AUTO_CHUNK_TOKENS
    assert estimate.loss_chunk(0, 8192, 262_144) is None
    assert estimate.loss_chunk(512, 16, 1280) == 512
