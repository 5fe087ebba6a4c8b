"""Fixtures for the training tests: one tiny Gemma 4 checkpoint and one JAX compilation cache per
session (real Tunix training on CPU, no mocks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# 20 countries, asked two ways, always answered the same way: the tiny model learns it in ~60 steps.
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Cuba", "Havana"),
    ("Chile", "Santiago"),
    ("Greece", "Athens"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("India", "New Delhi"),
    ("Canada", "Ottawa"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Sweden", "Stockholm"),
]


def capitals_records() -> list[dict]:
    rows = []
    for country, capital in CAPITALS:
        for q in ("What is the capital of {}?", "Which city is the capital of {}?"):
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": q.format(country)},
                        {"role": "assistant", "content": f"The capital of {country} is {capital}."},
                    ]
                }
            )
    return rows


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


class RecordingReporter:
    """A Reporter that records everything; ``stop_after`` makes should_stop() return True when asked
    before step ``stop_after + 1`` of a fresh run (the engine asks once before each optimizer step)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple] = []
        self.stop_after = stop_after
        self.polls = 0

    def phase(self, name: str) -> None:
        self.events.append(("phase", name))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.events.append(("metrics", step, dict(values)))

    def checkpoint(self, step: int, path: str, kept: list[int]) -> None:
        self.events.append(("checkpoint", step, path, list(kept)))

    def log(self, line: str) -> None:
        self.events.append(("log", line))

    def held_out(self, lines: list[int]) -> None:
        self.events.append(("held_out", list(lines)))

    def should_stop(self) -> bool:
        self.polls += 1
        return self.stop_after is not None and self.polls > self.stop_after

    # -- views ---------------------------------------------------------------------------------
    @property
    def phases(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "phase"]

    @property
    def train_metrics(self) -> dict[int, dict]:
        return {e[1]: e[2] for e in self.events if e[0] == "metrics" and "loss" in e[2]}

    @property
    def train_steps(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "metrics" and "loss" in e[2]]

    @property
    def eval_losses(self) -> dict[int, float]:
        return {e[1]: e[2]["eval_loss"] for e in self.events if e[0] == "metrics" and "eval_loss" in e[2]}

    @property
    def checkpoints(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "checkpoint"]

    @property
    def logs(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "log"]


@pytest.fixture(scope="session")
def Recorder():  # noqa: N802 - a class
    """The RecordingReporter class (fixtures hand it out: conftest modules are not importable by name)."""
    return RecordingReporter


@pytest.fixture(scope="session")
def jax_cache_dir() -> Path:
    """The persistent compilation cache these tests share with each other, with the other test process and
    with the test servers' training processes: the one Tunedeck uses by default (`$TUNEDECK_JAX_CACHE_DIR`,
    else ~/.cache/tunedeck/jax). A program is compiled once however many tests and processes run it; what
    is compiled does not depend on the cache (a program is looked up by a hash of itself)."""
    from worker.training.engine import configure_compilation_cache

    return Path(configure_compilation_cache())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from worker.training.tiny import create_tiny_gemma4

    return create_tiny_gemma4(tmp_path_factory.mktemp("models") / "tiny-gemma4")


@pytest.fixture(scope="session")
def capitals_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "capitals.jsonl", capitals_records())


@pytest.fixture
def make_spec(tiny_model, capitals_file, jax_cache_dir, tmp_path):
    """TrainSpec factory with small, fast defaults (override any field)."""
    from worker.training.engine import TrainSpec

    base = TrainSpec(
        base_model_dir=str(tiny_model),
        preset="tiny-gemma4",
        dataset_path=str(capitals_file),
        dataset_filename="capitals.jsonl",
        file_type="jsonl",
        fmt="chat",
        validation_path=None,
        validation_filename=None,
        validation_fraction=0.1,
        output_dir=str(tmp_path / "run"),
        lora_rank=8,
        lora_alpha=16.0,
        lora_dropout=0.0,
        target_modules=TARGETS,
        learning_rate=1e-2,
        lr_schedule="constant",
        warmup_steps=0,
        epochs=None,
        max_steps=10,
        batch_size=8,
        grad_accum_steps=1,
        max_seq_len=64,
        packing=True,
        assistant_only_loss=True,
        seed=0,
        eval_every_steps=1000,
        checkpoint_every_steps=1000,
        checkpoints_kept=5,
        mesh_fsdp=1,
        mesh_tp=1,
        remat="none",
        dtype="float32",
        quantization=None,
    )

    def make(**overrides):
        return dataclasses.replace(base, **overrides)

    return make
