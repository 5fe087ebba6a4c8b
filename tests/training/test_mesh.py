"""Training over a 4-device mesh (fsdp x tp) of fake CPU devices, in a fresh process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_four_device_mesh(make_spec, tmp_path, jax_cache_dir):
    """fsdp=2 x tp=2 over 4 fake CPU devices, in a fresh process (XLA_FLAGS must precede JAX)."""
    spec = make_spec(max_steps=4, output_dir=str(tmp_path / "mesh"), mesh_fsdp=2, mesh_tp=2)
    script = f"""
import json
from worker.training import engine
import jax
assert jax.device_count() == 4, jax.devices()
class R:
    steps = {{}}
    def phase(self, n): pass
    def metrics(self, s, v):
        if "loss" in v: self.steps[s] = v["loss"]
    def checkpoint(self, s, p, kept): pass
    def log(self, l): pass
    def held_out(self, lines): pass
    def should_stop(self): return False
r = R()
res = engine.train(engine.TrainSpec(**json.loads({json.dumps(json.dumps(spec.__dict__))})), r)
print("RESULT", json.dumps({{"final": res.final_step, "losses": r.steps}}))
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
