"""Slice coordination overhead: the tiny Gemma 4 trained as JAX's multi-controller program (2 processes
x 2 CPU devices, joined by ``jax.distributed.initialize`` with gloo collectives, as a run on a 2-host
slice trains) against the same 4-device mesh in one process, in one run.

    .venv/bin/python bench/slice.py [--meshes dp=4,fsdp=4] [--steps 40] [--batch 8] [--seq 128] [--skip 5] [--repeat 2]

Both sides run Tunedeck's training engine (``worker.training.engine.train``) on the same spec: LoRA rank
16 on all seven projections, the demo dataset, no eval, one checkpoint at the end, on each mesh asked for:

- ``dp=4``: four replicas (``mesh_dp``), the weights copied to each; each step sums the LoRA gradients
  across them as one flat buffer (the engine's ``replica_train_step``). What a model that fits one chip,
  as this one does, trains on.
- ``fsdp=4``: the weights sharded four ways; XLA's partitioner gathers them and sums each gradient on
  its own. What a model too large for one chip needs.

Steps/s is 1 / the median of the engine's ``step_time_s`` (wall time between step ends) over the steps
after the first ``--skip`` (compile and warm-up), best of ``--repeat`` runs per side. The collectives per
step are counted in XLA's optimized program of the train step (``--xla_dump_to``): all-reduce,
all-gather, reduce-scatter, collective-permute and all-to-all ops (with the arrays of those that carry a
tuple), plus the one broadcast per step that carries process 0's stop decision to the others. On this CPU
stand-in each array is a gloo exchange over loopback that costs milliseconds whatever its size, so their
number is what the ratio measures.

Goal: slice / one process >= 0.8 on the replicated mesh. It reports; it does not assert.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL = 0.8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

WORKER = """
import json, sys
import jax
processes, index, coordinator, spec, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
if processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=index)
from worker.training import engine

class Reporter:
    times = {}
    def phase(self, name): pass
    def metrics(self, step, values):
        if "step_time_s" in values: self.times[step] = values["step_time_s"]
    def checkpoint(self, step, path, kept): pass
    def log(self, line): pass
    def held_out(self, lines): pass
    def should_stop(self): return False

r = Reporter()
engine.train(engine.TrainSpec(**json.load(open(spec))), r)
json.dump(r.times, open(out, "w"))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_spec(args, mesh: dict[str, int], work: Path, name: str) -> Path:
    from app.datasets.demo import demo_dataset_jsonl
    from worker.training.engine import TrainSpec
    from worker.training.tiny import create_tiny_gemma4

    model = work / "tiny-gemma4"
    if not model.exists():
        create_tiny_gemma4(model)
    data = work / "demo.jsonl"
    data.write_bytes(demo_dataset_jsonl())
    spec = TrainSpec(
        base_model_dir=str(model),
        preset="tiny-gemma4",
        dataset_path=str(data),
        dataset_filename="demo.jsonl",
        file_type="jsonl",
        fmt="chat",
        validation_path=None,
        validation_filename=None,
        validation_fraction=0.0,
        output_dir=str(work / name),
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.0,
        target_modules=TARGETS,
        learning_rate=1e-3,
        lr_schedule="constant",
        warmup_steps=0,
        epochs=None,
        max_steps=args.steps,
        batch_size=args.batch,
        grad_accum_steps=1,
        max_seq_len=args.seq,
        packing=True,
        assistant_only_loss=True,
        seed=0,
        eval_every_steps=10**6,
        checkpoint_every_steps=10**6,
        checkpoints_kept=1,
        mesh_fsdp=mesh.get("fsdp", 1),
        mesh_tp=1,
        mesh_dp=mesh.get("dp", 1),
        remat="none",
        dtype="float32",
        quantization=None,
    )
    path = work / f"{name}.json"
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    return path


def train(processes: int, spec: Path, work: Path, dump: Path | None = None) -> list[float]:
    """Step times (s) reported by process 0 of ``processes`` processes over 4 CPU devices in all."""
    flags = f"--xla_force_host_platform_device_count={4 // processes}"
    if dump is not None:
        flags += f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT)}
    coordinator = f"127.0.0.1:{free_port()}"
    outs = [work / f"times-{processes}-{i}.json" for i in range(processes)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(processes), str(i), coordinator, str(spec), str(outs[i])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    for i, proc in enumerate(procs):
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"process {i} of {processes} failed:\n{err[-3000:]}")
    times = json.loads(outs[0].read_text())
    return [times[k] for k in sorted(times, key=int)]


def collectives(dump: Path) -> dict[str, tuple[int, int]]:
    """Collective ops in the optimized program of the train step (the largest optimized module), and the
    arrays they carry: XLA may make one op of several arrays (a tuple), which gloo still sends one by one."""
    modules = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    step = next((p for p in reversed(modules) if "train_step" in p.name), modules[-1] if modules else None)
    if step is None:
        return {}
    text = step.read_text(errors="replace")
    counts = {}
    for op in COLLECTIVES:
        calls = re.findall(rf"\b{op}(?:-start)?\(([^)]*)\)", text)
        counts[op] = (len(calls), sum(max(1, call.count("%")) for call in calls))
    return counts


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=4`` or ``dp=2xfsdp=2`` -> {"dp": 4}; the axes must multiply to the 4 devices."""
    mesh = {name: int(size) for name, size in (part.split("=") for part in text.split("x"))}
    if set(mesh) - {"dp", "fsdp"} or math.prod(mesh.values()) != 4:
        raise SystemExit(f"mesh {text!r}: dp and fsdp sizes whose product is 4")
    return mesh


def measure(args, text: str, work: Path) -> float:
    mesh = parse_mesh(text)
    best: dict[int, float] = {}
    for attempt in range(args.repeat):
        for processes in (1, 2):
            spec = make_spec(args, mesh, work, f"run-{text}-{processes}-{attempt}")
            dump = work / f"dump-{text}" if processes == 2 and attempt == 0 else None
            times = train(processes, spec, work, dump)[args.skip :]
            rate = 1 / statistics.median(times)
            best[processes] = max(best.get(processes, 0.0), rate)
            print(f"  {text}, {processes} process(es), round {attempt + 1}: {rate:.2f} steps/s", flush=True)
    counts = collectives(work / f"dump-{text}")
    ratio = best[2] / best[1]
    ops = (
        ", ".join(
            f"{n} {op}" + (f" ({arrays} arrays)" if arrays > n else "") for op, (n, arrays) in counts.items() if n
        )
        or "none found"
    )
    print(
        f"{text}: slice (2 processes x 2 devices) {best[2]:.2f} steps/s; one process (4 devices) {best[1]:.2f} "
        f"steps/s; ratio {ratio:.3f}; collectives per step: {ops} in the train step, +1 broadcast (the stop "
        "decision)",
        flush=True,
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", default="dp=4,fsdp=4", help="comma-separated; the first is held to the goal")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.steps <= args.skip + 2:
        raise SystemExit("--steps must be more than --skip + 2")

    meshes = args.meshes.split(",")
    with tempfile.TemporaryDirectory(prefix="tunedeck-bench-slice-") as tmp:
        ratios = {text: measure(args, text, Path(tmp)) for text in meshes}
    print(
        f"ratio {ratios[meshes[0]]:.3f} on {meshes[0]} (goal >= {GOAL})"
        + "".join(f"; {text}: {r:.3f}" for text, r in list(ratios.items())[1:])
        + f"\n({args.steps} steps of batch {args.batch} x {args.seq}, median step time after {args.skip}, "
        f"best of {args.repeat})"
    )


if __name__ == "__main__":
    main()
