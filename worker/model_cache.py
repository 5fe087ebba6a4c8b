"""What a worker copies to its own host once: base models from remote sources (``gs://`` and other
fsspec URLs), artifacts built on another host, and datasets uploaded to another host's web app.

Tunix's safetensors loader reads local files, so a worker copies a registered remote checkpoint to
``<data dir>/models/cache/<name>-<hash of the URL>/`` before it trains. A worker that serves, evaluates
or benchmarks an artifact needs its files on its own disk too (vLLM's container mounts a local
directory): it uses the artifact where it was built when that path holds its files on this host, and
otherwise copies it into ``<data dir>/cache/artifacts/<id>/``, from the artifact store when there is one,
else from the web app's download route (a worker credential signed with the shared secret), checking
every file's size and sha256 against the artifact's manifest. That cache is bounded
(``TUNEDECK_ARTIFACT_CACHE_GB``): the least recently used copies that no live endpoint serves go first.
A dataset's file comes the same way (the web app's internal route, sha256 checked against its upload)
into ``<data dir>/cache/datasets/<id>/``.

One copy of a source at a time: a copy holds that source's lock (a file lock beside it, so it holds
across the processes and hosts that share the data dir), writes into a temporary directory of its own
and renames it into place when every file is there. So a process that waits for the lock finds the
copy there, an interrupted copy is never mistaken for a finished one, and two copies at once never
publish a partial directory.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import httpx
from filelock import FileLock

from app.artifacts.models import Artifact
from app.core.config import get_settings
from app.core.security import WORKER_TOKEN_HEADER, worker_token
from app.datasets import service as datasets
from app.datasets.models import Dataset

CHUNK = 1 << 20


def cached_copy(source: str, cache_root: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """The local copy of the checkpoint directory at URL ``source`` (made now if missing)."""
    dest = cache_root / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    return publish_once(dest, lambda into: _copy(source, into, name, log))


def publish_once(dest: Path, fill: Callable[[Path], None]) -> Path:
    """``dest``, made by ``fill`` (into an empty temporary directory beside it, renamed into place when
    ``fill`` returns) unless it is there already; one maker at a time."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dest.parent / f".{dest.name}.lock"):
        if dest.is_dir():  # made by another process while this one waited
            return dest
        for partial in dest.parent.glob(f".{dest.name}.partial*"):  # copies that died half-way
            shutil.rmtree(partial, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        try:
            fill(tmp)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _copy(source: str, into: Path, name: str, log: Callable[[str], None]) -> None:
    fs, root = fsspec.core.url_to_fs(source)
    files = [f for f in fs.ls(root, detail=True) if f["type"] == "file"]
    total = sum(f.get("size") or 0 for f in files)
    log(f"copying base model {name} from {source}: {len(files)} files, {total / 1e9:.2f} GB")
    done = 0
    for f in files:
        fs.get_file(f["name"], str(into / posixpath.basename(f["name"])))
        done += f.get("size") or 0
        log(f"copied {posixpath.basename(f['name'])} ({done / 1e9:.2f} of {total / 1e9:.2f} GB)")


def local_artifact(artifact: Artifact, keep: Callable[[], set[str]], log: Callable[[str], None] = print) -> Path:
    """A directory on this host holding the files of a succeeded artifact: where it was built, when that
    path holds them here; else this host's copy (made now if missing). ``keep`` names the artifacts whose
    copies must stay (live endpoints serve them) when the cache is trimmed to its bound."""
    if "://" not in artifact.path and _holds(Path(artifact.path), artifact.files):
        return Path(artifact.path)
    settings = get_settings()
    root = settings.data_dir / "cache" / "artifacts"
    dest = publish_once(root / artifact.id, lambda into: _fetch(artifact, into, log))
    os.utime(dest)  # the last use: the least recently used copies are removed first
    trim(root, int(settings.artifact_cache_gb * 1e9), keep=keep() | {artifact.id}, log=log)
    return dest


def local_dataset(dataset: Dataset, log: Callable[[str], None] = print) -> Path:
    """A dataset's file on this host: where the web app stored it, when this host sees it there; else this
    host's copy under ``<data dir>/cache/datasets/<id>/`` (fetched now if missing, sha256 checked)."""
    stored = datasets.file_path(dataset)
    if stored.is_file() and stored.stat().st_size == dataset.bytes:
        return stored
    dest = publish_once(
        get_settings().data_dir / "cache" / "datasets" / dataset.id, lambda into: _fetch_dataset(dataset, into, log)
    )
    return dest / "data"


def _fetch_dataset(dataset: Dataset, into: Path, log: Callable[[str], None]) -> None:
    url = f"{get_settings().web_base_url}/internal/datasets/{dataset.id}/file"
    log(f"copying dataset {dataset.id} ({dataset.filename}, {dataset.bytes / 1e6:.1f} MB) from {url}")
    digest = hashlib.sha256()
    target = into / "data"
    with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as client:
        with client.stream("GET", url, headers={WORKER_TOKEN_HEADER: worker_token(dataset.id)}) as response:
            if response.status_code != 200:
                response.read()
                raise ValueError(f"dataset {dataset.id}: {url} answered {response.status_code}: {response.text[:300]}")
            with open(target, "wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
    size = target.stat().st_size
    if size != dataset.bytes or digest.hexdigest() != dataset.sha256:
        raise ValueError(
            f"dataset {dataset.id}: its file arrived with {size} bytes and sha256 {digest.hexdigest()}; "
            f"it was uploaded with {dataset.bytes} bytes, sha256 {dataset.sha256}"
        )


def _holds(directory: Path, files: list[dict]) -> bool:
    return directory.is_dir() and all(
        (directory / f["path"]).is_file() and (directory / f["path"]).stat().st_size == f["size"] for f in files
    )


def _fetch(artifact: Artifact, into: Path, log: Callable[[str], None]) -> None:
    """Every file of the artifact into ``into``, from its store (a URL) or the web app, each checked
    against its size and sha256 in the artifact's manifest."""
    total = sum(f["size"] for f in artifact.files)
    remote = "://" in artifact.path
    where = artifact.path if remote else get_settings().web_base_url
    log(f"copying artifact {artifact.id} from {where}: {len(artifact.files)} files, {total / 1e9:.2f} GB")
    done = 0
    with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as client:
        for entry in artifact.files:
            target = into / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            name = entry["path"]
            chunks = _store_chunks(artifact, name) if remote else _web_chunks(artifact, name, client)
            with open(target, "wb") as out:
                for chunk in chunks:
                    digest.update(chunk)
                    out.write(chunk)
            size = target.stat().st_size
            if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
                raise ValueError(
                    f"artifact {artifact.id}: {entry['path']} arrived with {size} bytes and sha256 "
                    f"{digest.hexdigest()}; its manifest says {entry['size']} bytes, sha256 {entry['sha256']}"
                )
            done += size
            log(f"copied {entry['path']} ({done / 1e9:.2f} of {total / 1e9:.2f} GB, sha256 checked)")


def _store_chunks(artifact: Artifact, name: str) -> Iterator[bytes]:
    fs, root = fsspec.core.url_to_fs(artifact.path)
    with fs.open(posixpath.join(root, name), "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _web_chunks(artifact: Artifact, name: str, client: httpx.Client) -> Iterator[bytes]:
    url = f"{get_settings().web_base_url}/internal/artifacts/{artifact.id}/files/{name}"
    headers = {WORKER_TOKEN_HEADER: worker_token(artifact.id)}
    with client.stream("GET", url, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise ValueError(f"artifact {artifact.id}: {url} answered {response.status_code}: {response.text[:300]}")
        yield from response.iter_bytes(CHUNK)


def trim(root: Path, budget: int, keep: set[str], log: Callable[[str], None] = print) -> None:
    """Remove the least recently used copies under ``root`` (not those in ``keep``) until they take at
    most ``budget`` bytes, each under its lock (never one being made or read by another process)."""
    copies = [(p.stat().st_mtime, p) for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for _, p in copies}
    used = sum(sizes.values())
    for _, path in sorted(copies):
        if used <= budget:
            return
        if path.name in keep:
            continue
        with FileLock(root / f".{path.name}.lock"):
            shutil.rmtree(path, ignore_errors=True)
        used -= sizes[path]
        log(f"removed this host's copy of artifact {path.name} ({sizes[path] / 1e9:.2f} GB, least recently used)")
