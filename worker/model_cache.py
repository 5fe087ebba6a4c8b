"""Base models from remote sources (``gs://`` and other fsspec URLs), copied once per host.

Tunix's safetensors loader reads local files, so a worker copies a registered remote checkpoint to
``<data dir>/models/cache/<name>-<hash of the URL>/`` before it trains. One copy of a source at a time:
a copy holds that source's lock (a file lock beside it, so it holds across the processes and hosts that
share the data dir), writes into a temporary directory of its own and renames it into place when every
file is there. So a process that waits for the lock finds the model there, an interrupted copy is never
mistaken for a model, and two copies at once never publish a partial directory.
"""

from __future__ import annotations

import hashlib
import posixpath
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import fsspec
from filelock import FileLock


def cached_copy(source: str, cache_root: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """The local copy of the checkpoint directory at URL ``source`` (made now if missing)."""
    dest = cache_root / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"
    if dest.is_dir():
        return dest
    cache_root.mkdir(parents=True, exist_ok=True)
    with FileLock(cache_root / f".{dest.name}.lock"):
        if dest.is_dir():  # copied by another process while this one waited
            return dest
        for partial in cache_root.glob(f".{dest.name}.partial*"):  # copies that died half-way
            shutil.rmtree(partial, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=cache_root))
        try:
            _copy(source, tmp, name, log)
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
