"""A remote base model copied to a worker's cache: two processes copying the same source at once (two
runs of the same model starting together, on one host or on hosts sharing the data dir) publish one
complete directory, and leave no partial copy behind."""

import hashlib
import multiprocessing
import os
import threading
import time
from pathlib import Path

from worker.model_cache import cached_copy

FILES = 12


def _slow_log(_line: str) -> None:
    time.sleep(0.03)  # a copy takes a while (a 31B model: minutes): the two overlap


def _copy(source: str, cache_root: str, start, results) -> None:
    start.wait()
    results.put(str(cached_copy(source, Path(cache_root), "m", log=_slow_log)))


def _listing(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_two_copies_at_once_publish_one_complete_directory(tmp_path):
    source = tmp_path / "bucket" / "gemma"
    source.mkdir(parents=True)
    for i in range(FILES):
        (source / f"model-{i:05d}.safetensors").write_bytes(os.urandom(64 * 1024))
    expected = _listing(source)
    url = f"file://{source}"
    cache = tmp_path / "cache"
    dest = cache / f"m-{hashlib.sha256(url.encode()).hexdigest()[:12]}"
    crashed = cache / f".{dest.name}.partial"  # a copy of the same source that died half-way
    crashed.mkdir(parents=True)
    (crashed / "model-00000.safetensors").write_bytes(b"half")

    # Whenever the model's directory is there, it is complete.
    seen_partial: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if dest.is_dir():
                try:
                    listed = _listing(dest)
                except FileNotFoundError:
                    listed = {}
                if listed != expected:
                    seen_partial.append(len(listed))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_copy, args=(url, str(cache), start, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    stop.set()
    watcher.join()

    assert [p.exitcode for p in procs] == [0, 0], "a copy failed"
    assert {results.get(timeout=5) for _ in procs} == {str(dest)}
    assert _listing(dest) == expected
    assert not seen_partial, f"a partial directory was published ({seen_partial} files of {FILES})"
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [dest.name], "a temporary directory was left"


def _stored_artifact(tmp_path: Path, files: dict[str, bytes], manifest: dict[str, bytes] | None = None):
    """An artifact kept in a file:// store (as gs:// is, through the same fsspec code) whose manifest
    lists ``manifest`` (default: the files as they are)."""
    from app.artifacts.models import Artifact, ArtifactKind, ArtifactStatus

    store = tmp_path / "store" / "art-1"
    store.mkdir(parents=True)
    for name, data in files.items():
        (store / name).write_bytes(data)
    listed = manifest if manifest is not None else files
    return Artifact(
        id="art-1",
        owner_id=1,
        run_id="run-1",
        kind=ArtifactKind.merged,
        checkpoint_step=1,
        name="ft:m",
        status=ArtifactStatus.succeeded,
        path=f"file://{store}",
        files=[{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in listed.items()],
    )


def test_an_artifact_is_copied_to_the_host_checked_against_its_manifest(tmp_path, monkeypatch):
    """A stored artifact is copied into the host's cache and used from there; a file that does not match
    its manifest (size or sha256) stops the copy with an error naming it, and leaves nothing behind."""
    from app.core.config import get_settings
    from worker.model_cache import local_artifact

    monkeypatch.setenv("TUNEDECK_DATA_DIR", str(tmp_path / "host"))
    get_settings.cache_clear()
    try:
        files = {"model.safetensors": os.urandom(3 << 20), "config.json": b"{}", "manifest.json": b"{}"}
        good = _stored_artifact(tmp_path / "a", files)
        lines: list[str] = []
        copy = local_artifact(good, set, log=lines.append)
        assert copy == tmp_path / "host" / "cache" / "artifacts" / "art-1"
        assert _listing(copy) == dict(sorted(files.items()))
        assert "sha256 checked" in lines[-1]
        assert local_artifact(good, set, log=lines.append) == copy and len(lines) == 4  # copied once

        tampered = _stored_artifact(tmp_path / "b", {**files, "config.json": b'{"x": 1}'}, manifest=files)
        tampered.id = "art-2"
        try:
            local_artifact(tampered, set, log=lines.append)
            raise AssertionError("a file unlike its manifest was accepted")
        except ValueError as exc:
            assert "art-2: config.json arrived with 8 bytes" in str(exc) and "its manifest says 2 bytes" in str(exc)
        cache = tmp_path / "host" / "cache" / "artifacts"
        assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["art-1"]
    finally:
        get_settings.cache_clear()


def test_the_cache_drops_the_least_recently_used_copies_that_no_endpoint_serves(tmp_path):
    from worker.model_cache import trim

    for i, name in enumerate(["art-old", "art-served", "art-mid", "art-new"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    removed: list[str] = []
    trim(tmp_path, budget=2500, keep={"art-served"}, log=removed.append)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["art-new", "art-served"]
    assert [line.split()[6] for line in removed] == ["art-old", "art-mid"]  # oldest first, the served one kept
