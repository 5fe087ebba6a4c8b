"""Model FLOPs per token (the MFU numerator) and the accelerator peak table (its denominator)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.base_models.presets import BASE_MODELS, lora_params
from worker.training import engine, models, perf


def test_flops_per_token_counts_the_frozen_matmuls_the_lora_weights_and_attention(make_spec, tiny_model):
    spec = make_spec(lora_rank=4)
    config = models.resolve_config(spec.base_model_dir, spec.preset)
    model, n_lora = engine.apply_lora(models.load_base_model(tiny_model, config), spec, models.RematConfig.NONE)
    arch = BASE_MODELS["tiny-gemma4"].arch
    # The app's independent count of the weights in matrices.
    matmul_params = arch.params()
    assert n_lora == lora_params(arch, 4, spec.target_modules)
    seq = spec.max_seq_len
    # Layer 0 slides over a window of 32: a query at position p sees min(p, 32) keys, on average
    # (1 + ... + 32 + 32 * 32) / 64 = 24.25; layer 1 is global: (64 + 1) / 2 on average.
    assert (seq, config.sliding_window_size) == (64, 32)
    attention = 4 * arch.num_heads * (arch.head_dim * 24.25 + arch.global_head_dim * 32.5)
    expected = 4 * matmul_params + 6 * n_lora + 3 * attention
    assert perf.flops_per_token(model, config, seq) == pytest.approx(expected)


def test_a_sliding_window_caps_the_attended_positions():
    assert perf._attended(8, None) == 4.5
    assert perf._attended(8, 2) == pytest.approx((1 + 2 * 7) / 8)


@pytest.mark.parametrize(
    ("kind", "peak"),
    [("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v6 lite", 918e12), ("NVIDIA H100 80GB HBM3", 989e12)],
)
def test_known_accelerators_have_a_peak(kind, peak):
    assert perf.peak_flops(SimpleNamespace(device_kind=kind)) == peak


def test_the_cpu_has_no_peak_so_no_mfu_is_made_up():
    assert perf.peak_flops(SimpleNamespace(device_kind="cpu")) is None
    assert perf.device_memory_gb() is None  # JAX's CPU client keeps no memory stats
