"""Executing a run: a supervisor in the Celery task, and the training in a process of its own.

One run per OS process: Tunix's metrics logger resets process-global JAX listeners when it closes,
and a run that crashes (or runs out of memory) must not take the worker down. The supervisor
beats the run's heartbeat, and when the user cancels or pauses, gives the training process
`STOP_GRACE_S` to checkpoint and stop by itself before it is killed.

    python -m worker.runs RUN_ID ATTEMPT     # the training process (started by `execute`)
"""

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.core.config import get_settings
from app.core.db import session_scope
from app.datasets import service as datasets
from app.datasets.models import Dataset
from app.runs import service as runs
from app.runs.models import Run

log = logging.getLogger(__name__)

STOP_GRACE_S = 8.0
HEARTBEAT_S = 2.0


def run_dir(run_id: str) -> Path:
    return get_settings().data_dir / "runs" / run_id


def base_model_dir(name: str) -> Path:
    return get_settings().data_dir / "models" / name


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
        with open(log_path, "ab") as log_file:
            child = subprocess.Popen(
                [sys.executable, "-m", "worker.runs", run_id, str(attempt)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            stop_since: float | None = None
            while child.poll() is None:
                time.sleep(HEARTBEAT_S if stop_since is None else 0.2)
                stop = runs.heartbeat(session, run)
                if stop and stop_since is None:
                    stop_since = time.monotonic()
                if stop_since is not None and time.monotonic() - stop_since > STOP_GRACE_S:
                    _kill(child)
                    if runs.is_current(session, run, attempt):
                        runs.finish(session, run, stopped_by=stop)
                    return
        if runs.is_current(session, run, attempt) and run.status == "running":
            # The process died without recording an outcome.
            runs.fail(session, run, _crash_reason(child.returncode, log_path))


def _die_with_parent() -> None:
    """In the training process, before exec: be killed when the supervisor dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill(child: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=2)
            return
        except subprocess.TimeoutExpired:
            continue


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
        self._last: dict[str, float] = {}
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
        self._last = {**self._last, **values}  # a checkpoint carries the latest loss and eval loss
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        runs.record_metrics(self.session, self.run, self._pending)
        self._pending = []
        self._flushed = time.monotonic()

    def checkpoint(self, step: int, path: str) -> None:
        self.flush()
        runs.record_checkpoint(self.session, self.run, step, path, self._last)

    def log(self, line: str) -> None:
        runs.log(self.session, self.run, line)

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


def train_process(run_id: str, attempt: int) -> int:
    """The training process: build the spec from the run's rows, train, record the outcome."""
    from worker.training.engine import TrainSpec, train
    from worker.training.tiny import create_tiny_gemma4

    with session_scope() as session:
        run = session.get(Run, run_id)
        cfg = run.config
        base = base_model_dir(run.base_model)
        if run.base_model == "tiny-gemma4":
            create_tiny_gemma4(base)
        dataset = session.get(Dataset, run.dataset_id)
        validation = session.get(Dataset, run.validation_dataset_id) if run.validation_dataset_id else None
        # Config fields the engine shares with the API pass through by name; the rest is derived here.
        shared = {f.name: cfg[f.name] for f in dataclasses.fields(TrainSpec) if f.name in cfg}
        spec = TrainSpec(
            **{
                **shared,
                "base_model_dir": str(base),
                "preset": run.base_model,
                "dataset_path": str(datasets.file_path(dataset)),
                "dataset_filename": dataset.filename,
                "file_type": dataset.file_type,
                "fmt": dataset.format,
                "validation_path": str(datasets.file_path(validation)) if validation else None,
                "validation_filename": validation.filename if validation else None,
                "validation_fraction": 0.0 if validation else cfg["validation_fraction"],
                "output_dir": str(run_dir(run_id)),
                # The API's batch_size is the global batch per optimizer step; the engine's is per micro-batch.
                "batch_size": cfg["batch_size"] // cfg["grad_accum_steps"],
                "target_modules": tuple(cfg["target_modules"]),
            }
        )
        reporter = DBReporter(session, run, attempt)
        try:
            result = train(spec, reporter)
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(train_process(sys.argv[1], int(sys.argv[2])))
