"""Executing a run: a supervisor in the Celery task, and the training in a process of its own.

One run per OS process: Tunix's metrics logger resets process-global JAX listeners when it closes,
and a run that crashes (or runs out of memory) must not take the worker down. The supervisor
beats the run's heartbeat, and when the user cancels or pauses, gives the training process
`STOP_GRACE_S` to checkpoint and stop by itself before it is killed.

Importing JAX, Tunix and Qwix takes seconds, so each worker process keeps one training process
on standby, imports done, that takes the next run from its stdin (`Standby`); the next standby
starts when that run ends, so it never competes with a run for the CPU. With
`TUNEDECK_TRAINING_STANDBY=0` none waits: each run starts its training process when it starts.

    python -m worker.runs --standby     # a training process, waiting for "RUN_ID ATTEMPT LOG_PATH"
"""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.base_models import service as base_models
from app.core.config import get_settings
from app.core.db import session_scope
from app.datasets import service as datasets
from app.datasets.models import Dataset
from app.runs import service as runs
from app.runs.models import Run
from app.runs.service import run_dir
from worker import processes
from worker.model_cache import cached_copy

log = logging.getLogger(__name__)

STOP_GRACE_S = 8.0
HEARTBEAT_S = 2.0


def base_model_dir(session, run: Run) -> tuple[Path, str]:
    """The local HF checkpoint directory of the run's base model, and the preset to check it against."""
    return model_dir(session, run.base_model, lambda line: runs.log(session, run, line))


