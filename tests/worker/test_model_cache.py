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
