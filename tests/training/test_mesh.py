"""Training over a 4-device mesh (fsdp x tp) of fake CPU devices, and verifying its merge over the same
devices, in a fresh process; and over replicas of a tensor-parallel model (dp x tp) with LoRA dropout."""

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
    # Two replicas, each a tp=2 model, with LoRA dropout (random keys that the replicas advance): it learns.
    replicas = make_spec(
        max_steps=4, output_dir=str(tmp_path / "replicas"), mesh_dp=2, mesh_tp=2, lora_dropout=0.1, batch_size=4
    )
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
r2.steps = {{}}
res2 = engine.train(engine.TrainSpec(**json.loads({json.dumps(json.dumps(replicas.__dict__))})), r2)
print("RESULT", json.dumps({{"final": res.final_step, "losses": r.steps, "verification": report,
                            "replicas": {{"final": res2.final_step, "losses": r2.steps}}}}))
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
    dropped = [out["replicas"]["losses"][str(s)] for s in range(1, 5)]
    assert out["replicas"]["final"] == 4 and all(math.isfinite(x) for x in dropped) and dropped[-1] < dropped[0]

    # Verification spreads each model over the host's devices as training does (fsdp): each of the 4 holds
    # about a quarter of the merged weights (a 31B merge, 57 GiB in bfloat16, fits a v6e-8's 31.25 GiB
    # chips only so; the norms are replicated), and the merge still computes what the LoRA model computes.
    report = out["verification"]
    weights = sum(p.stat().st_size for p in (Path(spec.output_dir) / "merged").glob("*.safetensors"))
    assert report["passed"] and report["devices"] == 4, report
    assert weights / 4 <= report["per_device_bytes"] < 0.3 * weights, (report, weights)
