"""Fixtures for the merge tests: the training tests' tiny model and spec factory (shared, not copied),
one real LoRA training of it, and its f32 merge, each made once per session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.training import conftest as training

# The training tests' fixtures, shared with this directory (pytest finds fixtures by module attribute).
TARGETS = training.TARGETS
Recorder = training.Recorder
capitals_file = training.capitals_file
jax_cache_dir = training.jax_cache_dir
make_spec = training.make_spec
tiny_model = training.tiny_model

_CACHE: dict[str, object] = {}


@dataclasses.dataclass(frozen=True)
class LoraRun:
    """A finished LoRA training of the tiny model: what a merge needs."""

    base_dir: str
    checkpoint: str  # <output_dir>/checkpoints/<step>
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def lora(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha}


@pytest.fixture
def lora_run(make_spec, Recorder, tmp_path_factory) -> LoraRun:
    """A few steps at a high learning rate on all 7 projections, so that B is far from zero (trained once)."""
    if "lora_run" not in _CACHE:
        from worker.training import engine

        spec = make_spec(output_dir=str(tmp_path_factory.mktemp("lora-run")), max_steps=6, learning_rate=2e-2)
        result = engine.train(spec, Recorder())
        checkpoint = Path(spec.output_dir) / "checkpoints" / str(result.final_step)
        _CACHE["lora_run"] = LoraRun(spec.base_model_dir, str(checkpoint), spec.lora_rank, spec.lora_alpha, TARGETS)
    return _CACHE["lora_run"]


@pytest.fixture
def merged(lora_run, tmp_path_factory) -> Path:
    """lora_run merged into the f32 tiny model (made once; tests only read it)."""
    if "merged" not in _CACHE:
        from worker.merge import merge_lora

        out = tmp_path_factory.mktemp("merged") / "tiny-merged"
        merge_lora(lora_run.base_dir, lora_run.checkpoint, str(out), **lora_run.lora)
        _CACHE["merged"] = out
    return _CACHE["merged"]


@pytest.fixture
def lora_model(lora_run):
    """The f32 tiny model with lora_run's LoRA applied by Qwix, as training ran it (built once)."""
    if "lora_model" not in _CACHE:
        from worker.merge import verify

        _CACHE["lora_model"] = verify.lora_model(
            lora_run.base_dir, lora_run.checkpoint, **lora_run.lora, target_modules=lora_run.targets, dtype="float32"
        )
    return _CACHE["lora_model"]
