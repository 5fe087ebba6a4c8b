"""The pre-flight memory estimate (app.runs.estimate) against XLA's own figures for the compiled
train step of the tiny model: every row within 25%. Compiles only (no step runs)."""

from __future__ import annotations

import dataclasses

from app.base_models.presets import BASE_MODELS
from worker.training import engine, memory


def test_estimate_is_within_25_percent_of_xla(jax_cache_dir):
    engine.configure_compilation_cache()
    arch = BASE_MODELS["tiny-gemma4"].arch
    measured = memory.measure_many(dataclasses.asdict(arch), memory.TINY_ROWS, compiler_options=memory.FAST_COMPILE)
    rows = memory.compare(arch, memory.TINY_ROWS, measured)
    print("\n" + memory.format_rows(rows))
    assert len(rows) == 9
    for row in rows:
        assert 0.75 <= row["temp_ratio"] <= 1.25, row
        assert 0.75 <= row["peak_ratio"] <= 1.25, row
