"""Executing a run: a supervisor in the Celery task, and the training in a process of its own.

One run per OS process: Tunix's metrics logger resets process-global JAX listeners when it closes,
and a run that crashes (or runs out of memory) must not take the worker down. The supervisor
beats the run's heartbeat, and when the user cancels or pauses, gives the training process
`STOP_GRACE_S` to checkpoint and stop by itself before it is killed.

Importing JAX, Tunix and Qwix takes seconds, so each worker process keeps one training process
on standby, imports done, that takes the next run from its stdin (`Standby`); the next standby
starts when that run ends, so it never competes with a run for the CPU. With
`TUNEDECK_TRAINING_STANDBY=0` none waits: each run starts its training process when it starts.

    python -m worker.runs --standby     # a training process, waiting for "RUN_ID ATTEMPT PROCESS LOG_PATH"

On a pool of multi-host slices (a TPU v5p-16: 2 hosts), a run is JAX's multi-controller program: the
worker that takes it sends a task to each host of its slice (``execute_on_host``), and each host's
training process joins the others through ``jax.distributed.initialize`` at host 0's address, trains its
share of every global batch, and saves its part of each checkpoint into the pool's shared directory.
Process 0 reports metrics, checkpoints and events; every host's process reports its own step time.
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
from app.datasets.models import Dataset
from app.pools.models import Pool
from app.runs import service as runs
from app.runs.models import Run
from app.runs.service import run_dir
from worker import leases, processes
from worker.model_cache import cached_copy, local_dataset
from worker.processes import free_port

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


@dataclasses.dataclass(frozen=True)
class Process:
    """This host's place in a run on a multi-host slice: process ``index`` of ``hosts``, meeting the others
    at ``coordinator`` (host 0's address:port) through ``jax.distributed.initialize``."""

    index: int
    hosts: int
    coordinator: str

    def __str__(self) -> str:  # as the standby process reads it from its stdin
        return f"{self.index}/{self.hosts}@{self.coordinator}"

    @classmethod
    def parse(cls, text: str) -> "Process | None":
        if text == "-":
            return None
        place, coordinator = text.split("@", 1)
        index, hosts = place.split("/")
        return cls(int(index), int(hosts), coordinator)


def execute(run_id: str, worker: str) -> None:
    """Take a run (the Celery task's body): supervise its training here, or on a slice pool, hand it to
    every host of this worker's slice (``execute_on_host``)."""
    settings = get_settings()
    if settings.slice is not None:  # a slice pool's worker (its hosts' tasks take their own leases)
        with session_scope() as session:
            run = runs.start(session, run_id, worker)
            pool = session.get(Pool, run.pool) if run is not None else None
            if run is not None and pool is not None:
                runs.gang_start(session, run, settings.slice, pool.hosts_per_slice)
        return
    lease = leases.take_or_wait(
        f"run {run_id}", lambda session, why, retry_s: runs.wait_for_chips(session, run_id, why, retry_s)
    )
    if lease is None:
        return
    with lease, session_scope() as session:
        run = runs.start(session, run_id, worker)
        if run is not None:
            _supervise(session, run, run.attempts, None)


def execute_on_host(run_id: str, attempt: int, host_index: int, worker: str) -> None:
    """This host's part of a run on a slice (the Celery task's body): its training process, one of the
    slice's, supervised like a single host's run, on this host's chips (their lease; while another job
    holds them, its row says "waiting" and its task comes back a moment later)."""
    lease = leases.take_or_wait(
        f"run {run_id} (host {host_index} of its slice)",
        lambda session, why, retry_s: runs.host_waits_for_chips(
            session, run_id, attempt, host_index, worker, why, retry_s
        ),
    )
    if lease is None:
        return
    with lease:
        _on_host(run_id, attempt, host_index, worker)


def _on_host(run_id: str, attempt: int, host_index: int, worker: str) -> None:
    settings = get_settings()
    with session_scope() as session:
        run = runs.join(session, run_id, attempt, host_index, worker)
        if run is None:
            return
        pool = session.get(Pool, run.pool)
        assert pool is not None, "a run's pool cannot be deleted"
        if host_index == 0:
            coordinator = f"{settings.host_address}:{free_port('0.0.0.0')}"
            runs.set_coordinator(session, run, coordinator)
        else:
            coordinator = _coordinator(session, run, attempt, host_index)
            if coordinator is None:
                return
        _supervise(session, run, attempt, Process(host_index, pool.hosts_per_slice, coordinator))


def _coordinator(session, run: Run, attempt: int, host_index: int) -> str | None:
    """Where host 0 has the slice's processes meet, once it says; None if the attempt ends first."""
    deadline = time.monotonic() + get_settings().slice_join_seconds
    while time.monotonic() < deadline:
        if not runs.is_current(session, run, attempt):
            return None
        if run.coordinator:
            return run.coordinator
        runs.process_beat(session, run.id, host_index)
        time.sleep(0.5)
    host0 = next((p for p in runs.processes_of(session, run) if p.host_index == 0 and p.attempt == attempt), None)
    why = (
        "waited for its chips all that time" if host0 is not None and host0.state == "waiting" else "is its worker up?"
    )
    runs.fail(session, run, f"host 0 of slice {run.slice} never started its part of the run ({why})")
    return None


def _supervise(session, run: Run, attempt: int, process: Process | None) -> None:
    """Start the training process and watch it: beat the run's heartbeat (host 0's job on a slice; every
    host beats its own process row), pass on stop requests, and stop it when the run moves on."""
    out = run_dir(run.id)
    out.mkdir(parents=True, exist_ok=True)
    lead = process is None or process.index == 0
    log_path = out / (
        f"attempt-{attempt}.log" if process is None or lead else f"attempt-{attempt}-host-{process.index}.log"
    )
    child = Standby.take(run.id, attempt, log_path, process)
    requested: str | None = None  # the stop asked for (cancel, pause, handback), once asked
    try:
        stop_since: float | None = None
        while child.poll() is None:
            try:  # wakes as soon as the training process exits
                child.wait(timeout=HEARTBEAT_S if stop_since is None else 0.2)
            except subprocess.TimeoutExpired:
                pass
            if process is not None:
                runs.process_beat(session, run.id, process.index)
                if not runs.on_slice(session, run, attempt, process.coordinator):
                    processes.stop(child, grace_s=2)  # finished, failed or re-queued: the slice stops with it
                    return
                if lead and (silent := runs.silent_hosts(session, run, attempt)):
                    hosts = ", ".join(map(str, silent))
                    runs.requeue_lost(session, run, f"host {hosts} of slice {run.slice} stopped answering")
                    processes.stop(child, grace_s=2)
                    return
            if not lead:
                continue
            stop = runs.heartbeat(session, run)
            if stop and stop_since is None:
                stop_since, requested = time.monotonic(), stop
            if stop_since is not None and time.monotonic() - stop_since > STOP_GRACE_S:
                processes.stop(child, grace_s=2)
                if runs.is_current(session, run, attempt):
                    runs.finish(session, run, stopped_by=requested)
                return
        if process is not None and not lead and child.returncode == 0:
            # host 0 records how the slice's run ended, a moment after the processes stop together: this
            # task ends after it, so that a stopping worker's shutdown finds a handed-back run queued
            deadline = time.monotonic() + 10
            while runs.is_current(session, run, attempt) and time.monotonic() < deadline:
                time.sleep(0.2)
        # A process that died without recording an outcome (host 0's records it; another host's ends at 0).
        if runs.is_current(session, run, attempt) and run.status == "running" and (lead or child.returncode):
            if process is not None and _lost_a_host(session, run, attempt, process):
                return  # re-queued: the run resumes once the slice is whole
            reason = _crash_reason(child.returncode, log_path)
            runs.fail(session, run, reason if process is None else f"host {process.index} of {run.slice}: {reason}")
    finally:
        if requested != "handback" and get_settings().training_standby:  # a stopping worker needs none
            Standby.start()


def _lost_a_host(session, run: Run, attempt: int, process: Process) -> bool:
    """This host's process of a slice failed: when another host is gone (its collectives broke: "connection
    closed by peer"), that host's row falls silent within the stale bound, and the run is re-queued as a lost
    attempt rather than failed. True once re-queued (here, or by another host)."""
    deadline = time.monotonic() + get_settings().stale_after.total_seconds() + 2 * HEARTBEAT_S
    while time.monotonic() < deadline:
        if not runs.on_slice(session, run, attempt, process.coordinator):
            return True
        runs.process_beat(session, run.id, process.index)
        if process.index == 0:
            runs.heartbeat(session, run)  # the run is not lost meanwhile, only its other host
        silent = [i for i in runs.silent_hosts(session, run, attempt) if i != process.index]
        if silent:
            hosts = ", ".join(map(str, silent))
            runs.requeue_lost(session, run, f"host {hosts} of slice {run.slice} stopped answering")
            return True
        time.sleep(HEARTBEAT_S / 2)
    return False


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
    def take(cls, run_id: str, attempt: int, log_path: Path, process: Process | None = None) -> subprocess.Popen:
        """The standby process, now training this run (a fresh one if there was none)."""
        cls.start()
        proc, cls.proc = cls.proc, None
        assert proc is not None and proc.stdin is not None, "start() leaves a process reading its stdin"
        try:
            proc.stdin.write(f"{run_id} {attempt} {process or '-'} {log_path}\n".encode())
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

    def __init__(self, session, run: Run, attempt: int, host_index: int | None = None) -> None:
        self.session, self.run, self.attempt = session, run, attempt
        self.host_index = host_index  # on a slice: this host's process row gets its step time
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
            # resumed from a checkpoint (after a pause, or behind what a lost attempt reported), or started
            # over after an attempt that reported steps: forget what lies beyond
            if step > 1 or self.run.step > 0:
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
        self._beat()

    def _beat(self) -> None:
        step, values = self._last
        if self.host_index is not None and "step_time_s" in values:
            runs.process_beat(
                self.session,
                self.run.id,
                self.host_index,
                state="training",
                step=step,
                step_time_s=values["step_time_s"],
            )

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


class HostReporter(DBReporter):
    """The reporter of a slice's process on a host other than 0: process 0 reports the run, so this one
    only keeps its host's step time on its process row and its lines in its own log."""

    def phase(self, name: str) -> None:
        pass

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if "step_time_s" in values:
            self._last = (step, {k: float(v) for k, v in values.items()})
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        self._beat()

    def checkpoint(self, step: int, path: str, kept: list[int]) -> None:
        pass

    def log(self, line: str) -> None:
        log.info("%s", line)

    def held_out(self, lines: list[int]) -> None:
        pass

    def should_stop(self) -> bool:  # asked of process 0 only (the engine broadcasts its answer)
        if os.getppid() != self._supervisor:
            os._exit(3)
        return False


def build_spec(session, run: Run):
    """The engine's TrainSpec for a run: its config, files and base model, resolved on this host."""
    from worker.training.engine import TrainSpec

    cfg = run.config
    dataset = session.get(Dataset, run.dataset_id)
    validation = session.get(Dataset, run.validation_dataset_id) if run.validation_dataset_id else None
    base, preset = base_model_dir(session, run)

    def say(line: str) -> None:
        runs.log(session, run, line)

    # Config fields the engine shares with the API pass through by name; the rest is derived here.
    shared = {f.name: cfg[f.name] for f in dataclasses.fields(TrainSpec) if f.name in cfg}
    return TrainSpec(
        **{
            **shared,
            "base_model_dir": str(base),
            "preset": preset,
            "dataset_path": str(local_dataset(dataset, say)),
            "dataset_filename": dataset.filename,
            "file_type": dataset.file_type,
            "fmt": dataset.format,
            "validation_path": str(local_dataset(validation, say)) if validation else None,
            "validation_filename": validation.filename if validation else None,
            "validation_fraction": 0.0 if validation else cfg["validation_fraction"],
            "output_dir": str(runs.output_dir(session, run)),
            # The API's batch_size is the global batch per optimizer step; the engine's is per micro-batch.
            "batch_size": cfg["batch_size"] // cfg["grad_accum_steps"],
            "target_modules": tuple(cfg["target_modules"]),
        }
    )


def train_process(run_id: str, attempt: int, process: Process | None = None) -> int:
    """The training process: build the spec from the run's rows, train, record the outcome."""
    from worker.training.engine import train

    with session_scope() as session:
        run = session.get(Run, run_id)
        if run is None:  # its supervisor took it a moment ago; deleted since?
            raise SystemExit(f"run {run_id} no longer exists: nothing to train")
        lead = process is None or process.index == 0
        if process is not None and not _join_slice(session, run, attempt, process):
            return 1
        index = None if process is None else process.index
        reporter = DBReporter(session, run, attempt, index) if lead else HostReporter(session, run, attempt, index)
        try:
            result = train(build_spec(session, run), reporter)
        except Exception as exc:
            log.exception("training failed")
            reporter.flush()
            if process is not None:  # its supervisor decides: a lost peer re-queues the run, else it fails
                runs.process_beat(session, run.id, process.index, state="failed")
            elif runs.is_current(session, run, attempt):
                runs.fail(session, run, f"{type(exc).__name__}: {exc}"[:2000])
            return 1
        reporter.flush()
        if process is not None:
            runs.process_beat(session, run.id, process.index, state="stopped" if result.stopped_early else "done")
        if not lead or reporter.stop_reason == "superseded" or not runs.is_current(session, run, attempt):
            return 0
        runs.finish(session, run, stopped_by=reporter.stop_reason if result.stopped_early else None)
    return 0


def _join_slice(session, run: Run, attempt: int, process: Process) -> bool:
    """Join the slice's other processes (JAX's multi-controller runtime); False, with the run failed, when
    they do not all come within the join timeout."""
    import jax

    timeout = get_settings().slice_join_seconds
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU slices (tests); TPUs have their own
    try:
        jax.distributed.initialize(
            coordinator_address=process.coordinator,
            num_processes=process.hosts,
            process_id=process.index,
            initialization_timeout=int(timeout),
        )
    except Exception as exc:  # noqa: BLE001 - JAX raises several kinds; each means the slice did not meet
        log.exception("the slice's processes did not meet")
        if runs.is_current(session, run, attempt):
            runs.fail(
                session,
                run,
                f"the {process.hosts} hosts of slice {run.slice} did not all join at {process.coordinator} "
                f"within {timeout:.0f} s (host {process.index}: {type(exc).__name__}: {exc})"[:2000],
            )
        return False
    runs.process_beat(session, run.id, process.index, state="training")
    return True


def standby() -> int:
    """The standby process: import the trainer, wait for a run, log to its file, train it."""
    processes.lean_jax_imports()
    import worker.training.engine  # noqa: F401 - the slow imports, done ahead of time (JAX's backends wait)

    line = sys.stdin.readline()
    if not line.strip():  # the worker went away without giving us a run
        return 0
    run_id, attempt, process, log_path = line.rstrip("\n").split(" ", 3)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO)
    return train_process(run_id, int(attempt), Process.parse(process))


if __name__ == "__main__":
    sys.exit(standby())
