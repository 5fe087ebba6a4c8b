"""Datasets: store uploads, queue their validation, record the result, list, delete."""

import hashlib
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import ColumnElement, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import defer
from sqlmodel import Session, col, func, select

from app.auth.models import User
from app.core import queue
from app.core.config import Settings, get_settings
from app.core.db import claim, utcnow
from app.core.echo import STORED_CHARS, clip, echo
from app.core.schemas import NUL
from app.core.security import new_id
from app.core.uploads import ReceivedFile
from app.datasets import demo
from app.datasets.models import FILENAME_LENGTH, Dataset, DatasetStatus
from app.datasets.validation import FILE_TYPES, FORMATS, DatasetFormatError, validate_file

PURPOSES = ("fine-tune",)
# A validation whose worker process dies this often (killed; a file can make it run out of memory) gives
# up: the dataset ends invalid instead of killing the general queue's consumers again and again.
MAX_VALIDATION_ATTEMPTS = 3
REPORT_COLUMNS = (Dataset.duplicates, Dataset.stats, Dataset.preview)  # bulky; errors are capped and listed


class DatasetInUse(Exception):
    pass


class InvalidOption(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def incoming_dir(settings: Settings) -> Path:
    return settings.storage_dir / "datasets" / ".incoming"


def file_path(dataset: Dataset, settings: Settings | None = None) -> Path:
    return (settings or get_settings()).storage_dir / dataset.storage_key


def check_options(file_type: str | None, fmt: str | None, purpose: str | None, filename: str = "") -> None:
    if len(filename) > FILENAME_LENGTH:
        raise InvalidOption("file", f"the file name has {len(filename)} characters; at most {FILENAME_LENGTH}")
    if NUL in filename:
        raise InvalidOption("file", "the file name must not contain a NUL character")
    if file_type and file_type not in FILE_TYPES:
        raise InvalidOption(
            "file_type", f"unknown file_type {echo(file_type)}; expected one of {', '.join(FILE_TYPES)}"
        )
    if fmt and fmt not in FORMATS:
        raise InvalidOption("format", f"unknown format {echo(fmt)}; expected one of {', '.join(FORMATS)}")
    if purpose is not None and purpose not in PURPOSES:
        raise InvalidOption("purpose", f"unsupported purpose {echo(purpose)}; expected one of {', '.join(PURPOSES)}")


def create_from_upload(
    session: Session,
    owner: User,
    upload: ReceivedFile,
    *,
    file_type: str | None = None,
    fmt: str | None = None,
    purpose: str = "fine-tune",
) -> Dataset:
    """Move a fully received upload into storage, record it, and queue its validation."""
    check_options(file_type, fmt, purpose, upload.filename)
    assert owner.id is not None, "the owner is a saved user"
    queue.check_broker()
    settings = get_settings()
    dataset_id = new_id("ds")
    key = f"datasets/{dataset_id}/data"
    final = settings.storage_dir / key
    final.parent.mkdir(parents=True, exist_ok=True)
    upload.path.rename(final)
    dataset = Dataset(
        id=dataset_id,
        owner_id=owner.id,
        filename=upload.filename,
        purpose=purpose,
        bytes=upload.size,
        sha256=upload.sha256,
        storage_key=key,
        requested_file_type=file_type or None,
        requested_format=fmt or None,
    )
    try:
        session.add(dataset)
        session.commit()
    except BaseException:
        session.rollback()
        shutil.rmtree(final.parent, ignore_errors=True)
        raise
    session.refresh(dataset)
    queue.send_task(queue.VALIDATE_DATASET, dataset.id)
    return dataset


def waiting_tasks(session: Session) -> list[queue.Waiting]:
    """Uploads whose validation no worker has taken yet (one taken has attempts)."""
    rows = session.exec(
        select(Dataset.id, Dataset.updated_at).where(Dataset.status == DatasetStatus.validating, Dataset.attempts == 0)
    ).all()
    return [queue.Waiting(queue.VALIDATE_DATASET, queue.GENERAL_QUEUE, id_, since) for id_, since in rows]


def create_demo(session: Session, owner: User) -> Dataset:
    """Import the bundled demo dataset, as if uploaded (stored, hashed, validated)."""
    return create_from_bytes(session, owner, demo.DEMO_FILENAME, demo.demo_dataset_jsonl())


def create_from_bytes(
    session: Session, owner: User, filename: str, content: bytes, *, fmt: str | None = None
) -> Dataset:
    """A file Tunedeck made (the demo set, an export), stored and validated as if uploaded."""
    tmp = incoming_dir(get_settings())
    tmp.mkdir(parents=True, exist_ok=True)
    upload = ReceivedFile(
        "file",
        filename,
        tmp / f".upload-{uuid.uuid4().hex}.part",
        len(content),
        hashlib.sha256(content).hexdigest(),
    )
    upload.path.write_bytes(content)
    try:
        return create_from_upload(session, owner, upload, fmt=fmt)
    finally:
        upload.path.unlink(missing_ok=True)


def list_datasets(
    session: Session,
    owner: User,
    *,
    limit: int = 100,
    offset: int = 0,
    status: DatasetStatus | None = None,
    purpose: str | None = None,
    after: Dataset | None = None,
) -> tuple[list[Dataset], int]:
    """Newest first. `after` is a cursor: only datasets older than it (OpenAI's pagination)."""
    where: list[ColumnElement[bool]] = [col(Dataset.owner_id) == owner.id]
    if status is not None:
        where.append(col(Dataset.status) == status)
    if purpose is not None:
        where.append(col(Dataset.purpose) == purpose)
    if after is not None:
        where.append(tuple_(Dataset.created_at, Dataset.id) < tuple_(after.created_at, after.id))
    count = session.exec(select(func.count()).select_from(Dataset).where(*where)).one()
    rows = session.exec(
        select(Dataset)
        .where(*where)
        .order_by(col(Dataset.created_at).desc(), col(Dataset.id).desc())
        # lists never show these (SQLModel types the class attributes as their values; they are columns)
        .options(*(defer(c, raiseload=True) for c in REPORT_COLUMNS))  # pyright: ignore[reportArgumentType]
        .offset(offset)
        .limit(limit)
    ).all()
    return list(rows), count


def get_dataset(session: Session, owner: User, dataset_id: str) -> Dataset | None:
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or dataset.owner_id != owner.id:
        return None
    return dataset


def delete_dataset(session: Session, dataset: Dataset) -> None:
    """Delete the row, then the file. Tables that reference a dataset (runs) restrict deletion."""
    path = file_path(dataset)
    try:
        session.delete(dataset)
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise DatasetInUse(f"dataset {dataset.id} is used by a run; delete the run first") from exc
    shutil.rmtree(path.parent, ignore_errors=True)


def validate(session: Session, dataset_id: str, locate: Callable[[Dataset], Path] = file_path) -> Dataset | None:
    """Validate a stored dataset (the worker's job, ``locate`` giving its file on the worker's host);
    records the report or the reason it failed.

    Each delivery of the task takes the dataset for one more attempt (``claim``); a dataset still
    `validating` when a delivery comes had its earlier attempts' processes die, and after
    MAX_VALIDATION_ATTEMPTS of those it ends invalid, saying so. None when there is nothing to do
    (deleted, already validated, or taken by another delivery)."""
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or dataset.status != DatasetStatus.validating:
        return None
    if dataset.attempts >= MAX_VALIDATION_ATTEMPTS:
        _fail(
            dataset,
            f"{dataset.filename}: validation gave up: the process validating it was lost {dataset.attempts} times "
            "(killed, perhaps for running out of memory)",
        )
        return _done(session, dataset)
    if not claim(session, dataset, progress_bytes=0, updated_at=utcnow()):
        return None

    def progress(done: int, total: int) -> None:
        dataset.progress_bytes = done
        dataset.updated_at = utcnow()
        session.add(dataset)
        session.commit()

    try:
        report = validate_file(
            locate(dataset),
            dataset.filename,
            file_type=dataset.requested_file_type,
            fmt=dataset.requested_format,
            progress=progress,
            max_bytes=get_settings().max_upload_bytes,
        )
    except DatasetFormatError as exc:
        _fail(dataset, str(exc))
    except Exception as exc:
        session.rollback()
        _fail(dataset, f"validation crashed: {type(exc).__name__}: {exc}")
        _done(session, dataset)
        raise
    else:
        dataset.file_type, dataset.format = report.file_type, report.format
        dataset.rows, dataset.valid_rows = report.rows, report.valid_rows
        dataset.errors, dataset.error_count = report.errors, report.error_count
        dataset.duplicates, dataset.duplicate_count = report.duplicates, report.duplicate_count
        dataset.stats, dataset.preview = report.stats, report.preview
        dataset.status = DatasetStatus.ready if report.ok else DatasetStatus.invalid
    return _done(session, dataset)


def _done(session: Session, dataset: Dataset) -> Dataset:
    _finish(session, dataset)
    from app.runs import service as runs  # runs build on datasets; import here to keep that direction

    runs.on_dataset_validated(session, dataset)
    return dataset


def _fail(dataset: Dataset, message: str) -> None:
    dataset.status = DatasetStatus.invalid
    dataset.errors = [{"line": None, "field": None, "message": clip(message, STORED_CHARS)}]
    dataset.error_count = 1


def _finish(session: Session, dataset: Dataset) -> None:
    dataset.progress_bytes = dataset.bytes
    dataset.validated_at = dataset.updated_at = utcnow()
    session.add(dataset)
    session.commit()