def model_dir(session, name: str, log_line: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """The local HF checkpoint directory of a base model, and its preset. Presets live under
    ``<data dir>/models/<name>`` (``tiny-gemma4`` is made there on first use); registered sources are a
    local directory, or a URL copied to this host once (``log_line`` hears how the copy goes)."""
    from worker.training.tiny import create_tiny_gemma4

    preset, row = base_models.resolve(session, name)
    models_dir = get_settings().data_dir / "models"
    if row is None:
        path = models_dir / preset.name
        if preset.local:
            create_tiny_gemma4(path)
        return path, preset.name
    if "://" not in row.source:
        return Path(row.source), preset.name
    return cached_copy(row.source, models_dir / "cache", row.name, log_line or log.info), preset.name


def execute(run_id: str, worker: str) -> None:
    """Supervise one attempt at a run (the Celery task's body)."""
    with session_scope() as session:
        run = runs.start(session, run_id, worker)
        if run is None:
            return
        attempt = run.attempts
        out = run_dir(run_id)
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / f"attempt-{attempt}.log"
        child = Standby.take(run_id, attempt, log_path)
        requested: str | None = None  # the stop asked for (cancel, pause, handback), once asked
        try:
            stop_since: float | None = None
            while child.poll() is None:
                try:  # wakes as soon as the training process exits
                    child.wait(timeout=HEARTBEAT_S if stop_since is None else 0.2)
                except subprocess.TimeoutExpired:
                    pass
                stop = runs.heartbeat(session, run)
                if stop and stop_since is None:
                    stop_since, requested = time.monotonic(), stop
                if stop_since is not None and time.monotonic() - stop_since > STOP_GRACE_S:
                    processes.stop(child, grace_s=2)
                    if runs.is_current(session, run, attempt):
                        runs.finish(session, run, stopped_by=requested)
                    return
            if runs.is_current(session, run, attempt) and run.status == "running":
                # The process died without recording an outcome.
                runs.fail(session, run, _crash_reason(child.returncode, log_path))
        finally:
            if requested != "handback" and get_settings().training_standby:  # a stopping worker needs none
                Standby.start()


class Standby:
    """This worker process's training process on standby (see the module docstring)."""

    proc: subprocess.Popen | None = None

    @classmethod
    def start(cls) -> None:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.runs", "--standby"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=processes.die_with_parent,
            )

    @classmethod
    def take(cls, run_id: str, attempt: int, log_path: Path) -> subprocess.Popen:
        """The standby process, now training this run (a fresh one if there was none)."""
        cls.start()
        proc, cls.proc = cls.proc, None
        assert proc is not None and proc.stdin is not None, "start() leaves a process reading its stdin"
        try:
            proc.stdin.write(f"{run_id} {attempt} {log_path}\n".encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died since start() looked: its exit code says why, as a crash would
            pass
        return proc


def _crash_reason(code: int, log_path: Path) -> str:
    tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
    if code == -signal.SIGKILL or "RESOURCE_EXHAUSTED" in tail or "Out of memory" in tail or "MemoryError" in tail:
        return (
            "out of memory: lower config.batch_size or config.max_seq_len, raise config.grad_accum_steps, "
            "or set config.remat to 'block'"
        )
    last = [line for line in tail.splitlines() if line.strip()][-1:] or [f"exit code {code}"]
    return f"training process exited with code {code}: {last[0][:500]}"


class DBReporter:
    """The engine's reporter: phases, metrics (batched), checkpoints and logs go to the run's rows."""

    FLUSH_S = 1.0
    STOP_POLL_S = 1.0

    def __init__(self, session, run: Run, attempt: int) -> None:
        self.session, self.run, self.attempt = session, run, attempt
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._flushed = time.monotonic()
        self._polled = 0.0
        self._stop: str | None = None
        self._last: tuple[int, dict[str, float]] = (0, {})  # the latest step and its values
        self._first_step: int | None = None
        self._supervisor = os.getppid()

    def phase(self, name: str) -> None:
        self.flush()
        self._stop = self._stop or runs.heartbeat(self.session, self.run, phase=name)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if self._first_step is None:
            self._first_step = step
            if step > 1:  # resumed from a checkpoint (after a pause, or behind what a lost attempt reported)
                runs.rewind(self.session, self.run, step - 1)
        values = {k: float(v) for k, v in values.items()}
        self._pending.append((step, values))
        last_step, last = self._last
        self._last = (step, {**last, **values} if step == last_step else values)
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        runs.record_metrics(self.session, self.run, self._pending)
        self._pending = []
        self._flushed = time.monotonic()

    def checkpoint(self, step: int, path: str, kept: list[int]) -> None:
        self.flush()
        last_step, values = self._last
        # The step's train metrics; its eval loss, measured after the save, is added when it comes.
        runs.record_checkpoint(self.session, self.run, step, path, values if last_step == step else {}, kept)

    def log(self, line: str) -> None:
        runs.log(self.session, self.run, line)

    def held_out(self, lines: list[int]) -> None:
        runs.held_out(self.session, self.run, lines)

    def should_stop(self) -> bool:
        if os.getppid() != self._supervisor:  # the supervisor is gone (its worker was killed): so are we
            os._exit(3)
        now = time.monotonic()
        if self._stop is None and now - self._polled >= self.STOP_POLL_S:
            self._polled = now
            self.session.refresh(self.run)
            self._stop = self.run.stop_requested
            if not runs.is_current(self.session, self.run, self.attempt):
                self._stop = "superseded"  # the run ended or another attempt took it: stop quietly
        return self._stop is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop


def build_spec(session, run: Run):
    """The engine's TrainSpec for a run: its config, files and base model, resolved on this host."""
    from worker.training.engine import TrainSpec

    cfg = run.config
    dataset = session.get(Dataset, run.dataset_id)
    validation = session.get(Dataset, run.validation_dataset_id) if run.validation_dataset_id else None
    base, preset = base_model_dir(session, run)
    # Config fields the engine shares with the API pass through by name; the rest is derived here.
    shared = {f.name: cfg[f.name] for f in dataclasses.fields(TrainSpec) if f.name in cfg}
    return TrainSpec(
        **{
            **shared,
            "base_model_dir": str(base),
            "preset": preset,
            "dataset_path": str(datasets.file_path(dataset)),
            "dataset_filename": dataset.filename,
            "file_type": dataset.file_type,
            "fmt": dataset.format,
            "validation_path": str(datasets.file_path(validation)) if validation else None,
            "validation_filename": validation.filename if validation else None,
            "validation_fraction": 0.0 if validation else cfg["validation_fraction"],
            "output_dir": str(run_dir(run.id)),
            # The API's batch_size is the global batch per optimizer step; the engine's is per micro-batch.
            "batch_size": cfg["batch_size"] // cfg["grad_accum_steps"],
            "target_modules": tuple(cfg["target_modules"]),
        }
    )


def train_process(run_id: str, attempt: int) -> int:
    """The training process: build the spec from the run's rows, train, record the outcome."""
    from worker.training.engine import train

    with session_scope() as session:
        run = session.get(Run, run_id)
        if run is None:  # its supervisor took it a moment ago; deleted since?
            raise SystemExit(f"run {run_id} no longer exists: nothing to train")
        reporter = DBReporter(session, run, attempt)
        try:
            result = train(build_spec(session, run), reporter)
        except Exception as exc:
            log.exception("training failed")
            reporter.flush()
            if runs.is_current(session, run, attempt):
                runs.fail(session, run, f"{type(exc).__name__}: {exc}"[:2000])
            return 1
        reporter.flush()
        if reporter.stop_reason == "superseded" or not runs.is_current(session, run, attempt):
            return 0
        runs.finish(session, run, stopped_by=reporter.stop_reason if result.stopped_early else None)
    return 0


def standby() -> int:
    """The standby process: import the trainer, wait for a run, log to its file, train it."""
    processes.lean_jax_imports()
    import worker.training.engine  # noqa: F401 - the slow imports, done ahead of time

    line = sys.stdin.readline()
    if not line.strip():  # the worker went away without giving us a run
        return 0
    run_id, attempt, log_path = line.rstrip("\n").split(" ", 2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO)
    return train_process(run_id, int(attempt))


if __name__ == "__main__":
    sys.exit(standby())
