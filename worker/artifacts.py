"""Building an artifact: the LoRA of one run checkpoint merged into its base (then verified), or
exported as a PEFT adapter.

The Celery task supervises a process of its own (`python -m worker.artifacts ARTIFACT_ID`): the
verification loads models with JAX, which must not stay in the long-lived worker, and a merge
that is killed leaves only a staging directory that the next attempt clears.
"""

import dataclasses
import hashlib
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fsspec

from app.artifacts import service as artifacts
from app.artifacts.models import Artifact, ArtifactKind
from app.core.db import session_scope
from app.runs import service as runs
from app.runs.models import Run
from worker import leases
from worker.processes import die_with_parent, lean_jax_imports
from worker.runs import HEARTBEAT_S, base_model_dir

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5


def execute(artifact_id: str, worker: str) -> None:
    """The Celery task's body: take the artifact and build it in a child process, beating while it
    runs (a build whose beats stop is re-queued by the pool's workers: ``artifacts.requeue_stale``). A
    merge's verification runs the model on this host's chips: it holds their lease (an adapter's export
    needs none)."""
    with session_scope() as session:
        row = session.get(Artifact, artifact_id)
        verified = row is not None and row.kind == ArtifactKind.merged
    if not verified:
        supervise_build(artifact_id, worker)
        return
    lease = leases.take_or_wait(
        f"the merge of artifact {artifact_id} (its verification)",
        lambda session, why, retry_s: artifacts.wait_for_chips(session, artifact_id, why, retry_s),
    )
    if lease is None:
        return
    with lease:
        supervise_build(artifact_id, worker)


def supervise_build(artifact_id: str, worker: str) -> None:
    """Take the artifact and build it here, in a child process (``build``). The caller holds this host's
    chips where the build needs them (``execute``, or an evaluation that merges the checkpoints it serves)."""
    with session_scope() as session:
        artifact = artifacts.start(session, artifact_id, worker)
        if artifact is None:
            return
        out = artifacts.build_dir(artifact_id)
        out.parent.mkdir(parents=True, exist_ok=True)
        log_path = out.parent / f"{artifact_id}.log"
        with open(log_path, "ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "worker.artifacts", artifact_id],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
            while True:
                try:
                    code = child.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    artifacts.heartbeat(session, artifact)
        session.refresh(artifact)
        if code != 0 and artifact.status == "running":
            tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
            artifacts.fail(session, artifact, f"the build process exited with code {code}: {''.join(tail)[:500]}")


def _manifest_entry(out: Path) -> dict:
    data = (out / "manifest.json").read_bytes()
    return {"path": "manifest.json", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def build(artifact_id: str) -> int:
    """The build process."""
    from worker.merge import export_peft, merge_lora, verify_merged

    with session_scope() as session:
        artifact = session.get(Artifact, artifact_id)
        run = session.get(Run, artifact.run_id) if artifact is not None else None
        if artifact is None or run is None:  # its supervisor took it a moment ago; deleted since?
            raise SystemExit(f"artifact {artifact_id} or its run no longer exists: nothing to build")
        cfg = run.config
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S or done == total:
                last[0] = time.monotonic()
                artifacts.progress(session, artifact, done, total)

        out = artifacts.build_dir(artifact_id)
        shutil.rmtree(out, ignore_errors=True)  # a whole artifact left by an attempt that died before recording it
        try:
            base, _ = base_model_dir(session, run)
            checkpoint = runs.output_dir(session, run) / "checkpoints" / str(artifact.checkpoint_step)
            lora = {"rank": cfg["lora_rank"], "alpha": cfg["lora_alpha"]}
            verification = None
            if artifact.kind == ArtifactKind.merged:
                result = merge_lora(str(base), str(checkpoint), str(out), progress=progress, **lora)
                verification = verify_merged(
                    str(out), str(base), str(checkpoint), target_modules=cfg["target_modules"], **lora
                )
            else:
                result = export_peft(
                    str(base),
                    str(checkpoint),
                    str(out),
                    base_model_name_or_path=run.base_model,
                    progress=progress,
                    **lora,
                )
        except Exception as exc:
            log.exception("building %s failed", artifact_id)
            artifacts.fail(session, artifact, f"{type(exc).__name__}: {exc}"[:2000])
            return 0
        files = [dataclasses.asdict(f) for f in result.files] + [_manifest_entry(out)]
        if verification is not None and not verification["passed"]:
            shutil.rmtree(out, ignore_errors=True)  # never offered for deploy: keep only the finding
            artifacts.fail(
                session,
                artifact,
                f"verification failed: merged logits differ from the LoRA model's by up to "
                f"{verification['max_abs_diff']:.3g} (tolerance {verification['tolerance']:.3g}), "
                f"top tokens agree at {verification['argmax_agreement']:.1%} of positions",
                verification,
            )
            return 0
        if artifact.path != str(out):  # an artifact store (gs://...): upload, then free the local disk
            fs, root = fsspec.core.url_to_fs(artifact.path)
            if fs.exists(root):
                fs.rm(root, recursive=True)
            fs.put(str(out), root, recursive=True)
            shutil.rmtree(out)
        artifacts.succeed(session, artifact, files, verification)
    return 0


if __name__ == "__main__":
    lean_jax_imports()
    logging.basicConfig(level=logging.INFO)
    sys.exit(build(sys.argv[1]))
