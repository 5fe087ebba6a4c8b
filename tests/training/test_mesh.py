"""Training over a 4-device mesh (fsdp x tp) of fake CPU devices, and verifying its merge over the same
devices, in a fresh process; and over replicas of a tensor-parallel model (dp x tp), which learn the same,
each drawing its own dropout masks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_four_device_mesh(make_spec, tmp_path, jax_cache_dir):
    """fsdp=2 x tp=2 over 4 fake CPU devices, in a fresh process (XLA_FLAGS must precede JAX)."""
    spec = make_spec(max_steps=4, output_dir=str(tmp_path / "mesh"), mesh_fsdp=2, mesh_tp=2)
    # Two replicas, each a tp=2 model: each replica's gradients summed array by array (it spans 2 devices).
    replicas = make_spec(max_steps=4, output_dir=str(tmp_path / "replicas"), mesh_dp=2, mesh_tp=2)
    script = f"""
import json
import numpy as np
from flax import nnx
from worker.training import engine, models
import jax
assert jax.device_count() == 4, jax.devices()
class R:
    def __init__(self):
        self.steps, self.norms = {{}}, {{}}
    def phase(self, n): pass
    def metrics(self, s, v):
        if "loss" in v: self.steps[s], self.norms[s] = v["loss"], v["grad_norm"]
    def checkpoint(self, s, p, kept): pass
    def log(self, l): pass
    def held_out(self, lines): pass
    def should_stop(self): return False
r = R()
spec = engine.TrainSpec(**json.loads({json.dumps(json.dumps(spec.__dict__))}))
res = engine.train(spec, r)
# the run's LoRA merged, and the merge verified on this host of 4 devices
from worker.merge import merge_lora, verify_merged
lora = dict(rank=spec.lora_rank, alpha=spec.lora_alpha)
checkpoint = f"{{spec.output_dir}}/checkpoints/{{res.final_step}}"
merge_lora(spec.base_model_dir, checkpoint, f"{{spec.output_dir}}/merged", **lora)
report = verify_merged(f"{{spec.output_dir}}/merged", spec.base_model_dir, checkpoint, **lora,
                       target_modules=spec.target_modules)
r2 = R()
replicas = engine.TrainSpec(**json.loads({json.dumps(json.dumps(replicas.__dict__))}))
res2 = engine.train(replicas, r2)
# LoRA dropout on the replicas: what each replica's copy of the model draws from its dropout stream, twice
dropout = engine.TrainSpec(**{{**replicas.__dict__, "lora_dropout": 0.1}})
mesh = engine.make_mesh(1, 2, 2)
with mesh:
    model = models.load_base_model(dropout.base_model_dir, models.resolve_config(dropout.base_model_dir), mesh=mesh)
    model, _ = engine.apply_lora(model, dropout, engine.REMAT["none"])
    draw = nnx.jit(lambda m: engine.per_replica(
        m, {{"x": np.zeros((2, 1))}}, lambda copy, x: jax.random.uniform(copy.qwix_rngs["dropout"]())
    ))
    draws = [np.asarray(draw(model)).tolist() for _ in range(2)]
print("RESULT", json.dumps({{"final": res.final_step, "losses": r.steps, "norms": r.norms, "verification": report,
                            "replicas": {{"final": res2.final_step, "losses": r2.steps, "norms": r2.norms}},
                            "draws": draws}}))
"""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=4",
        "PYTHONPATH": str(ROOT),
        "TUNEDECK_JAX_CACHE_DIR": str(jax_cache_dir),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    losses = [out["losses"][str(s)] for s in range(1, 5)]
    assert out["final"] == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # The replicas learn what the sharded model learns from the same batches.
    assert out["replicas"]["final"] == 4
    assert out["replicas"]["norms"]["1"] == pytest.approx(out["norms"]["1"], rel=1e-5)
    for step, loss in out["losses"].items():
        assert out["replicas"]["losses"][step] == pytest.approx(loss, rel=1e-3), step
    # With dropout, each replica draws its own masks (its own random numbers), and new ones at each step.
    (a0, a1), (b0, b1) = out["draws"]
    assert a0 != a1 and b0 != b1, out["draws"]
    assert {a0, a1}.isdisjoint({b0, b1}), out["draws"]

    # Verification spreads each model over the host's devices as training does (fsdp): each of the 4 holds
    # about a quarter of the merged weights (a 31B merge, 57 GiB in bfloat16, fits a v6e-8's 31.25 GiB
    # chips only so; the norms are replicated), and the merge still computes what the LoRA model computes.
    report = out["verification"]
    weights = sum(p.stat().st_size for p in (Path(spec.output_dir) / "merged").glob("*.safetensors"))
    assert report["passed"] and report["devices"] == 4, report
    assert weights / 4 <= report["per_device_bytes"] < 0.3 * weights, (report, weights)
