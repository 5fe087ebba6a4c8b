"""A worker's task that finds a row it needs gone fails with a reason naming it, instead of an
AttributeError on None: a vLLM endpoint whose pool was deleted while it waited for a worker (it fails
at once, not `starting` until a stale sweep blames its heartbeat), and a benchmark whose dataset was
deleted while it waited."""

import pytest
from sqlmodel import Session

from app.artifacts.models import Artifact, ArtifactKind, ArtifactStatus
from app.auth.models import User
from app.core.config import get_settings
from app.core.db import get_engine, reset_engine, upgrade
from app.datasets.models import Dataset
from app.endpoints.models import Endpoint, EndpointStatus, Runtime
from app.pools.models import Pool
from app.runs.models import Run


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A session on a fresh, migrated SQLite database in a data dir of its own; with one user's
    dataset, run and merged artifact on the cpu pool."""
    tmp_path = tmp_path_factory.mktemp("gone")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TUNEDECK_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("TUNEDECK_DATABASE_URL", raising=False)
        get_settings.cache_clear()
        reset_engine()
        upgrade()
        yield from _rows(tmp_path)
    reset_engine()
    get_settings.cache_clear()


def _rows(tmp_path):
    with Session(get_engine()) as s:
        user = User(username="owner", hashed_password="-")
        s.add(user)
        s.add(Pool(name="cpu", accelerator="cpu", chips=1, price_per_chip_hour=0.0))
        s.commit()
        assert user.id is not None
        s.add(Dataset(id="ds-1", owner_id=user.id, filename="d.jsonl", bytes=1, sha256="0" * 64, storage_key="k"))
        s.commit()
        s.add(Run(id="run-1", owner_id=user.id, base_model="tiny-gemma4", dataset_id="ds-1", pool="cpu", config={}))
        s.commit()
        s.add(
            Artifact(
                id="art-1",
                owner_id=user.id,
                run_id="run-1",
                kind=ArtifactKind.merged,
                status=ArtifactStatus.succeeded,
                checkpoint_step=1,
                name="ft:tiny",
                path=str(tmp_path / "art-1"),
            )
        )
        s.commit()
        yield s


def test_a_vllm_endpoint_whose_pool_was_deleted_fails_naming_it(session):
    from worker.endpoints import supervise

    # Deployed on a TPU pool, which an admin then deleted (pools hold no endpoints): its task is
    # still on the pool's queue, and a worker of that queue takes it.
    session.add(
        Endpoint(
            id="ep-1",
            owner_id=1,
            artifact_id="art-1",
            model="ft:tiny",
            pool="tpu-gone",
            runtime=Runtime.vllm_tpu,
            settings={"max_model_len": 512, "max_num_seqs": 4},
        )
    )
    session.commit()
    with pytest.raises(ValueError, match="pool 'tpu-gone' no longer exists"):
        supervise("ep-1", "worker-a")
    endpoint = session.get_one(Endpoint, "ep-1")
    session.refresh(endpoint)
    assert endpoint.status == EndpointStatus.failed
    assert endpoint.error is not None and "pool 'tpu-gone' no longer exists" in endpoint.error


def test_a_benchmark_whose_dataset_was_deleted_names_it(session):
    from worker.benchmarks import _prompts

    endpoint = Endpoint(id="ep-2", owner_id=1, artifact_id="art-1", model="ft:tiny", pool="cpu")
    with pytest.raises(ValueError, match="dataset ds-gone no longer exists"):
        _prompts(session, endpoint, {"num_prompts": 4, "dataset_id": "ds-gone", "seed": 0, "input_len": 8})
