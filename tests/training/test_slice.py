"""Training as JAX's multi-controller program: 2 processes x 2 CPU devices joined by
``jax.distributed.initialize`` (gloo collectives) learn exactly what 1 process on a 4-device mesh learns
from the same seed and global batch, whether the weights are sharded over the 4 devices (fsdp) or copied
to 4 replicas that sum their gradients as one buffer (dp)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import jax
processes, index, coordinator, spec, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=index)
from worker.training import engine

class Reporter:
    def __init__(self):
        self.losses, self.norms, self.evals, self.checkpoints, self.logs = {}, {}, {}, [], []
    def phase(self, name): pass
    def metrics(self, step, values):
        if "loss" in values: self.losses[step] = values["loss"]
        if "grad_norm" in values: self.norms[step] = values["grad_norm"]
        if "eval_loss" in values: self.evals[step] = values["eval_loss"]
    def checkpoint(self, step, path, kept): self.checkpoints.append(step)
    def log(self, line): self.logs.append(line)
    def held_out(self, lines): pass
    def should_stop(self): return False

r = Reporter()
result = engine.train(engine.TrainSpec(**json.load(open(spec))), r)
json.dump({"final": result.final_step, "rows": result.metrics["global_batch_rows"], "losses": r.losses,
           "norms": r.norms, "evals": r.evals, "checkpoints": r.checkpoints, "logs": r.logs,
           "processes": jax.process_count(), "devices": jax.device_count()}, open(out, "w"))
"""


def train_in(processes: int, spec, tmp_path: Path, jax_cache_dir: Path) -> list[dict]:
    """Train ``spec`` in ``processes`` processes of 4 / ``processes`` CPU devices each; what each reported."""
    spec_file = tmp_path / f"spec-{processes}.json"
    spec_file.write_text(json.dumps(dataclasses.asdict(spec)))
    coordinator = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={4 // processes}",
        "PYTHONPATH": str(ROOT),
        "TUNEDECK_JAX_CACHE_DIR": str(jax_cache_dir),
    }
    outs = [tmp_path / f"out-{processes}-{i}.json" for i in range(processes)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(processes), str(i), coordinator, str(spec_file), str(outs[i])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    for i, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"process {i}: {output[-4000:]}"
    return [json.loads(out.read_text()) for out in outs]


def test_two_processes_learn_what_one_process_learns_on_the_same_mesh(make_spec, tmp_path, jax_cache_dir):
    def spec(name: str, dp: int = 1):
        return make_spec(
            max_steps=6,
            batch_size=8,
            mesh_dp=dp,
            mesh_fsdp=4 // dp,
            checkpoint_every_steps=3,
            eval_every_steps=3,
            output_dir=str(tmp_path / name),
        )

    (alone,) = train_in(1, spec("alone"), tmp_path, jax_cache_dir)
    both = train_in(2, spec("slice"), tmp_path, jax_cache_dir)
    replicas = train_in(2, spec("replicas", dp=4), tmp_path, jax_cache_dir)

    assert alone["processes"] == 1 and [b["processes"] for b in both] == [2, 2]
    assert alone["devices"] == both[0]["devices"] == 4
    assert any("jax.process_count() == 2" in line for line in both[0]["logs"])
    # Each process fed only its half of every batch: the global batch is the one-process run's 8 rows
    # (fed all 8, each process would make it 16: the same rows twice, and the same mean loss), and so
    # each step's loss is the one-process run's.
    assert alone["rows"] == both[0]["rows"] == both[1]["rows"] == 8
    for steps in (alone["losses"], both[0]["losses"], both[1]["losses"]):
        assert sorted(map(int, steps)) == [1, 2, 3, 4, 5, 6]
    # Step 1's loss is the same sums over the same rows; later steps drift by float rounding only (the
    # gradients are summed across processes in another order), at 1e-4 of the loss in 6 steps.
    assert both[0]["losses"]["1"] == pytest.approx(alone["losses"]["1"], rel=1e-6)
    assert both[0]["norms"]["1"] == pytest.approx(alone["norms"]["1"], rel=1e-5)
    for step, loss in alone["losses"].items():
        assert both[0]["losses"][step] == pytest.approx(loss, rel=1e-3), step
        assert both[1]["losses"][step] == both[0]["losses"][step]
    # Both processes took part in each save, into the one directory: saved once, at each step.
    assert both[0]["checkpoints"] == both[1]["checkpoints"] == alone["checkpoints"] == [3, 6]
    saved = tmp_path / "slice" / "checkpoints"
    assert sorted(p.name for p in saved.iterdir() if p.name.isdigit()) == ["3", "6"]

    # Four replicas across the two processes (each replica's gradients of its own 2 rows, weighted by the
    # tokens it scored and summed as one buffer) take the same steps as the one process's fsdp step of
    # Tunix's own, which takes the mean over all 8 rows at once.
    assert replicas[0]["rows"] == 8 and replicas[0]["checkpoints"] == [3, 6]
    assert replicas[0]["losses"]["1"] == pytest.approx(alone["losses"]["1"], rel=1e-6)
    # (Step 1's loss is the forward pass alone, LoRA's B starting at 0; its gradient norm is the backward's.)
    assert replicas[0]["norms"]["1"] == pytest.approx(alone["norms"]["1"], rel=1e-5)
    for step, loss in alone["losses"].items():
        assert replicas[0]["losses"][step] == pytest.approx(loss, rel=1e-3), step
        assert replicas[1]["losses"][step] == replicas[0]["losses"][step]
    # Each replica scores its own rows of the held-out batches too, weighed as the whole batch weighs them.
    assert sorted(map(int, alone["evals"])) == [0, 3, 6]
    for step, loss in alone["evals"].items():
        assert replicas[0]["evals"][step] == pytest.approx(loss, rel=1e-3), step
